"""A peer's life: join the swarm, choose and load its blocks, announce, serve, leave cleanly.

    joining  -> announced before the weights load, so a peer started right after sees the blocks taken
    online   -> serving sessions, re-announced every `announce_interval` with its cache left
    offline  -> announced on a clean stop, then the records expire
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.announcer import Announcer
from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.push import Pusher
from peer.runtime import Runtime
from peer.servicer import Served, Servicer
from peer.sessions import SessionTable
from swarm import __version__, discovery, selection, wire
from swarm.blocks import SpanBlocks
from swarm.checkpoint import Checkpoint, parse_dtype
from swarm.identity import Identity, load_or_create
from swarm.records import check_model_id, default_model_id
from swarm.span import Span
from swarm.transport import Node, describe_peer

logger = logging.getLogger(__name__)


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


async def choose_blocks(node: Node, ckpt: Checkpoint, model_id: str, config: PeerConfig) -> Span:
    """The span to serve: --blocks, else as many blocks as fit, where the swarm is weakest."""
    if config.blocks is not None:
        config.blocks.check_within(ckpt.num_blocks)
        return config.blocks
    dtype = parse_dtype(config.dtype)
    if config.num_blocks is not None:
        n = max(1, min(config.num_blocks, ckpt.num_blocks))
    else:
        budget = config.memory_budget or int(0.8 * available_memory())
        block_bytes = max(ckpt.block_bytes(b, dtype) for b in range(ckpt.num_blocks))
        n = selection.blocks_for_budget(budget, block_bytes, config.cache_tokens * ckpt.cache_bytes_per_token(dtype),
                                        ckpt.num_blocks)
    anns = await discovery.announcements(node, model_id, ckpt.num_blocks)
    counts = selection.coverage(ckpt.num_blocks, anns, exclude=node.peer_id)
    span = selection.choose_span(counts, n)
    logger.info("chose blocks %s of %d (swarm coverage per block: %s)", span, ckpt.num_blocks, counts)
    return span


def measure(blocks: SpanBlocks, dtype: torch.dtype) -> tuple[float, float]:
    """Self-reported speed: batch-1 decode tokens/s and prefill tokens/s of the whole span."""
    cache = blocks.new_cache(1, 64)
    x = torch.randn(1, 1, blocks.hidden_size, dtype=dtype)
    times = []
    for pos in range(8):
        started = time.perf_counter()
        blocks(x, cache, pos)
        times.append(time.perf_counter() - started)
    decode = 1.0 / max(statistics.median(times[3:]), 1e-6)  # the first calls pay one-time setup
    started = time.perf_counter()
    blocks(torch.randn(1, 32, blocks.hidden_size, dtype=dtype))
    prefill = 32 / max(time.perf_counter() - started, 1e-6)
    return round(decode, 2), round(prefill, 2)


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


async def serve(config: PeerConfig, stop: asyncio.Event,
                on_ready: Callable[[PeerReady], None] | None = None) -> None:
    """Run a peer until `stop` is set."""
    loop = asyncio.get_running_loop()
    identity = load_or_create(config.identity) if config.identity else Identity.generate()
    ckpt = await loop.run_in_executor(None, Checkpoint, config.model)
    model_id = config.model_id or default_model_id(config.model)
    check_model_id(model_id)
    dtype = parse_dtype(config.dtype)
    metrics = PeerMetrics()
    async with Node(identity, identity_path=config.identity, host=config.host, port=config.port,
                    announce_host=config.announce_host, announce_port=config.announce_port,
                    initial_peers=config.initial_peers) as node, \
            metrics_endpoint(metrics, config, describe_peer(node.peer_id)):
        name = describe_peer(node.peer_id)
        span = await choose_blocks(node, ckpt, model_id, config)
        announcer = Announcer(node, identity, model_id, span, ckpt.num_blocks, config.record_ttl)
        await announcer.announce("joining")
        logger.info("peer %s loading blocks %s of %s", name, span, model_id)
        blocks = await loop.run_in_executor(None, SpanBlocks, ckpt, span, dtype)
        throughput, prefill_tps = await loop.run_in_executor(None, measure, blocks, dtype)
        sessions = SessionTable(config.cache_tokens, config.max_sessions)
        served = Served(node.peer_id, model_id, span, __version__, throughput, prefill_tps)
        with Runtime(config.max_queue) as runtime:
            servicer = Servicer(config, served, blocks, runtime, sessions, metrics)
            servicer.pusher = Pusher(node) if config.push else None
            metrics.watch(servicer.info)
            await node.serve(wire.SESSION_PROTOCOL, servicer.serve_session)
            await node.serve(wire.PUSH_PROTOCOL, servicer.serve_push)
            await node.serve(wire.FORWARD_PROTOCOL, servicer.serve_forward)
            await node.serve(wire.INFO_PROTOCOL, servicer.serve_info)

            async def announce(state: str) -> None:
                await announcer.announce(state, throughput, prefill_tps, sessions.tokens_left)

            await announce("online")
            maddrs = tuple(await node.maddrs())
            logger.info("peer %s serving blocks %s of %s (%.1f tokens/s decode) at %s", name, span, model_id,
                        throughput, maddrs[0] if maddrs else "?")
            if on_ready is not None:
                on_ready(PeerReady(node.peer_id, model_id, span, maddrs))
            try:
                while not stop.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), config.announce_interval)
                    if not stop.is_set():
                        try:
                            await announce("online")
                        except Exception:  # boundary: a failed re-announcement is retried next interval
                            logger.warning("peer %s: re-announcement failed", name, exc_info=True)
            finally:
                logger.info("peer %s leaving: announcing blocks %s offline", name, span)
                with contextlib.suppress(Exception):  # leaving anyway: records expire if this fails
                    await asyncio.wait_for(asyncio.shield(announce("offline")), 5)
                if servicer.pusher is not None:
                    await servicer.pusher.close()
