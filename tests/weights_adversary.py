"""Adversarial holders of weight files, for tests: handlers for `node.serve(wire.WEIGHTS_PROTOCOL, ...)` that
speak the weights protocol correctly and lie about the bytes. Test helpers only: the real `FileShare` has no
such options."""

from __future__ import annotations

import asyncio

from swarm.net import messages as net_messages, wire
from swarm.errors import NotServing
from swarm.weights.messages import CHUNK_BYTES, GET, HAVE, Chunk, End, Get, Have, Held


class LyingHolder:
    """Claims to hold `files` ({sha256: true bytes}) and sends their bytes with `corrupt` applied to each chunk
    (by default every byte flipped). With `break_after`, it closes the stream once it sent that many bytes of
    a `get` (bytes already sent stay wrong)."""

    def __init__(self, files: dict[str, bytes], corrupt=None, break_after: int | None = None):
        self.files = files
        self.corrupt = corrupt or (lambda data: bytes(b ^ 0xFF for b in data))
        self.break_after = break_after
        self.sent = 0  # bytes of chunks sent, over every request

    async def handler(self, stream) -> None:
        for _ in range(64):
            try:
                msg = await asyncio.wait_for(wire.read_message(stream.reader, 0), 10)
            except (EOFError, asyncio.TimeoutError):
                return
            if msg.type == HAVE:
                asked = Have.from_message(msg).sha256s
                held = Held({s: len(self.files[s]) for s in asked if s in self.files})
                await wire.write_message(stream.writer, held.to_message())
                continue
            if msg.type != GET or Get.from_message(msg).sha256 not in self.files:
                error = net_messages.Error.of(NotServing("not here"))
                await wire.write_message(stream.writer, error.to_message())
                continue
            request = Get.from_message(msg)
            data = self.files[request.sha256][request.offset:request.offset + request.length]
            for pos in range(0, len(data), CHUNK_BYTES):
                if self.break_after is not None and pos >= self.break_after:
                    return  # the transport closes the stream
                chunk = self.corrupt(data[pos:pos + CHUNK_BYTES])
                await wire.write_message(stream.writer, Chunk(chunk).to_message())
                self.sent += len(chunk)
            await wire.write_message(stream.writer, End(len(data)).to_message())


class Switch:
    """One handler per node and protocol: this one passes each stream to whatever `target` is now."""

    def __init__(self):
        self.target = None

    async def handler(self, stream) -> None:
        if self.target is not None:
            await self.target(stream)
