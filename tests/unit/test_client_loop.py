"""The client's plumbing below the network: the loop thread, reply deadlines and reply size caps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from client.loop import LoopThread
from swarm.net import wire
from swarm.net.calls import exchange, info
from swarm.errors import ProtocolError, StepTimeout
from swarm.net.transport import Stream

pytestmark = pytest.mark.unit


def test_a_timed_out_call_is_cancelled_not_left_running():
    state = {}

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    with LoopThread() as lt:
        with pytest.raises(TimeoutError):
            lt.run(slow(), timeout=0.1)
        deadline = time.monotonic() + 5
        while "cancelled" not in state and time.monotonic() < deadline:
            time.sleep(0.01)
    assert state == {"cancelled": True}


def test_a_silent_peer_is_a_step_timeout_not_a_lost_connection():
    async def run():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            with pytest.raises(StepTimeout, match="no reply within"):
                await exchange(Stream(reader, writer, "peer"), wire.Message(wire.INFO), 0.1)
        finally:
            writer.close()
            theirs.close()

    asyncio.run(run())


class _OneStream:
    """A node whose every stream is `stream` (one end of a local socket pair)."""

    def __init__(self, stream: Stream):
        self.stream = stream

    async def open(self, peer, protocol):
        return self.stream


@contextlib.asynccontextmanager
async def _peer_replying(reply: wire.Message):
    """A stream to a "peer" that sends `reply` (in the background: it may not fit in the socket buffer)."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    _, peer_writer = await asyncio.open_connection(sock=theirs)
    sending = asyncio.create_task(wire.write_message(peer_writer, reply))
    try:
        yield Stream(reader, writer, "peer")
    finally:
        sending.cancel()
        peer_writer.close()
        writer.close()


def test_an_info_reply_may_carry_no_tensor_bytes():
    hidden = wire.Blob("float32", (256, 1024), bytes(1 << 20))  # 1 MiB that an untrusted peer sends with "info"

    async def run():
        async with _peer_replying(wire.Message(wire.INFO, {"model": "m"}, (hidden,))) as stream:
            with pytest.raises(ProtocolError, match="exceeds the limit of 0"):
                await info(_OneStream(stream), "peer", timeout=5)
        # a call whose reply carries hidden states (a forward) still reads them whole
        async with _peer_replying(wire.Message(wire.OUTPUT, {}, (hidden,))) as stream:
            reply = await exchange(stream, wire.Message(wire.FORWARD), 5)
            assert reply.type == wire.OUTPUT and len(reply.tensors[0].data) == 1 << 20

    asyncio.run(run())
