"""The peer's view of the swarm for placement, and the links it measures: the thin async shell around
`peer.placement`.

- `SwarmView.read` returns what every other peer serves or claims (`view.Server`s), block by
  block from the DHT. A record outlives a peer killed outright by up to its TTL, so the peers that are
  the only server of some block are pinged (at most `MAX_PINGS`, `ping_timeout` each): one that does
  not answer counts as gone until it announces again (a newer sequence number). That is what lets a
  hole be filled in seconds rather than a TTL.
- `Links` keeps the round trips to the peers this peer pushes to and to those serving the block after its
  span (an info call each, every announce interval), announced in compact form for the clients' route costs.
- `Distances` keeps the round trips to every other online peer the view shows, for placement: which peers are
  near (its region, `swarm.net.distance.region`). Each is timed when first seen and again `REMEASURE_S` later;
  its round trip is the least of all its info calls (the first may open the connection, a busy peer answers
  late: only the least is the distance). One that does not answer keeps what was measured before (none: not
  near) and is tried again after `RETRY_S`; timings due again run in the background. Until every peer was
  tried the region is unknown (None), as on one machine, where nothing is timed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

from swarm.net import calls, discovery, distance, records, view
from swarm.errors import ConnectionLost, ProtocolError, StepTimeout, SwarmError
from swarm.net.transport import Node, describe_peer

logger = logging.getLogger(__name__)

MAX_PINGS = 8  # sole servers pinged per read at most
QUIET_SLOWDOWN = 8  # a swarm that reads the same every time is read this many check intervals apart at most
LOST_RETRY_S = 0.25  # a peer that cannot be reached is tried once more after this long before it counts as gone
SILENT_PINGS = 3  # pings in a row a peer may leave unanswered (busy, or frozen) before its blocks count as unserved
EMA_ALPHA = 0.3
REMEASURE_S = 300.0  # a peer's round trip is timed again after this long
RETRY_S = 30.0  # one that did not answer, after this long
MAX_TIMED, MAX_AT_ONCE = 64, 16  # peers timed per placement decision at most (the rest at the next one); at once


async def round_trip_ms(node: Node, peer: str, timeout: float) -> float | None:
    """An info call's round trip to `peer` in ms; None if it failed or took longer than `timeout`."""
    started = time.perf_counter()
    try:
        await asyncio.wait_for(calls.info(node, peer, timeout=timeout), timeout)
    except (asyncio.TimeoutError, SwarmError, OSError):
        return None
    return (time.perf_counter() - started) * 1e3


