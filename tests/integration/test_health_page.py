"""The swarm health page against a live local swarm: the JSON and /metrics, `swarm monitor` as a
process of its own, and the page itself in headless Chromium (under its Content-Security-Policy),
before and after the only peer of some blocks is killed; and, from a monitor in this process serving
a snapshot made up here, hostile peer strings and a stale snapshot.

One swarm for the module: a bootstrap serving the page (`--monitor-port 0`, read every second) and
two peers of the tiny llama, blocks [0:3) and [3:6), each the only peer of its blocks. The last test
kills the second peer.

Polls retry a check that raises (a Chromium run that crashed, a refused connection) until their
deadline: one bad attempt is not the page's fault, a deadline missed is.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import pytest

import browser
from bootstrap import health
from bootstrap.monitor import Monitor
from swarm.errors import SwarmUnreachable
from swarm.net.identity import Identity
from swarm.net.records import Announcement
from swarm.net.messages import Info
from swarm_harness import LocalSwarm, wait_until

pytestmark = pytest.mark.integration

MODEL = "tiny-health"
# records outlive a killed peer by up to 30 s, so the page shows it unreachable before it drops out
PEER_OPTIONS = ("--model-id", MODEL, "--cache-tokens", "1024", "--announce-interval", "2", "--record-ttl", "30")
SPANS = {"peer0": "0:3", "peer1": "3:6"}


def get(url: str) -> tuple[str, bytes, dict[str, str]]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers.get_content_type(), reply.read(), dict(reply.headers)


def swarm_json(base: str) -> dict:
    content_type, body, _ = get(base + "api/v1/swarm")
    assert content_type == "application/json"
    return json.loads(body)


def model_of(doc: dict) -> dict | None:
    return next((m for m in doc["models"] if m["model"] == MODEL), None)


def poll(check, timeout: float, what: str, interval: float = 0.5, diagnostics=lambda: ""):
    """`wait_until(check, ...)`, where an attempt that raises counts as "not yet"; the last error is reported."""
    errors: list[Exception] = []

    def attempt():
        try:
            return check()
        except (OSError, RuntimeError, ValueError) as e:  # urlopen errors, Chromium exits and timeouts, bad JSON
            errors.append(e)
            return None

    def report() -> str:
        try:
            text = diagnostics()
        except (OSError, RuntimeError, ValueError) as e:
            text = f"(no diagnostics: {e!r})"
        return f"{text}\nlast error of {len(errors)}: {errors[-1]!r}" if errors else text

    return wait_until(attempt, timeout, what, interval=interval, diagnostics=report)


def page_map(base: str) -> tuple[dict[str, str], set[int], str]:
    """The page as Chromium renders it: each peer row's state, the red blocks, and the snapshot time shown."""
    found = browser.elements(browser.dump_dom(base))
    rows = {e.attrs["data-peer"]: e.attrs.get("data-state", "") for e in found
            if e.tag == "tr" and "data-peer" in e.attrs}
    red = {int(e.attrs["data-block"]) for e in found if "uncovered" in e.classes}
    taken = next((e.attrs.get("data-taken-at", "") for e in found if e.attrs.get("id") == "models"), "")
    return rows, red, taken


@pytest.fixture(scope="module")
def health_swarm(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("health"))
    try:
        net.start_bootstrap("bootstrap", "--monitor-port", "0", "--monitor-interval", "1")
        for name, blocks in SPANS.items():
            net.start_peer(name, tiny_llama, "--blocks", blocks, *PEER_OPTIONS, wait=False)
        for name in SPANS:
            net.wait_serving(net.procs[name])
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def page(health_swarm) -> str:
    """The bootstrap's page URL, once its JSON shows both peers online."""
    base = health_swarm.procs["bootstrap"].extra["monitor_url"]

    def both_online():
        model = model_of(swarm_json(base))
        return model is not None and sorted(p["state"] for p in model["peers"]) == ["online", "online"]

    poll(both_online, 30, "the monitor to see both peers online",
         diagnostics=lambda: json.dumps(swarm_json(base), indent=1))
    return base


def test_json_and_metrics(health_swarm, page):
    doc = swarm_json(page)
    assert doc["schema"] == 1 and doc["refresh_interval"] == 1.0 and doc["taken_at"] > time.time() - 30
    model = model_of(doc)
    assert model["num_blocks"] == 6 and model["uncovered"] == [] and model["serving"] == [1] * 6
    by_peer = {p["peer"]: p for p in model["peers"]}
    assert set(by_peer) == {health_swarm.procs[n].peer_id for n in SPANS}
    for name, blocks in SPANS.items():
        peer = by_peer[health_swarm.procs[name].peer_id]
        assert f"{peer['start']}:{peer['end']}" == blocks
        assert peer["latency_ms"] > 0 and peer["sessions"] == 0 and peer["cache_tokens_left"] == 1024
        assert peer["throughput"] > 0 and peer["version"] and peer["name"] == "…" + peer["peer"][-8:]
        assert (peer["device"], peer["dtype"], peer["quant"]) == ("cpu", "float32", "none")  # as its info says

    content_type, body, _ = get(page + "metrics")
    text = body.decode()
    assert content_type == "text/plain"
    assert f'swarm_monitor_peers{{model="{MODEL}",state="online"}} 2.0' in text
    assert f'swarm_monitor_peers{{model="{MODEL}",state="unreachable"}} 0.0' in text
    assert f'swarm_monitor_uncovered_blocks{{model="{MODEL}"}} 0.0' in text
    assert f'swarm_monitor_blocks{{model="{MODEL}"}} 6.0' in text

    content_type, body, headers = get(page)
    policy = headers["Content-Security-Policy"]
    assert content_type == "text/html" and b"api/v1/swarm" in body
    assert "default-src 'none'" in policy and "'sha256-" in policy and "unsafe-inline" not in policy
    assert all(f"{d} 'none'" in policy for d in ("frame-ancestors", "base-uri", "form-action"))
    assert b"<script src" not in body and b"<link" not in body  # self-contained: the swarm may be offline


