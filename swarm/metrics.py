"""Prometheus metrics: each process keeps its own registry and serves it as text at `/metrics`.

Counters and histograms are updated where things happen; figures that are state (sessions open,
cache left) are read when scraped, by a collector, so they cannot drift from the truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from swarm import http

# latency buckets in seconds, from a loopback decode step to a slow prefill
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class StateCollector(Collector):
    """Gauges read at scrape time: `read()` returns (name, help, value, labels) tuples."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, float, dict[str, str]]]]):
        self.read = read

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        for name, help_text, value, labels in self.read():
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, help_text, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], float(value))
        return list(families.values())


def render(registry: CollectorRegistry) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_route(app: web.Application, registry: CollectorRegistry) -> None:
    async def metrics(_request: web.Request) -> web.Response:
        return render(registry)

    app.router.add_get("/metrics", metrics)


SMALL_LIMITS = http.Limits(max_connections=64, max_body_bytes=1024)  # for servers that take no request bodies


async def serve(registry: CollectorRegistry, host: str, port: int, flag: str = "--port") -> http.HttpServer:
    """A server with only `/metrics` (for peers, whose main port speaks the swarm protocol)."""
    app = http.make_app(SMALL_LIMITS)
    add_route(app, registry)
    return await http.start(app, host, port, SMALL_LIMITS, what="metrics", flag=flag)
