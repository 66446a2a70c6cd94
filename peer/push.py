"""Passing a chained step's output straight to the next peer of the client's route.

A client that knows its whole route sends a step to the first peer with `next`: the peers after it,
each with its session id there and the step id to use. The peer computes, pushes its output to the
next peer (a PUSH message on the push protocol, one-way) and replies to the client with its output
and `pushed` (whether the push left). The next peer does the same, so a token crosses the network
once per hop; every peer still replies to the client, which keeps each hop's input for exact failover
and relays the step itself when a push did not leave.

Invariants:
- One outbound push stream per next peer, reused across steps and sessions, writes serialized. A
  stream is opened in the background the first time a step names that peer (that step is relayed);
  a stream that fails, or that the other side closed (we never read anything from it), is dropped.
- A write has a short deadline (`write_timeout`), well under the client's step deadlines: a push that
  cannot leave costs one relayed hop, never a failover. A peer that cannot be reached is not tried
  again for `RETRY_S`.
- A push is authorized by the session id (96 random bits, known to the client and to the peers before
  that hop in its route), and only for the session's next step: see `peer.pushed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from swarm.net import wire
from swarm.net.transport import Node, Stream, describe_peer

logger = logging.getLogger(__name__)

MAX_STREAMS = 256  # open push streams at most (one per next peer)
MAX_OPENING = 16  # push streams being opened at once at most
RETRY_S = 10.0  # after a failed open, pushes to that peer are refused (relayed) this long


class Pusher:
    """Outbound push streams of one peer. `push` never opens a stream on a step's path: a missing stream
    is opened in the background and that step is relayed by the client ("connecting")."""

    def __init__(self, node: Node, open_timeout: float = 10.0, write_timeout: float = 1.0):
        self.node, self.open_timeout, self.write_timeout = node, open_timeout, write_timeout
        self._streams: dict[str, Stream] = {}
        self._used: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}
        self._watchers: set[asyncio.Task] = set()
        self.sent = self.failed = 0

    async def push(self, peer: str, msg: wire.Message) -> str | None:
        """Send `msg` to `peer`'s push handler; None once it is written, else why it was not."""
        stream = self._streams.get(peer)
        if stream is None:
            self.failed += 1
            return self._connect(peer)
        self._used[peer] = time.monotonic()
        async with self._locks.setdefault(peer, asyncio.Lock()):
            try:
                await asyncio.wait_for(wire.write_message(stream.writer, msg), self.write_timeout)
            except (ConnectionError, OSError, asyncio.TimeoutError) as e:
                self._drop(peer, stream)
                self.failed += 1
                logger.info("push to peer %s failed (%s): the client relays", describe_peer(peer), type(e).__name__)
                return "write_failed"
        self.sent += 1
        return None

    def _connect(self, peer: str) -> str:
        now = time.monotonic()
        if peer in self._opening:
            return "connecting"
        if now < self._retry_at.get(peer, 0.0):
            return "unreachable"
        if len(self._opening) >= MAX_OPENING:
            return "busy"
        self._retry_at = {p: t for p, t in self._retry_at.items() if t > now}
        task = asyncio.create_task(self._open(peer))
        self._opening[peer] = task
        task.add_done_callback(lambda _: self._opening.pop(peer, None))
        return "connecting"

    async def _open(self, peer: str) -> None:
        try:
            stream = await asyncio.wait_for(self.node.open(peer, wire.PUSH_PROTOCOL), self.open_timeout)
        except Exception as e:  # boundary: whatever stops the open, pushes to that peer wait RETRY_S
            self._retry_at[peer] = time.monotonic() + RETRY_S
            logger.info("cannot open a push stream to peer %s (%s): its clients relay for %.0f s", describe_peer(peer),
                        getattr(e, "code", None) or type(e).__name__, RETRY_S)
            return
        if len(self._streams) >= MAX_STREAMS:  # the least recently used link makes room
            oldest = min(self._streams, key=lambda p: self._used.get(p, 0.0))
            self._drop(oldest, self._streams[oldest])
        self._streams[peer] = stream
        self._used[peer] = time.monotonic()
        task = asyncio.create_task(self._watch(peer, stream))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, peer: str, stream: Stream) -> None:
        """The other side never writes on a push stream: anything read (end of stream) means it is gone."""
        with contextlib.suppress(Exception):  # a broken stream ends the watch the same way
            await stream.reader.read(1)
        self._drop(peer, stream)

    def _drop(self, peer: str, stream: Stream) -> None:
        if self._streams.get(peer) is stream:
            del self._streams[peer]
            self._used.pop(peer, None)
            self._locks.pop(peer, None)
        stream.writer.close()

    async def close(self) -> None:
        for peer, stream in list(self._streams.items()):
            self._drop(peer, stream)
        tasks = [*self._watchers, *self._opening.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def targets(self) -> list[str]:
        """The peers this one has a push stream to, most recently used first."""
        return sorted(self._streams, key=lambda p: -self._used.get(p, 0.0))

    def stats(self) -> dict[str, int]:
        return {"sent": self.sent, "failed": self.failed, "streams": len(self._streams)}
