"""A peer's `/metrics`, scraped while a session opens, steps, fails a step and closes.

A swarm of its own: one peer serving all blocks with --metrics-port 0, and one without it. Every
figure is checked as a difference between two scrapes, so the peer's self-measurement at start
(which runs no session) cannot disturb it.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client.inference import peer_session
from swarm import __version__
from swarm.errors import BadRequest
from swarm.span import Span
from swarm_harness import CACHE_TOKENS, MODEL_ID, PEER_OPTIONS, LocalSwarm, client_node, wait_until

pytestmark = pytest.mark.integration

ALL = Span(0, 6)
BATCH, MAX_LENGTH = 2, 32


@pytest.fixture(scope="module")
def metered(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("metrics"))
    try:
        net.start_bootstrap()
        net.start_peer("metered", tiny_llama, "--blocks", "0:6", "--metrics-port", "0", *PEER_OPTIONS, wait=False)
        net.start_peer("plain", tiny_llama, "--blocks", "0:6", *PEER_OPTIONS, wait=False)
        for name in ("metered", "plain"):
            net.wait_serving(net.procs[name])
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def url(metered) -> str:
    return metered.metrics_url(metered.procs["metered"])


@pytest.fixture(scope="module")
def node(metered, loop):
    """A client-mode DHT node joined to this swarm."""
    with client_node(loop, metered.bootstrap_addrs) as node:
        yield node


class Scrape:
    """One scrape of `/metrics`: `scrape[name]` or `scrape[name, {label: value}]`; absent samples read 0."""

    def __init__(self, url: str):
        with urllib.request.urlopen(url, timeout=10) as reply:
            self.content_type = reply.headers["Content-Type"]
            text = reply.read().decode()
        self.samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for family in text_string_to_metric_families(text) for s in family.samples}

    def __getitem__(self, key) -> float:
        name, labels = key if isinstance(key, tuple) else (key, {})
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)


STEP_COUNTS = ("swarm_peer_steps_total", "swarm_peer_step_compute_seconds_count", "swarm_peer_step_seconds_count")


def test_only_the_peer_asked_to_serves_metrics(metered, url):
    assert url.startswith("http://127.0.0.1:")
    assert "metrics at" not in metered.procs["plain"].text()


def test_idle_peer_reports_its_state(metered, url):
    got = Scrape(url)
    assert got.content_type.startswith("text/plain")
    labels = {"peer": metered.procs["metered"].peer_id, "model": MODEL_ID, "start": "0", "end": "6",
              "version": __version__, "device": "cpu", "dtype": "float32", "quant": "none"}
    assert got["swarm_peer_info", labels] == 1
    assert (got["swarm_peer_cache_tokens"], got["swarm_peer_cache_tokens_left"]) == (CACHE_TOKENS, CACHE_TOKENS)
    assert (got["swarm_peer_sessions_open"], got["swarm_peer_cache_tokens_used"]) == (0, 0)
    assert got["swarm_peer_max_sessions"] > 0 and got["swarm_peer_queued_steps"] == 0


def test_session_steps_and_errors_are_counted(metered, url, node, loop):
    peer = metered.procs["metered"].peer_id
    hidden_size = loop.run(peer_session.info(node, peer)).hidden_size
    before = Scrape(url)
    tokens = (5, 1, 1)  # a prefill, then two decode steps

    async def open_and_step() -> peer_session.PeerSession:
        session = await peer_session.PeerSession.open(node, peer, MODEL_ID, ALL, max_length=MAX_LENGTH, batch=BATCH)
        position = 0
        for n in tokens:
            await session.step(torch.randn(BATCH, n, hidden_size), position)
            position += n
        with pytest.raises(BadRequest, match="hidden states must be"):
            await session.step(torch.randn(BATCH, 1, hidden_size + 1), position)
        return session

    session = loop.run(open_and_step())
    try:
        during = Scrape(url)
    finally:
        loop.run(session.close())
    assert during["swarm_peer_sessions_open"] == 1
    assert during["swarm_peer_cache_tokens_used"] - before["swarm_peer_cache_tokens_used"] == BATCH * MAX_LENGTH
    assert during["swarm_peer_cache_tokens_left"] == CACHE_TOKENS - BATCH * MAX_LENGTH
    assert during["swarm_peer_sessions_opened_total"] - before["swarm_peer_sessions_opened_total"] == 1
    for name in STEP_COUNTS:  # the failed step is an error, not a step
        assert during[name] - before[name] == len(tokens), name
    assert during["swarm_peer_tokens_total"] - before["swarm_peer_tokens_total"] == BATCH * sum(tokens)
    bad = ("swarm_peer_errors_total", {"code": "bad_request"})
    assert during[bad] - before[bad] == 1
    compute = during["swarm_peer_step_compute_seconds_sum"] - before["swarm_peer_step_compute_seconds_sum"]
    whole = during["swarm_peer_step_seconds_sum"] - before["swarm_peer_step_seconds_sum"]
    assert 0 < compute <= whole < 30

    # the peer closes the session when it reads 'close', after the client has moved on
    after = wait_until(lambda: (s := Scrape(url))["swarm_peer_sessions_open"] == 0 and s, 10, "the session to close")
    assert after["swarm_peer_cache_tokens_used"] == 0 and after["swarm_peer_cache_tokens_left"] == CACHE_TOKENS


def test_forwards_are_counted(metered, url, node, loop):
    peer = metered.procs["metered"].peer_id
    hidden_size = loop.run(peer_session.info(node, peer)).hidden_size
    before = Scrape(url)
    loop.run(peer_session.forward(node, peer, MODEL_ID, ALL, torch.randn(3, 4, hidden_size)))
    after = Scrape(url)
    for name in ("swarm_peer_forwards_total", "swarm_peer_forward_compute_seconds_count"):
        assert after[name] - before[name] == 1, name
    assert after["swarm_peer_tokens_total"] - before["swarm_peer_tokens_total"] == 3 * 4
    assert after["swarm_peer_steps_total"] == before["swarm_peer_steps_total"]


def test_a_metrics_port_in_use_stops_the_peer_before_it_serves(metered, tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = metered.start_peer("clash", tiny_llama, "--blocks", "0:6", "--metrics-port", str(port), *PEER_OPTIONS,
                                  wait=False)
        assert proc.popen.wait(60) == 1
    text = proc.text()
    assert f"cannot serve metrics on 127.0.0.1:{port}" in text and "choose another --metrics-port" in text
    assert "serving blocks" not in text and "loading blocks" not in text and "Traceback" not in text
