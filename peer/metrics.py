"""A peer's Prometheus metrics: one registry per peer process, served at `/metrics` with --metrics-port.

The servicer reports events through `PeerMetrics` (sessions opened, steps, forwards, errors, their
timings) and never touches prometheus itself. State (sessions open, cache used, steps queued) is read
from `Servicer.info()` at scrape time, on the event loop, so it always agrees with what `info` answers.
All names start with `swarm_peer_`; times are in seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from swarm import metrics as swarm_metrics
from swarm.http import HttpServer
from swarm.metrics import LATENCY_BUCKETS, StateCollector

INFO_LABELS = ("peer", "model", "start", "end", "version", "device", "dtype", "quant")
BATCH_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def state(info: Any) -> list[tuple[str, str, float, dict[str, str]]]:
    """The scrape-time gauges, from a `Servicer.info()` (`messages.Info`, or its fields as a dict)."""
    info = info if isinstance(info, dict) else dataclasses.asdict(info)
    used = info["cache_tokens"] - info["cache_tokens_left"]
    return [
        ("swarm_peer_info", "the served model and blocks [start, end); always 1",
         1, {k: str(info[k]) for k in INFO_LABELS}),
        ("swarm_peer_sessions_open", "inference sessions open", info["sessions"], {}),
        ("swarm_peer_max_sessions", "inference sessions open at most (--max-sessions)", info["max_sessions"], {}),
        ("swarm_peer_cache_tokens", "attention cache budget in tokens (--cache-tokens)", info["cache_tokens"], {}),
        ("swarm_peer_cache_tokens_used", "cache tokens committed to open sessions (as they grow)",
         used, {}),
        ("swarm_peer_cache_tokens_left", "cache tokens free for new sessions", info["cache_tokens_left"], {}),
        ("swarm_peer_queued_steps", "session steps and forwards waiting for the compute thread", info["queued"], {}),
    ]


def cache_state(memory: dict[str, int]) -> list[tuple[str, str, float, dict[str, str]]]:
    """The scrape-time gauges of the cache's memory (`Servicer.cache_memory`)."""
    return [
        ("swarm_peer_cache_bytes", "memory the sessions' keys and values take now (pages written, a block shared by "
         "several sessions once)", memory["bytes"], {}),
        ("swarm_peer_cache_blocks", "cache blocks sessions hold (a shared block once)", memory["blocks"], {}),
        ("swarm_peer_cache_blocks_shared", "cache blocks held by more than one session (forks' prefixes)",
         memory["shared"], {}),
        ("swarm_peer_cache_token_bytes", "bytes one token takes in the cache of the served blocks (keys and values "
         "of every attention block)", memory["token_bytes"], {}),
    ]


class PeerMetrics:
    """Counters and histograms of one peer, in `self.registry`; `watch(info)` adds the state gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._opened = Counter("swarm_peer_sessions_opened", "inference sessions opened", registry=r)
        self._steps = Counter("swarm_peer_steps", "session steps computed", registry=r)
        self._forwards = Counter("swarm_peer_forwards", "stateless forwards computed", registry=r)
        self._tokens = Counter("swarm_peer_tokens", "tokens run through the served blocks (batch x tokens of "
                               "each step and forward)", registry=r)
        self._forked = Counter("swarm_peer_sessions_forked", "sessions opened as a copy of another session's cache "
                               "(also counted as opened)", registry=r)
        self._tokens_forked = Counter("swarm_peer_tokens_forked", "cache tokens copied into forked sessions (batch x "
                                      "positions), never run through the blocks", registry=r)
        self._errors = Counter("swarm_peer_errors", "requests answered with an error, by error code", ["code"],
                               registry=r)
        self._step_compute = Histogram("swarm_peer_step_compute_seconds", "compute time of a session step",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self._forward_compute = Histogram("swarm_peer_forward_compute_seconds", "compute time of a forward",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self._batch_size = Histogram("swarm_peer_batch_size", "sessions whose one-token steps shared one forward "
                                     "(only forwards shared by two or more)", buckets=BATCH_BUCKETS, registry=r)
        self._step_latency = Histogram("swarm_peer_step_seconds", "a session step as the peer sees it: from its "
                                       "message read to its reply written (queue and compute included)",
                                       buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, info: Callable[[], dict[str, Any]], memory: Callable[[], dict[str, int]] | None = None) -> None:
        """Gauges of `info()` and, if given, of `memory()` (the cache's memory: `Servicer.cache_memory`)."""
        self.registry.register(StateCollector(lambda: state(info())))
        if memory is not None:
            self.registry.register(StateCollector(lambda: cache_state(memory())))

    async def serve(self, host: str, port: int) -> HttpServer:
        """An HTTP server with only `/metrics`; the caller closes it."""
        return await swarm_metrics.serve(self.registry, host, port, flag="--metrics-port")

    def opened(self) -> None:
        self._opened.inc()

    def forked(self, tokens: int) -> None:
        self._forked.inc()
        self._tokens_forked.inc(tokens)

    def stepped(self, tokens: int, compute_s: float) -> None:
        self._steps.inc()
        self._tokens.inc(tokens)
        self._step_compute.observe(compute_s)

    def batched(self, sessions: int) -> None:
        self._batch_size.observe(sessions)

    def step_replied(self, seconds: float) -> None:
        self._step_latency.observe(seconds)

    def forwarded(self, tokens: int, compute_s: float) -> None:
        self._forwards.inc()
        self._tokens.inc(tokens)
        self._forward_compute.observe(compute_s)

    def failed(self, code: str) -> None:
        self._errors.labels(code=code).inc()
