"""The swarm health monitor: reads the swarm every few seconds and serves what it saw over HTTP.

`Monitor(node, ...)` works on any `Node`: the bootstrap's own (`swarm bootstrap --monitor-port P`) or
a client-mode node of its own (`swarm monitor`, `run` below). Every `interval` seconds it reads the
directory record of every peer (`swarm.discovery.directory`), pings each peer whose record says
`online` with an info call, and replaces its snapshot (`bootstrap.health`) whole. It serves:

    GET /               the health page (bootstrap/health_page.html: inline CSS and JS, no other asset)
    GET /api/v1/swarm   the snapshot as JSON (schema in docs/monitor.md)
    GET /metrics        swarm-level gauges (peers per model and state, uncovered blocks per model)

Invariants:
- at most `PING_CONCURRENCY` pings run at once, each bounded by `PING_TIMEOUT` seconds;
- the models shown are those in the directory now, plus those seen within `health.FORGET_AFTER`
  seconds (all their blocks uncovered once their last records expire), at most `health.MAX_MODELS`;
- a failed read of the swarm keeps the previous snapshot (with its time) and is retried next interval;
- never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from importlib import resources

from aiohttp import web
from prometheus_client import CollectorRegistry

from bootstrap import health
from bootstrap.config import MonitorConfig
from swarm import calls, discovery, http, metrics
from swarm.errors import ConfigError, SwarmError
from swarm.identity import Identity
from swarm.span import Span
from swarm.transport import Node, describe_peer

logger = logging.getLogger(__name__)

PING_TIMEOUT = 2.0  # seconds a peer may take to answer the info call before it counts as unreachable
PING_CONCURRENCY = 32
LIMITS = http.Limits(max_connections=64, max_body_bytes=1024)
JSON_PATH = "/api/v1/swarm"


def _page() -> bytes:
    return resources.files("bootstrap").joinpath("health_page.html").read_bytes()


def describe_blocks(blocks: tuple[int, ...]) -> str:
    """Blocks as spans for logs: (3, 4, 5, 9) -> '[3:6) [9:10)'."""
    spans, start = [], None
    for i, b in enumerate(blocks):
        start = b if start is None else start
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            spans.append(str(Span(start, b + 1)))
            start = None
    return " ".join(spans)


class Monitor:
    """`async with Monitor(node, host, port, interval) as monitor:` serves at `monitor.url` until exit."""

    def __init__(self, node: Node, host: str = "127.0.0.1", port: int = 0, interval: float = 5.0):
        self.node, self.host, self.port, self.interval = node, host, port, interval
        self.snapshot = health.Snapshot(None)
        self._seen: dict[str, tuple[int, float]] = {}  # model -> (number of blocks, last time in the directory)
        self._page = _page()
        self._server: http.HttpServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"{self._server.url}/"

    # ---- reading the swarm ----

    async def _ping(self, peer: str, limit: asyncio.Semaphore) -> health.Ping | None:
        async with limit:
            started = time.perf_counter()
            try:
                info = await asyncio.wait_for(calls.info(self.node, peer, timeout=PING_TIMEOUT), PING_TIMEOUT)
            except (asyncio.TimeoutError, SwarmError) as e:
                logger.debug("peer %s did not answer the info call: %s", describe_peer(peer), e)
                return None
            return health.Ping((time.perf_counter() - started) * 1e3, info)

    async def refresh(self) -> health.Snapshot:
        """Read the directory, ping the online peers, and replace the snapshot."""
        anns = await discovery.directory(self.node)
        limit = asyncio.Semaphore(PING_CONCURRENCY)
        online = [a.peer for a in anns if a.state == "online"]
        pings = dict(zip(online, await asyncio.gather(*(self._ping(p, limit) for p in online))))
        now = time.time()
        self._seen = health.remember_models(self._seen, anns, now)
        snapshot = health.build_snapshot(anns, {p: r for p, r in pings.items() if r is not None},
                                         {model: num_blocks for model, (num_blocks, _) in self._seen.items()}, now)
        self._log_changes(self.snapshot, snapshot)
        self.snapshot = snapshot
        return snapshot

    def _log_changes(self, old: health.Snapshot, new: health.Snapshot) -> None:
        before = {m.model: m.uncovered for m in old.models}
        for m in new.models:
            if m.uncovered != before.get(m.model, ()):
                if m.uncovered:
                    logger.warning("model %s: blocks %s have no reachable peer", m.model, describe_blocks(m.uncovered))
                elif m.model in before:
                    logger.info("model %s: every block is served again", m.model)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # boundary: a failed read keeps the last snapshot; the next one may succeed
                logger.warning("reading the swarm failed (%s); the page keeps its last snapshot", e)
            await asyncio.sleep(self.interval)

    # ---- HTTP ----

    def app(self) -> web.Application:
        app = http.make_app(LIMITS)
        registry = CollectorRegistry()
        registry.register(metrics.StateCollector(self._gauges))
        no_store = {"Cache-Control": "no-store"}

        async def page(_request: web.Request) -> web.Response:
            # the page renders peer-supplied strings as text only; the policy forbids anything else anyway
            return web.Response(body=self._page, content_type="text/html", charset="utf-8", headers={
                **no_store, "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'"})

        async def snapshot(_request: web.Request) -> web.Response:
            body = json.dumps(self.snapshot.to_json(self.interval), separators=(",", ":"))
            return web.Response(text=body, content_type="application/json", headers=no_store)

        app.router.add_get("/", page)
        app.router.add_get(JSON_PATH, snapshot)
        metrics.add_route(app, registry)
        return app

    def _gauges(self):
        yield from self.snapshot.gauges()
        if self.snapshot.taken_at is not None:
            yield ("swarm_monitor_snapshot_age_seconds", "seconds since the monitor last read the swarm",
                   time.time() - self.snapshot.taken_at, {})

    async def __aenter__(self) -> Monitor:
        try:
            self._server = await http.start(self.app(), self.host, self.port, LIMITS)
        except OSError as e:
            raise ConfigError(f"cannot serve the health page on {self.host}:{self.port} ({e.strerror or e}); "
                              "choose another port") from None
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._server is not None:
            await self._server.close()


def announce(monitor: Monitor) -> str:
    """Print the line scripts and tests wait for, and log where the page is."""
    print(f"monitor at {monitor.url}", flush=True)
    logger.info("swarm health page at %s (JSON at %s, metrics at %s)", monitor.url, monitor.url.rstrip("/") + JSON_PATH,
                monitor.url + "metrics")
    return monitor.url


# ---- `swarm monitor`: the monitor on a client-mode node of its own ----

async def run(config: MonitorConfig, stop: asyncio.Event, on_ready: Callable[[str], None] | None = None) -> None:
    async with Node(Identity.generate(), initial_peers=config.initial_peers, client_mode=True) as node, \
            Monitor(node, config.host, config.port, config.interval) as monitor:
        url = announce(monitor)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