class SwarmView:
    def __init__(self, node: Node, model_id: str, num_blocks: int, ping_timeout: float = 2.0,
                 digest: str | None = None):
        self.node, self.model_id, self.num_blocks, self.ping_timeout = node, model_id, num_blocks, ping_timeout
        self.digest = digest  # only peers with these weights count (others are another swarm)
        self.gone: dict[str, int] = {}  # peer -> the newest sequence number it had when it stopped answering
        self.silent: dict[str, int] = {}  # peer -> pings in a row it left unanswered within `ping_timeout`
        self.last: list[view.Server] = []  # what the last read found
        self.newest: dict[str, int] = {}  # peer -> its newest sequence number in the last read
        self.quiet_reads = 0  # reads in a row that found the same peers on the same spans in the same states
        self.read_at = -math.inf  # when the last read was (monotonic)

    def read_due(self, now: float, check_interval: float) -> bool:
        """Whether a check should read the whole swarm: every check while it changes, up to `QUIET_SLOWDOWN`
        checks apart while it reads the same."""
        return now >= self.read_at + check_interval * min(2 ** min(self.quiet_reads, 8), QUIET_SLOWDOWN) - 1e-3

    def stale(self) -> None:
        """Read the whole swarm at the next check (a hole showed)."""
        self.read_at, self.quiet_reads = -math.inf, 0

    async def check(self) -> list[view.Server]:
        """The last read's servers, less the sole servers of some block that stopped answering since: a few
        info calls instead of a read of every block (a read costs a peer held to a tenth of a core a good
        part of its time). A peer killed or stopped leaves its blocks unserved here within a ping; one that
        answers that it no longer serves all of them (it moved, or is leaving) makes this a whole read."""
        alive = [s for s in self.last if s.peer not in self.gone]
        suspects = sorted(self._sole_servers(alive))[:MAX_PINGS]
        if suspects:
            serving = await self._ping(suspects, self.newest)
            for s in alive:
                if serving.get(s.peer) is not None and s.state == "online" and \
                        not serving[s.peer][0] <= s.span.start < s.span.end <= serving[s.peer][1]:
                    return await self.read()
        return [s for s in alive if s.peer not in self.gone]

    async def read(self) -> list[view.Server]:
        """Every other peer's servers, less the peers that stopped answering."""
        anns = discovery.same_weights(await discovery.announcements(self.node, self.model_id, self.num_blocks),
                                      self.digest)
        newest: dict[str, int] = {}
        for block_anns in anns.values():
            for ann in block_anns:
                newest[ann.peer] = max(newest.get(ann.peer, -1), ann.seq)
        for peer, seq in list(self.gone.items()):
            if newest.get(peer, -1) > seq or peer not in newest:
                del self.gone[peer]  # announced again (it is back), or its records are gone anyway
        served = [s for s in view.servers(anns, self.num_blocks, exclude={self.node.peer_id})
                  if s.peer not in self.gone]
        suspects = sorted(self._sole_servers(served))[:MAX_PINGS]
        if suspects:
            await self._ping(suspects, newest)
            served = [s for s in served if s.peer not in self.gone]
        shape = {(s.peer, s.span, s.state) for s in served}
        self.quiet_reads = self.quiet_reads + 1 if shape == {(s.peer, s.span, s.state) for s in self.last} else 0
        self.last, self.newest, self.read_at = served, newest, time.monotonic()
        return served

    async def _ping(self, peers: list[str], newest: dict[str, int]) -> dict[str, tuple[int, int] | None]:
        """Asks each of `peers` what it serves. One that cannot be reached twice, `LOST_RETRY_S` apart, is gone
        at once (killed: nothing listens; one failed dial under load is not enough); one that stays silent (busy
        under a CPU quota, or frozen) only after `SILENT_PINGS` pings in a row. Returns the blocks [start, end) each peer that answered says it serves (None if it
        answered with an error)."""
        answers = await asyncio.gather(*(self._serving(p) for p in peers))
        out = {}
        for peer, answer in zip(peers, answers):
            if answer == "silent":
                self.silent[peer] = self.silent.get(peer, 0) + 1
            else:
                self.silent.pop(peer, None)
            if answer == "lost" or self.silent.get(peer, 0) >= SILENT_PINGS:
                logger.info("peer %s does not answer: its blocks count as unserved", describe_peer(peer))
                self.gone[peer] = newest.get(peer, -1)
                self.silent.pop(peer, None)
            elif answer != "silent":
                out[peer] = answer
        return out

    def _sole_servers(self, served: list[view.Server]) -> set[str]:
        by_block: dict[int, set[str]] = {}
        for s in served:
            if s.state == "online":
                for b in s.span:
                    by_block.setdefault(b, set()).add(s.peer)
        return {next(iter(peers)) for peers in by_block.values() if len(peers) == 1}

    async def _serving(self, peer: str) -> tuple[int, int] | None | str:
        """The blocks [start, end) `peer` says it serves now ((0, 0) if its answer makes no sense, None if it
        answered with an error); "lost" if it cannot be reached twice, "silent" if no answer came within
        `ping_timeout`."""
        answer = await self._ask(peer)
        if answer == "lost":
            await asyncio.sleep(LOST_RETRY_S)
            answer = await self._ask(peer)
        return answer

    async def _ask(self, peer: str) -> tuple[int, int] | None | str:
        try:
            info = await asyncio.wait_for(calls.info(self.node, peer, timeout=self.ping_timeout), self.ping_timeout)
        except (asyncio.TimeoutError, StepTimeout):
            return "silent"
        except (ConnectionLost, OSError):
            return "lost"
        except ProtocolError:  # a malformed reply: alive, serving nothing that makes sense
            return (0, 0)
        except SwarmError:  # it answered, with an error: alive
            return None
        return info.start, info.end