def test_swarm_monitor_runs_as_its_own_process(health_swarm, page):
    monitor = health_swarm.start_monitor("monitor", "--interval", "1")
    try:
        def sees_both():
            model = model_of(swarm_json(monitor.extra["url"]))
            return model is not None and model["uncovered"] == [] and len(model["peers"]) == 2

        poll(sees_both, 30, "swarm monitor to see both peers", diagnostics=monitor.text)
    finally:
        health_swarm.stop("monitor")
    assert health_swarm.procs["monitor"].popen.returncode == 0


def test_page_turns_blocks_red_when_their_only_peer_dies(health_swarm, page):
    # the page renders at all only if the policy admits its script: rows prove it does
    peers = {name: health_swarm.procs[name].peer_id for name in SPANS}

    def with_snapshot():
        rows, red, taken = page_map(page)
        return (rows, red) if taken else None

    rows, red = poll(with_snapshot, 30, "the page to render a snapshot")
    assert rows == {peers["peer0"]: "online", peers["peer1"]: "online"}
    assert red == set()

    health_swarm.stop("peer1", signal.SIGKILL)
    killed_at = time.time()

    def red_after_kill():
        rows, red, taken = page_map(page)
        return (rows, red) if taken and float(taken) > killed_at and red == {3, 4, 5} else None

    rows, red = poll(red_after_kill, 30, "the page to show blocks 3-5 red",
                     diagnostics=lambda: json.dumps(swarm_json(page), indent=1))
    assert rows == {peers["peer0"]: "online", peers["peer1"]: "unreachable"}

    model = model_of(swarm_json(page))
    assert model["uncovered"] == [3, 4, 5] and model["serving"] == [1, 1, 1, 0, 0, 0]
    assert {p["peer"]: p["state"] for p in model["peers"]} == {peers["peer0"]: "online",
                                                               peers["peer1"]: "unreachable"}


# ---- the page on a snapshot made up here, served by a monitor in this process ----

class NoSwarm:
    """A node whose every read fails, so the monitor keeps serving the snapshot it is given."""

    async def get_records(self, keys):
        raise SwarmUnreachable("no swarm in this test")

    def routing_table_size(self) -> int:
        return 0


def rendered(snapshot: health.Snapshot, interval: float = 1.0) -> str:
    """The DOM Chromium renders for `snapshot`."""
    async def serve() -> str:
        async with Monitor(NoSwarm(), interval=interval) as monitor:
            monitor.publish(snapshot)
            return await asyncio.get_running_loop().run_in_executor(None, browser.dump_dom, monitor.url)

    return asyncio.run(serve())


def snapshot_of(version: str, taken_at: float, **computes) -> health.Snapshot:
    peer = Identity.generate().peer_id
    record = Announcement(peer, "m", 0, 2, "online", 1.0, 1.0, 100, version, 1, taken_at, 2)
    reply = health.Ping(1.0, Info(peer, "m", 0, 2, **computes))
    return health.build_snapshot([record], {peer: reply}, {"m": 2}, taken_at)


def status_of(dom: str) -> tuple[set[str], str]:
    found = next(e for e in browser.elements(dom) if e.attrs.get("id") == "status")
    text = dom.split('id="status"', 1)[1].split(">", 1)[1].split("<", 1)[0]
    return found.classes, text


def test_a_hostile_version_string_is_shown_as_text():
    hostile = "<img src=x onerror=alert(1)>"
    dom = rendered(snapshot_of(hostile, time.time()))
    found = browser.elements(dom)
    assert any(e.tag == "tr" and "data-peer" in e.attrs for e in found), "the page did not render the peer"
    assert not any(e.tag == "img" for e in found)
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom
    assert status_of(dom)[0] == set()  # a fresh snapshot is not stale


def test_each_peer_shows_its_device_and_weight_format():
    dom = rendered(snapshot_of("0.1.0", time.time(), device="cuda", dtype="bfloat16", quant="nf4"))
    cells = dom.split('data-peer="', 1)[1].split("</tr>", 1)[0]
    assert "<td>cuda</td>" in cells and "<td>nf4/bfloat16</td>" in cells


def test_a_stale_snapshot_is_flagged_red():
    classes, text = status_of(rendered(snapshot_of("0.1.0", time.time() - 60), interval=1.0))
    assert "error" in classes and text.startswith("stale: the swarm was last read 6")
