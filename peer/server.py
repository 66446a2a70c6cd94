"""A peer's life: join the swarm, measure what a block costs here, choose and load its blocks, announce,
serve, move when the swarm needs it, leave cleanly.

    joining  -> announced before the weights load, so a peer started right after sees the blocks taken
    online   -> serving sessions, re-announced every `announce_interval` with its speed, load and cache left
    offline  -> announced on a clean stop, then the records expire

Placement is `peer.placement`'s (how many blocks and where, by measured speed and memory); this module
only carries it out. A move (docs/operations.md): claim the new span as `joining` (keeping the old one
online), wait `CLAIM_SETTLE_S` and defer to an earlier claim, load the new span, announce it online and
the rest of the old one offline, then drain the old span's sessions (they finish, or are closed at
`--drain-timeout` and fail over exactly). When both spans do not fit in memory, the old one goes offline
first. A peer with `--blocks` or `--no-rebalance` never moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from peer.announcer import Announcer, Figures
from peer.balancer import Distances, Links, SwarmView, jittered
from peer.capacity import BlockCost, Capacity, CapacityCache, measure_block
from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.push import Pusher
from peer.runtime import Runtime
from peer.servicer import Served, Servicer
from peer.sessions import SessionTable
from peer.weights import Sharing
from swarm import __version__
from swarm.cli import cache_home
from swarm.net import known_peers
from swarm.net.reach import RelayLimits
from swarm.net import view, wire
from peer import placement, selection
from swarm.model import kv
from swarm.model.blocks import SpanBlocks
from swarm.model.checkpoint import Checkpoint, parse_dtype
from swarm.errors import SwarmError, SwarmUnreachable
from swarm.net.identity import Identity, load_or_create
from swarm.model.precision import Precision
from swarm.net.record_service import records_handler
from swarm.net.records import check_model_id
from swarm.span import Span, check_start, span_starts
from swarm.net.transport import Node, describe_peer
from swarm.weights.models import open_weights

logger = logging.getLogger(__name__)

JOIN_TRYING_S = 1800.0  # how long a peer keeps trying to join a swarm none of whose peers answers
CLAIM_SETTLE_S = 1.0  # after claiming a span: time for other claims to show before deciding to go on
EARLY_ANNOUNCE_S = 1.0  # announcements brought forward by released cache are at least this far apart
OFFLINE_ANNOUNCE_S = 2.0  # a stopping peer waits this long at most for its offline records to be stored


@dataclass(frozen=True)
class PeerReady:
    peer_id: str
    model_id: str
    span: Span
    maddrs: tuple[str, ...]


def available_memory() -> int:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 4 * 2**30


def memory_blocks(ckpt: Checkpoint, config: PeerConfig, precision: Precision | None = None) -> int:
    """How many blocks this peer may hold: --num-blocks, else what fits in its memory budget (default: 80%
    of the device's free memory: the GPU's on CUDA, else the host's). A block's weights are counted in
    the peer's format, so a quantized peer holds proportionally more blocks."""
    if config.num_blocks is not None:
        return max(1, min(config.num_blocks, ckpt.num_blocks))
    named = config.dtype if config.dtype not in (None, "auto") else "float32"
    precision = precision or Precision(torch.device("cpu"), named, config.quant)
    dtype = parse_dtype(precision.dtype)
    budget = config.memory_budget or int(0.8 * (precision.memory() or available_memory()))
    block_bytes = max(ckpt.block_bytes(b, dtype, precision.quant) for b in range(ckpt.num_blocks))
    return selection.blocks_for_budget(budget, block_bytes, config.cache_tokens * ckpt.cache_bytes_per_token(dtype),
                                       ckpt.num_blocks)


def block_cost(ckpt: Checkpoint, model_id: str, config: PeerConfig, precision: Precision) -> BlockCost:
    """What one block costs on this machine: cached per (model, device, format), else measured on block 0."""
    cache = CapacityCache(config.capacity_cache)
    key = cache.key(model_id, str(precision.device), precision.format)
    cost = cache.get(key, time.time())
    if cost is not None:
        logger.info("block cost from %s: %.2f ms per decode step per block", config.capacity_cache, cost.decode_ms)
        return cost
    logger.info("measuring what a block of %s costs on this machine (%s)", model_id, precision.describe())
    block = SpanBlocks(ckpt.stand_in(), Span(0, 1), precision.dtype, precision.device, quant=precision.quant)
    cost = measure_block(block)
    cache.put(key, cost)
    logger.info("measured the block cost: %.2f ms per decode step per block, %.3f ms per prefill token",
                cost.decode_ms, cost.prefill_ms)
    return cost


def first_span(config: PeerConfig, served: list[view.Server], peer: str, speed: float, memory: int,
               num_blocks: int, near: set[str] | None, starts: Sequence[int]) -> placement.Score:
    """The span to start with: --blocks (`check_start`), else the placement's choice (--num-blocks fixes the length)."""
    if config.blocks is not None:
        check_start(config.blocks, starts, num_blocks)
        return placement.score([0.0] * num_blocks, config.blocks, speed)
    return placement.plan(served, peer, speed, memory, num_blocks, near,
                          min_blocks=memory if config.num_blocks is not None else 1, starts=starts)


@contextlib.asynccontextmanager
async def metrics_endpoint(metrics: PeerMetrics, config: PeerConfig, name: str):
    """`/metrics` on --metrics-host:--metrics-port for the peer's whole life, if asked for. Bound before the
    blocks load, so a port in use stops the peer before it announces anything."""
    if config.metrics_port is None:
        yield None
        return
    server = await metrics.serve(config.metrics_host, config.metrics_port)
    logger.info("peer %s metrics at %s/metrics", name, server.url)
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def joined(make_node: Callable[[], Node], stop: asyncio.Event) -> AsyncIterator[Node | None]:
    """The peer's node, joined. While none of its initial peers (nor any peer it met before) answers, it keeps
    trying: waits doubling from 5 s to 60 s, for `JOIN_TRYING_S` at most; None if asked to stop meanwhile."""
    wait, deadline = 5.0, time.monotonic() + JOIN_TRYING_S
    while True:
        try:
            node = await make_node().__aenter__()
            break
        except SwarmUnreachable as e:
            if time.monotonic() + wait > deadline:
                raise
            logger.warning("%s; trying again in %.0f s", e, wait)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():
                yield None
                return
            wait = min(2 * wait, 60.0)
    try:
        yield node
    finally:
        await node.__aexit__(None, None, None)


async def serve(config: PeerConfig, stop: asyncio.Event,
                on_ready: Callable[[PeerReady], None] | None = None) -> None:
    """Run a peer until `stop` is set."""
    loop = asyncio.get_running_loop()
    precision = Precision.of(config.device, config.dtype, config.quant)  # a missing device stops it here
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    identity = load_or_create(config.identity) if config.identity else Identity.generate()
    weights = await loop.run_in_executor(None, functools.partial(
        open_weights, config.model, config.revision, role="peer", model_id=config.model_id))
    model_id = check_model_id(weights.name)
    ckpt = await loop.run_in_executor(None, functools.partial(Checkpoint, weights.directory, source=weights.source))
    if weights.hub is not None:  # the shards' shapes (which size the memory budget), read off the loop
        await loop.run_in_executor(None, weights.hub.load_shapes)
    metrics = PeerMetrics()

    def node() -> Node:
        return Node(identity, identity_path=config.identity, host=config.host, port=config.port,
                    announce_host=config.announce_host, announce_port=config.announce_port,
                    initial_peers=config.initial_peers, reachability=config.reachability,
                    relay=RelayLimits(reservations=config.relay_slots),
                    known_peers=known_peers.path_for(config.identity, Path(cache_home())))

    async with joined(node, stop) as node, metrics_endpoint(metrics, config, describe_peer(identity.peer_id)):
        if node is None:  # asked to stop while it could not join
            return
        peer = Peer(config, node, identity, ckpt, model_id, metrics, precision, digest=weights.digest)
        peer.sharing = Sharing(node, weights, ckpt.num_blocks, config, cache_home())
        if weights.hub is not None:
            peer.source_stop = weights.hub.stop = threading.Event()
        await peer.run(stop, on_ready)


class Peer:
    """One peer's life on a running node: measure, choose, load, serve, rebalance, leave."""

    def __init__(self, config: PeerConfig, node: Node, identity: Identity, ckpt: Checkpoint, model_id: str,
                 metrics: PeerMetrics, precision: Precision | None = None, digest: str | None = None):
        self.config, self.node, self.identity, self.ckpt, self.model_id = config, node, identity, ckpt, model_id
        self.digest = digest
        self.sharing: Sharing | None = None  # weight files given to and taken from peers of the same weights
        self.stop: asyncio.Event | None = None  # set when the peer should leave
        self.source_stop: threading.Event | None = None  # tells the checkpoint's source to fetch nothing more
        self.metrics, self.name = metrics, describe_peer(node.peer_id)
        self.precision = precision or Precision.of(config.device, config.dtype, config.quant)
        self.memory = memory_blocks(ckpt, config, self.precision)
        self.view = SwarmView(node, model_id, ckpt.num_blocks, digest=digest)
        self.links = Links(node, model_id, ckpt.num_blocks, digest)
        self.distances, self.near = Distances(node), None  # the peers near this one (placement's region)
        self.movable = config.blocks is None and config.rebalance
        self.rng = random.Random()
        self.servicer: Servicer | None = None
        self.announcer: Announcer | None = None
        self.draining: tuple[SpanBlocks, Span, float] | None = None  # old blocks, their span, drain deadline
        self.released = asyncio.Event()  # sessions gave cache back since the loop last looked
        self.announced = (0, -math.inf)  # cache tokens left in the last announcement, and when it was made

    @property
    def span(self) -> Span:
        return self.servicer.served.span if self.servicer is not None else self.announcer.span

    def _load(self, span: Span, reuse: SpanBlocks | None) -> SpanBlocks:
        p = self.precision
        blocks = SpanBlocks(self.ckpt, span, p.dtype, p.device, reuse=reuse, quant=p.quant)
        blocks.size_pool(self.config.cache_tokens)  # the sessions' cache: blocks allocated as they are written
        logger.info("blocks %s: %d bytes of cache per token", span, blocks.kv_layout.token_bytes)
        return blocks

    def figures(self) -> Figures:
        n = len(self.announcer.span)  # the span announced: the claimed one while moving
        servicer = self.servicer
        return Figures(self.capacity.throughput(n), self.capacity.prefill_tps(n),
                       servicer.sessions.available(None, time.monotonic()) if servicer else 0,
                       len(servicer.sessions.sessions) if servicer else 0,
                       servicer.runtime.queued if servicer else 0, self.links.announced(), self.memory,
                       (self.precision.device_kind, self.precision.dtype, self.precision.quant))

    async def announce(self, state: str, **kw) -> None:
        if self.servicer is not None:
            self.servicer.served.throughput = self.capacity.throughput(len(self.span))
        figures = self.figures()
        self.announced = (figures.cache_tokens_left, time.monotonic())
        await self.announcer.announce(state, figures, **kw)

    def _announce_due(self, due: float) -> float:
        """When to announce next: `due`, or soon after sessions released a share of the cache since the last
        announcement, so clients that read "no room" learn of the room within one announcement."""
        if not self.released.is_set():
            return due
        self.released.clear()
        sessions = self.servicer.sessions
        if sessions.available(None, time.monotonic()) - self.announced[0] < max(1, sessions.token_share):
            return due
        return min(due, self.announced[1] + EARLY_ANNOUNCE_S)

    async def run(self, stop: asyncio.Event, on_ready: Callable[[PeerReady], None] | None) -> None:
        loop = asyncio.get_running_loop()
        config, ckpt = self.config, self.ckpt
        if self.sharing is not None:
            await self.sharing.start()
        cost = await loop.run_in_executor(None, block_cost, ckpt, self.model_id, config, self.precision)
        self.capacity = Capacity(cost)
        served = await self.view.read()
        self.near = await self.distances.near(served) if config.blocks is None else None
        choice = first_span(config, served, self.node.peer_id, self.capacity.speed, self.memory, ckpt.num_blocks,
                            self.near, span_starts(ckpt.config))
        span = choice.span
        logger.info("peer %s chose blocks %s of %d (room for %d, %.1f tokens/s per block; swarm bottleneck %.2f "
                    "tokens/s with it; %d peers near, %d blocks none of them serves)", self.name, span, ckpt.num_blocks,
                    self.memory, self.capacity.speed, choice.bottleneck, len(self.near or ()), choice.local)
        self.announcer = Announcer(self.node, self.identity, self.model_id, span, ckpt.num_blocks, config.record_ttl,
                                   self.digest)
        await self.announce("joining")
        logger.info("peer %s loading blocks %s of %s", self.name, span, self.model_id)
        self.stop = stop
        blocks = await self._announcing(loop.run_in_executor(None, self._load, span, None), "joining")
        if blocks is None:
            logger.info("peer %s stopped while loading blocks %s", self.name, span)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.announce("offline"), OFFLINE_ANNOUNCE_S)
            return
        sessions = SessionTable(config.cache_tokens, config.max_sessions, config.client_share, config.reclaim_idle,
                                self.released.set)
        served_info = Served(self.node.peer_id, self.model_id, span, __version__, self.capacity.throughput(len(span)),
                             self.capacity.prefill_tps(len(span)), self.digest)
        with Runtime(config.max_queue, between=kv.collect_all) as runtime:  # closed sessions' blocks freed there
            servicer = self.servicer = Servicer(config, served_info, blocks, runtime, sessions, self.metrics,
                                                self.precision)
            servicer.capacity = self.capacity
            servicer.pusher = Pusher(self.node) if config.push else None
            self.metrics.watch(servicer.info, servicer.cache_memory)
            for protocol, handler in ((wire.SESSION_PROTOCOL, servicer.serve_session),
                                      (wire.PUSH_PROTOCOL, servicer.serve_push),
                                      (wire.FORWARD_PROTOCOL, servicer.serve_forward),
                                      (wire.INFO_PROTOCOL, servicer.serve_info)):
                await self.node.serve(protocol, servicer.guarded(handler))
            await self.node.serve(wire.RECORDS_PROTOCOL, records_handler(self.node))
            await self.announce("online")
            maddrs = tuple(await self.node.maddrs())
            logger.info("peer %s serving blocks %s of %s (%s, %.1f tokens/s decode) at %s", self.name, span,
                        self.model_id, self.precision.describe(), servicer.served.throughput, maddrs[0] if maddrs else "?")
            if on_ready is not None:
                on_ready(PeerReady(self.node.peer_id, self.model_id, span, maddrs))
            try:
                await self.loop(stop)
            finally:
                logger.info("peer %s leaving: announcing blocks %s offline", self.name, self.span)
                with contextlib.suppress(Exception):  # leaving anyway: records expire if this fails
                    await asyncio.wait_for(asyncio.shield(self.announce("offline")), OFFLINE_ANNOUNCE_S)
                self.distances.close()
                if servicer.pusher is not None:
                    await servicer.pusher.close()

    async def loop(self, stop: asyncio.Event) -> None:
        """Re-announce every `announce_interval`; look for holes every `check_interval` and re-evaluate the
        span on a jittered `rebalance_interval` (at once when a hole shows)."""
        config = self.config
        now = time.monotonic()
        next_announce = now + config.announce_interval
        next_check = now + min(config.check_interval, config.rebalance_interval)
        next_rebalance = now + jittered(config.rebalance_interval, self.rng)
        while not stop.is_set():
            next_announce = self._announce_due(next_announce)
            wake = min(next_announce, next_check if self.movable else math.inf, self._drain_deadline())
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.released.wait())]
            await asyncio.wait(waits, timeout=max(0.0, wake - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if stop.is_set():
                return
            now = time.monotonic()
            try:
                # boundary for each duty: a failure is logged and retried at its next turn
                self._drain(now)
                if now >= next_announce:
                    next_announce = now + config.announce_interval
                    if self.servicer.pusher is not None:  # a peer that does not push has no links to announce
                        await self.links.measure(self.servicer.pusher.targets(), self.span.end)
                    await self.announce("online")
                if self.movable and now >= next_check:
                    next_check = now + config.check_interval
                    if self.view.read_due(now, config.check_interval) or now >= next_rebalance:
                        served = await self.view.read()
                    else:  # a quiet swarm: only its sole servers are pinged
                        served = await self.view.check()
                    hole = placement.holes(placement.capacities(self.ckpt.num_blocks, served + [self._me()]))
                    if hole:
                        self.view.stale()
                    if hole or now >= next_rebalance:
                        next_rebalance = now + jittered(config.rebalance_interval, self.rng)
                        await self.rebalance(served)
            except Exception:  # boundary: see above
                logger.warning("peer %s: announcing or rebalancing failed", self.name, exc_info=True)

    def _me(self) -> view.Server:
        return view.Server(self.node.peer_id, self.span, self.capacity.throughput(len(self.span)))

    def _decide(self, served: list[view.Server]) -> placement.Score | None:
        return placement.decide(served, self.node.peer_id, self.capacity.speed, self.memory, self.ckpt.num_blocks,
                                self.span, min_blocks=self.memory if self.config.num_blocks is not None else 1,
                                near=self.near, starts=span_starts(self.ckpt.config))

    async def _announcing(self, work: asyncio.Future, state: str):
        """`work`'s result, re-announcing `state` every announce interval meanwhile (a long download must
        not let this peer's records expire); None if the peer is stopped first (a fetch stops between
        files)."""
        stopped = asyncio.ensure_future(self.stop.wait()) if self.stop is not None else None
        try:
            for _ in range(1_000_000):
                waiting = {work} | ({stopped} if stopped is not None else set())
                done, _ = await asyncio.wait(waiting, timeout=self.config.announce_interval,
                                             return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    return work.result()
                if stopped is not None and stopped in done:
                    if self.source_stop is not None:
                        self.source_stop.set()
                    work.add_done_callback(lambda f: f.exception())  # its outcome no longer matters
                    return None
                with contextlib.suppress(Exception):  # announcing again next time
                    await self.announce(state)
            return await work
        finally:
            if stopped is not None:
                stopped.cancel()

    async def _fetch_for(self, decision: placement.Score) -> placement.Score | None:
        """Fetch the files a move to `decision.span` lacks before claiming it, while the old span keeps
        serving; the swarm may have changed meanwhile, so the move is decided again after a download."""
        names = self.ckpt.names_for(decision.span)
        missing = self.ckpt.missing_files(names)
        if not missing:
            return decision
        logger.info("peer %s: fetching %d files for blocks %s before claiming them", self.name, len(missing), decision.span)
        try:
            done = await self._announcing(asyncio.get_running_loop().run_in_executor(None, self.ckpt.fetch, names),
                                          "online")
        except SwarmError as exc:
            logger.warning("peer %s: staying on blocks %s: %s", self.name, self.span, exc)
            return None
        if done is None and self.stop is not None and self.stop.is_set():
            return None
        return self._decide(await self.view.read())

    async def rebalance(self, served: list[view.Server]) -> None:
        """Move if the placement says so: claim the new span (joining), let claims meet, defer to an earlier
        one, then load the new span, announce it online and drain the old one."""
        if self.draining is not None:
            return  # one move at a time
        self.near = await self.distances.near(served)
        # decided on two reads: one lookup that missed a record (a DHT query timed out under load) must not make
        # a settled peer claim blocks it would give back a second later
        if self._decide(served) is None or (decision := self._decide(await self.view.read())) is None:
            return
        decision = await self._fetch_for(decision)
        if decision is None:
            return
        old_span, old_blocks = self.span, self.servicer.blocks
        target = decision.span
        logger.info("peer %s: moving from blocks %s to %s would raise the swarm's bottleneck to %.2f tokens/s "
                    "(%d blocks unserved after it, %d by near peers): claiming them", self.name, old_span, target,
                    decision.bottleneck, decision.holes, decision.local)
        self.announcer.claim(target)
        await self.announcer.announce("joining", self.figures(), keep=old_span)
        await asyncio.sleep(CLAIM_SETTLE_S)
        served = placement.claims_before(await self.view.read(), self.node.peer_id, self.announcer.since)
        check = self._decide(served)
        if check is None:
            logger.info("peer %s defers to an earlier claim: staying on blocks %s", self.name, old_span)
            self.announcer.claim(old_span)
            await self.announcer.announce("online", self.figures(), keep=target, keep_state="offline")
            return
        if check.span != target:
            target = check.span
            self.announcer.claim(target)
            await self.announcer.announce("joining", self.figures(), keep=old_span)
        loop = asyncio.get_running_loop()
        overlap = Span(max(old_span.start, target.start), min(old_span.end, target.end)) \
            if old_span.start < target.end and target.start < old_span.end else None
        both = len(old_span) + len(target) - (len(overlap) if overlap else 0)  # the overlap is held once
        drain_blocks, drain_span = old_blocks, old_span  # what drains once the new span serves
        if both > self.memory and overlap is None:
            logger.warning("peer %s: blocks %s and %s do not fit in memory at once (room for %d blocks): announcing "
                           "%s offline first; its sessions fail over", self.name, old_span, target, self.memory,
                           old_span)
            self.servicer.moving = True
            await self.announcer.announce("joining", self.figures(), keep=old_span, keep_state="offline")
            for session in self.servicer.sessions_on(old_blocks):
                self.servicer.sessions.close(session.id, f"was closed: this peer stopped serving blocks {old_span}")
            self.servicer.blocks = drain_blocks = None
        elif both > self.memory:
            # keep serving the overlap (shared, nothing read) while the rest of the new span loads
            logger.warning("peer %s: blocks %s and %s do not fit in memory at once (room for %d blocks): serving "
                           "only %s while the rest loads; sessions on the rest of %s fail over", self.name, old_span,
                           target, self.memory, overlap, old_span)
            kept = await loop.run_in_executor(None, self._load, overlap, old_blocks)  # nothing read
            self.servicer.activate(kept, overlap)
            for session in self.servicer.sessions_on(old_blocks):
                self.servicer.sessions.close(session.id, f"was closed: this peer stopped serving blocks {old_span}")
            self.announcer.claim(overlap)
            await self.announce("online", keep=old_span, keep_state="offline")
            self.announcer.claim(target)
            await self.announce("joining")  # the overlap's online record still routes clients meanwhile
            drain_blocks, drain_span = kept, overlap
        reuse = drain_blocks if overlap is not None else None
        try:
            logger.info("peer %s loading blocks %s of %s", self.name, target, self.model_id)
            blocks = await loop.run_in_executor(None, self._load, target, reuse)
        finally:
            self.servicer.moving = False
        self.servicer.activate(blocks, target)
        self.servicer.moves += 1
        await self.announce("online", keep=old_span, keep_state="offline")
        if drain_blocks is not None:
            self.draining = (drain_blocks, drain_span, time.monotonic() + self.config.drain_timeout)
        logger.info("peer %s moved from blocks %s to %s (%d sessions draining on the old span)", self.name, old_span,
                    target, len(self.servicer.sessions_on(drain_blocks)) if drain_blocks is not None else 0)

    def _drain_deadline(self) -> float:
        return math.inf if self.draining is None else min(self.draining[2], time.monotonic() + 1.0)

    def _drain(self, now: float) -> None:
        """Drop the old span once its last session closed, or close what is left at the deadline."""
        if self.draining is None:
            return
        blocks, span, deadline = self.draining
        left = self.servicer.sessions_on(blocks)
        if left and now < deadline:
            return
        for session in left:  # its client fails over to the peers now serving it
            self.servicer.sessions.close(session.id, f"was closed: this peer stopped serving blocks {span}")
        logger.info("peer %s stopped serving blocks %s (%d sessions closed at the drain deadline)", self.name, span,
                    len(left))
        self.draining = None
