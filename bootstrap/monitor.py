"""The swarm health monitor: reads the swarm every few seconds and serves what it saw over HTTP.

`Monitor(node, ...)` works on any `Node`: the bootstrap's own (`swarm bootstrap --monitor-port P`) or
a client-mode node of its own (`swarm monitor`, `run` below). Every `interval` seconds it reads the
directory record of every peer (`swarm.net.discovery.directory`), chooses the models to show
(`health.keep_models`), pings each of their peers whose record says `online` with an info call, and
replaces its snapshot (`bootstrap.health`) whole. It serves:

    GET /               the health page (bootstrap/health_page.html: inline CSS and JS, no other asset)
    GET /api/v1/swarm   the snapshot as JSON (schema in docs/monitor.md), serialized once per snapshot
    GET /metrics        swarm-level gauges (peers per model and state, uncovered blocks per model)

Invariants:
- at most `PING_CONCURRENCY` pings run at once, each bounded by `PING_TIMEOUT` seconds; peers that
  answered last time are pinged first, and a round ends `PING_TIMEOUT` seconds after its read may
  have ended at the latest: peers not answered by then count as unreachable, so peers that stall
  cannot hold the snapshot back;
- the models shown are those in the directory now, plus those seen within `health.FORGET_AFTER`
  seconds (all their blocks uncovered once their last records expire), at most `health.MAX_MODELS`;
- a failed read of the swarm keeps the previous snapshot (with its time) and is retried next interval.
  A read fails when it raises or takes too long, and when it finds the directory empty while this node
  knows no other DHT node; an empty directory right after a non-empty one is read again before it is
  believed (a lost reply looks the same as an emptied swarm);
- the page runs only its own inline script and style: the Content-Security-Policy names them by hash;
- never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from importlib import resources

from aiohttp import web
from prometheus_client import CollectorRegistry

from bootstrap import health
from bootstrap.config import MonitorConfig
from swarm.net import calls, discovery
from swarm import http, metrics
from swarm.errors import SwarmError, SwarmUnreachable
from swarm.net.identity import Identity
from swarm.net.records import Announcement
from swarm.span import Span
from swarm.net.transport import Node, describe_peer

logger = logging.getLogger(__name__)

PING_TIMEOUT = 2.0  # seconds a peer may take to answer the info call before it counts as unreachable
PING_CONCURRENCY = 32
MIN_READ_TIME = 5.0  # seconds a read of the directory may take even at short intervals (DHT calls wait 3 s)
LIMITS = metrics.SMALL_LIMITS
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
        self.read_ok = False  # whether the last read of the swarm succeeded
        self._seen: dict[str, health.ModelMemory] = {}
        self._answered: set[str] = set()  # peers that answered the last round's ping
        self._listed = 0  # directory records found by the last successful read
        self._rng = random.Random()
        self._page = _page()
        self._policy = http.content_policy(self._page)
        self.publish(health.Snapshot(None))
        self._server: http.HttpServer | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"{self._server.url}/"

    def publish(self, snapshot: health.Snapshot) -> None:
        """Serve `snapshot` from now on (its JSON document is serialized here, once)."""
        self.snapshot = snapshot
        self._json = json.dumps(snapshot.to_json(self.interval), separators=(",", ":")).encode()

    # ---- reading the swarm ----

    async def _read(self) -> list[Announcement]:
        """The directory records, or `SwarmUnreachable` when an empty read cannot be believed."""
        anns = await discovery.directory(self.node)
        if not anns and self._listed:  # swarms rarely empty between two reads; lost replies look the same
            anns = await discovery.directory(self.node)
        if not anns and self.node.routing_table_size() == 0:
            raise SwarmUnreachable("this node knows no other DHT node: the swarm's directory cannot be read")
        return anns

    async def _ping(self, peer: str) -> health.Ping | None:
        started = time.perf_counter()
        try:
            info = await asyncio.wait_for(calls.info(self.node, peer, timeout=PING_TIMEOUT), PING_TIMEOUT)
        except (asyncio.TimeoutError, SwarmError) as e:
            logger.debug("peer %s did not answer the info call: %s", describe_peer(peer), e)
            return None
        return health.Ping((time.perf_counter() - started) * 1e3, info)

    async def _ping_all(self, peers: list[str], timeout: float) -> dict[str, health.Ping]:
        """Ping `peers` in their order, `PING_CONCURRENCY` at a time, for `timeout` seconds at most; the
        answers by peer id (a peer not answered by then is absent, as one that did not answer)."""
        answers: dict[str, health.Ping] = {}
        queue = iter(peers)

        async def worker() -> None:
            for peer in queue:  # one iterator shared by every worker: each peer is pinged once, in order
                ping = await self._ping(peer)
                if ping is not None:
                    answers[peer] = ping

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(PING_CONCURRENCY))), max(timeout, 0))
        return answers

    async def refresh(self) -> health.Snapshot:
        """Read the directory, ping the online peers of the models kept, and replace the snapshot.

        A failed read raises and leaves the snapshot as it was."""
        read_time = max(self.interval, MIN_READ_TIME)
        deadline = time.monotonic() + read_time + PING_TIMEOUT
        try:
            anns = await asyncio.wait_for(self._read(), read_time)
        except asyncio.TimeoutError:
            self.read_ok = False
            raise SwarmUnreachable(f"reading the swarm's directory took over {read_time:.0f} s") from None
        except Exception:
            self.read_ok = False
            raise
        self.read_ok, self._listed = True, len(anns)
        seen = health.list_models(self._seen, anns, time.time())
        kept = health.keep_models(seen, self._rng)
        online = [a.peer for a in anns if a.model in kept and a.state == "online"]
        # peers that answered last time first; the others in random order, so that peers which stall
        # (listed first by their choice of id or span) cannot keep a new honest peer from its turn
        self._rng.shuffle(online)
        online.sort(key=lambda peer: peer not in self._answered)
        pings = await self._ping_all(online, deadline - time.monotonic())
        now = time.time()
        self._seen = health.learn(seen, kept, anns, pings, now)
        self._answered = set(pings)
        snapshot = health.build_snapshot(anns, pings, {m: self._seen[m].num_blocks for m in kept}, now)
        self._log_changes(self.snapshot, snapshot)
        self.publish(snapshot)
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
            return web.Response(body=self._page, content_type="text/html", charset="utf-8",
                                headers={**no_store, "Content-Security-Policy": self._policy})

        async def snapshot(_request: web.Request) -> web.Response:
            # the document was serialized once for this snapshot; only its age is added per request
            taken_at = self.snapshot.taken_at
            age = None if taken_at is None else round(max(0.0, time.time() - taken_at), 1)
            body = self._json[:-1] + b',"age_s":' + json.dumps(age).encode() + b"}"
            return web.Response(body=body, content_type="application/json", headers=no_store)

        app.router.add_get("/", page)
        app.router.add_get(JSON_PATH, snapshot)
        metrics.add_route(app, registry)
        return app

    def _gauges(self):
        yield from self.snapshot.gauges()
        yield ("swarm_monitor_read_ok", "1 if the monitor's last read of the swarm succeeded, else 0",
               int(self.read_ok), {})
        if self.snapshot.taken_at is not None:
            yield ("swarm_monitor_snapshot_age_seconds", "seconds since the monitor last read the swarm",
                   time.time() - self.snapshot.taken_at, {})

    async def __aenter__(self) -> Monitor:
        self._server = await http.start(self.app(), self.host, self.port, LIMITS, what="the health page", flag="port")
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