class Links:
    """Round trips (ms, moving average) to the peers this one may pass activations to: those it pushes to,
    and those online with the same weights serving the block right after its span (the next hop a client
    may chain it to), at most `MAX_LINKS` in all, pushed-to first."""

    def __init__(self, node: Node, model_id: str | None = None, num_blocks: int = 0, digest: str | None = None,
                 timeout: float = 1.0):
        self.node, self.model_id, self.num_blocks, self.digest = node, model_id, num_blocks, digest
        self.timeout = timeout
        self.rtt_ms: dict[str, float] = {}

    async def next_peers(self, end: int) -> list[str]:
        """Peers announcing block `end` online with this peer's weights, newest records first."""
        if self.model_id is None or end >= self.num_blocks:
            return []
        try:  # a read that fails or hangs costs this round's links, never the announcement after them
            found = await asyncio.wait_for(
                discovery.announcements(self.node, self.model_id, self.num_blocks, [end]), self.timeout * 5)
        except (asyncio.TimeoutError, SwarmError, OSError) as e:
            logger.debug("links: reading the peers of block %d failed: %r", end, e)
            return []
        anns = discovery.same_weights(found, self.digest)[end]
        return [a.peer for a in anns if a.state == "online" and a.peer != self.node.peer_id]

    async def measure(self, pushed: list[str], end: int | None = None) -> None:
        """Measure the links to `pushed` and, with `end` (this peer's span end), to the peers serving it."""
        peers = list(dict.fromkeys(pushed + (await self.next_peers(end) if end is not None else [])))
        peers = peers[:records.MAX_LINKS]
        results = await asyncio.gather(*(round_trip_ms(self.node, p, self.timeout) for p in peers))
        for peer, ms in zip(peers, results):
            if ms is None:
                self.rtt_ms.pop(peer, None)
            else:
                old = self.rtt_ms.get(peer)
                self.rtt_ms[peer] = ms if old is None else old + EMA_ALPHA * (ms - old)
        for peer in [p for p in self.rtt_ms if p not in peers]:
            del self.rtt_ms[peer]

    def announced(self) -> dict[str, float] | None:
        """The compact form records carry: last `LINK_ID_CHARS` of each peer id -> ms."""
        return {p[-records.LINK_ID_CHARS:]: round(ms, 1) for p, ms in self.rtt_ms.items()} or None


class Distances:
    """Round trips (ms) to the other peers, and which of them are near (module docstring)."""

    def __init__(self, node: Node, timeout: float = 1.0):
        self.node, self.timeout = node, timeout
        self.rtt_ms: dict[str, float] = {}  # the least round trip ever measured to each peer
        self.timed_at: dict[str, float] = {}  # peer -> when it was last timed, or tried (monotonic)
        self.retiming: asyncio.Task | None = None  # timing the peers due again, in the background

    async def near(self, served: list[view.Server]) -> set[str] | None:
        """The online peers of `served` near this one (empty: none is); None on one machine, or while some are
        not tried yet (the region is not known). Peers never tried are timed now (a newcomer may change the
        region); those due again in the background, so a decision (a hole to fill) never waits on them."""
        if self.node.local:
            return None
        now = time.monotonic()
        peers = list(dict.fromkeys(s.peer for s in served if s.peer != self.node.peer_id and s.state == "online"))
        for gone in [p for p in self.timed_at if p not in peers]:  # bounded by the swarm's size
            self.timed_at.pop(gone)
            self.rtt_ms.pop(gone, None)
        await self._time_all([p for p in peers if p not in self.timed_at][:MAX_TIMED])
        due = [p for p in peers if p in self.timed_at and
               now - self.timed_at[p] >= (REMEASURE_S if p in self.rtt_ms else RETRY_S)][:MAX_TIMED]
        if due and (self.retiming is None or self.retiming.done()):
            self.retiming = asyncio.ensure_future(self._time_all(due))
        if any(p not in self.timed_at for p in peers):
            return None
        return distance.region({p: ms for p, ms in self.rtt_ms.items() if p in peers})

    def close(self) -> None:
        if self.retiming is not None:
            self.retiming.cancel()

    async def _time_all(self, peers: list[str]) -> None:
        """Time `peers`, `MAX_AT_ONCE` at a time; a failure keeps what was measured before (tried again after
        `RETRY_S`)."""
        gate = asyncio.Semaphore(MAX_AT_ONCE)

        async def timed(peer: str) -> float | None:
            async with gate:
                return await self._time(peer)

        now = time.monotonic()
        for peer, ms in zip(peers, await asyncio.gather(*(timed(p) for p in peers))):
            self.timed_at[peer] = now
            if ms is not None:
                self.rtt_ms[peer] = min(ms, self.rtt_ms.get(peer, math.inf))

    async def _time(self, peer: str) -> float | None:
        first = await round_trip_ms(self.node, peer, self.timeout * 5)  # it may open the connection
        if first is None:
            return None
        second = await round_trip_ms(self.node, peer, self.timeout)
        return first if second is None else min(first, second)


def jittered(seconds: float, rng: random.Random, share: float = 0.25) -> float:
    """`seconds` +- `share`, so that peers started together do not re-evaluate together."""
    return seconds * (1 + rng.uniform(-share, share))
