"""A peer's metrics without a peer: the state gauges follow `info()` at each scrape, the recorder's
events become counters and histograms, and --metrics-port is checked like --port."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from swarm.net import messages
from swarm.errors import ConfigError

pytestmark = pytest.mark.unit


def scrape(metrics: PeerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def fake_info(**changes) -> messages.Info:
    info = {"peer": "12D3KooWpeer", "model": "tiny", "start": 2, "end": 5, "version": "0.1.0", "dtype": "float32",
            "sessions": 0, "max_sessions": 8, "cache_tokens": 1000, "cache_tokens_left": 1000, "queued": 0}
    return messages.Info(**{**info, **changes})


def test_state_is_read_at_each_scrape():
    metrics = PeerMetrics()
    info = fake_info()
    metrics.watch(lambda: info)
    first = scrape(metrics)
    info = fake_info(sessions=2, cache_tokens_left=700, queued=3)
    second = scrape(metrics)
    labels = (("device", "cpu"), ("dtype", "float32"), ("end", "5"), ("model", "tiny"), ("peer", "12D3KooWpeer"),
              ("quant", "none"), ("start", "2"), ("version", "0.1.0"))
    assert first[("swarm_peer_info", labels)] == 1
    assert [first[(f"swarm_peer_{n}", ())] for n in ("sessions_open", "max_sessions", "cache_tokens",
                                                      "cache_tokens_used", "cache_tokens_left", "queued_steps")] \
        == [0, 8, 1000, 0, 1000, 0]
    assert [second[(f"swarm_peer_{n}", ())] for n in ("sessions_open", "cache_tokens_used", "cache_tokens_left",
                                                       "queued_steps")] == [2, 300, 700, 3]


def test_events_become_counters_and_histograms():
    metrics = PeerMetrics()
    metrics.opened()
    metrics.stepped(tokens=2 * 5, compute_s=0.004)
    metrics.stepped(tokens=2, compute_s=0.002)
    metrics.step_replied(0.003)
    metrics.forwarded(tokens=7, compute_s=0.2)
    metrics.failed("bad_request")
    metrics.failed("bad_request")
    metrics.failed("busy")
    got = scrape(metrics)
    assert got[("swarm_peer_sessions_opened_total", ())] == 1
    assert (got[("swarm_peer_steps_total", ())], got[("swarm_peer_forwards_total", ())]) == (2, 1)
    assert got[("swarm_peer_tokens_total", ())] == 19
    assert got[("swarm_peer_errors_total", (("code", "bad_request"),))] == 2
    assert got[("swarm_peer_errors_total", (("code", "busy"),))] == 1
    assert got[("swarm_peer_step_compute_seconds_count", ())] == 2
    assert got[("swarm_peer_step_compute_seconds_sum", ())] == pytest.approx(0.006)
    assert got[("swarm_peer_step_compute_seconds_bucket", (("le", "0.0025"),))] == 1
    assert got[("swarm_peer_step_seconds_count", ())] == 1
    assert got[("swarm_peer_forward_compute_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[("swarm_peer_forward_compute_seconds_bucket", (("le", "0.25"),))] == 1


def test_every_metric_is_named_and_explained():
    metrics = PeerMetrics()
    metrics.watch(fake_info)
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        assert family.name.startswith("swarm_peer_") and family.documentation, family.name


@pytest.mark.parametrize("port,port_in_use,message", [
    (-1, 0, "--metrics-port -1 is not a TCP port"),
    (65536, 0, "--metrics-port 65536 is not a TCP port"),
    (31337, 31337, "--metrics-port and --port are both 31337"),
])
def test_metrics_port_is_checked(port, port_in_use, message):
    with pytest.raises(ConfigError, match=message):
        PeerConfig(model=Path("m"), port=port_in_use, metrics_port=port)


def test_metrics_are_off_by_default_and_any_free_port_is_allowed():
    assert PeerConfig(model=Path("m")).metrics_port is None
    assert PeerConfig(model=Path("m"), metrics_port=0).metrics_port == 0


class _GoneWriter:
    """A stream writer whose client has gone: every write fails as a reset connection does."""

    def write(self, data) -> None:
        raise ConnectionResetError("reset by peer")

    async def drain(self) -> None:
        raise ConnectionResetError("reset by peer")


def test_a_client_gone_before_the_reply_is_not_an_error_of_the_peer():
    import asyncio

    from peer.servicer import Servicer
    from swarm.net import wire
    from swarm.errors import BadRequest
    from swarm.net.transport import Stream

    servicer = Servicer.__new__(Servicer)  # `_answer` needs only the config, the metrics and the error counts
    servicer.config, servicer.metrics, servicer.errors = PeerConfig(model=Path("m")), PeerMetrics(), {}
    stream = Stream(None, _GoneWriter(), "peer")

    async def ok(msg):
        return wire.Message(wire.INFO, {"ok": True})

    async def refused(msg):
        raise BadRequest("no")

    assert asyncio.run(servicer._answer(stream, ok, wire.Message(wire.INFO))) is False
    assert servicer.errors == {}
    assert asyncio.run(servicer._answer(stream, refused, wire.Message(wire.INFO))) is False
    assert servicer.errors == {"bad_request": 1}  # the request's own error counts, the lost reply does not
    text = generate_latest(servicer.metrics.registry).decode()
    assert 'swarm_peer_errors_total{code="internal"}' not in text
