"""The health monitor's loop without a network: reading the directory's buckets, failed reads, which
peers it pings and by when, and what it serves over HTTP."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from bootstrap import health, monitor as monitor_module
from bootstrap.monitor import JSON_PATH, Monitor
from swarm.net import calls, discovery, records
from swarm.errors import SwarmUnreachable
from swarm.net.identity import Identity
from swarm.net.messages import Info

pytestmark = pytest.mark.unit

def _in_distinct_buckets(n: int) -> list[Identity]:
    """`n` identities whose directory buckets differ (random ids share one of the 64 now and then)."""
    ids: list[Identity] = []
    while len(ids) < n:  # bounded in practice: each new id collides with probability < n / 64
        candidate = Identity.generate()
        if records.directory_key(candidate.peer_id) not in {records.directory_key(i.peer_id) for i in ids}:
            ids.append(candidate)
    return ids


IDS = _in_distinct_buckets(4)


def ann(identity: Identity, start: int = 0, end: int = 6, model: str = "m", state: str = "online",
        num_blocks: int = 6) -> records.Announcement:
    return records.Announcement(identity.peer_id, model, start, end, state, 10.0, 100.0, 1000, "0.1.0", 1,
                                time.time(), num_blocks)


class FakeSwarm:
    """Stands in for the DHT and the peers: `reads` are the successive directory reads (the last one
    repeats; an exception is raised), `replies` the info reply per peer (absent: it stalls)."""

    def __init__(self, *reads):
        self.reads = list(reads)
        self.replies: dict[str, dict] = {}
        self.routing = 1  # DHT nodes this node knows
        self.read_count = 0
        self.pinged: list[str] = []

    def routing_table_size(self) -> int:
        return self.routing

    async def directory(self, node) -> list[records.Announcement]:
        self.read_count += 1
        found = self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
        if isinstance(found, Exception):
            raise found
        return list(found)

    async def info(self, node, peer: str, timeout: float) -> dict:
        self.pinged.append(peer)
        if peer not in self.replies:
            await asyncio.sleep(3600)
        return self.replies[peer]

    def answer(self, *anns: records.Announcement) -> None:
        for a in anns:
            self.replies[a.peer] = Info(a.peer, a.model, a.start, a.end, sessions=0)


@pytest.fixture
def fast(monkeypatch):
    """Short timeouts, so that rounds with stalling peers take a fraction of a second."""
    monkeypatch.setattr(monitor_module, "PING_TIMEOUT", 0.2)
    monkeypatch.setattr(monitor_module, "MIN_READ_TIME", 0.2)


def monitor_of(fake: FakeSwarm, monkeypatch, interval: float = 0.05) -> Monitor:
    monkeypatch.setattr(discovery, "directory", fake.directory)
    monkeypatch.setattr(calls, "info", fake.info)
    return Monitor(fake, interval=interval)


def gauge(monitor: Monitor, name: str) -> float | None:
    return next((value for n, _, value, _ in monitor._gauges() if n == name), None)


# ---- the directory ----

class StoredRecords:
    """A node whose DHT holds `stored` (bucket key -> records) and returns only those keys; nothing is
    verified here (the transport's validator does that), so misplaced records come back too."""

    def __init__(self, stored: dict[str, list[tuple[Identity, records.Announcement]]]):
        self.asked: list[str] = []
        self.found = {key: {ident.peer_id: (records.seal(ident, a, key.encode(), time.time() + 60), time.time() + 60)
                            for ident, a in items} for key, items in stored.items()}

    async def get_records(self, keys):
        self.asked = list(keys)
        return {key: self.found[key] for key in keys if key in self.found}


def test_directory_reads_every_bucket_at_once_and_skips_misplaced_records():
    first, second, misplaced = IDS[:3]
    taken = {records.directory_key(i.peer_id) for i in (first, second, misplaced)}
    elsewhere = next(k for k in records.DIRECTORY_KEYS if k not in taken)  # a bucket no one here belongs in
    node = StoredRecords({records.directory_key(first.peer_id): [(first, ann(first, 0, 3))],
                          records.directory_key(second.peer_id): [(second, ann(second, 3, 6))],
                          elsewhere: [(misplaced, ann(misplaced))]})  # DHT nodes refuse it; a reader skips it too
    found = asyncio.run(discovery.directory(node))
    assert node.asked == list(records.DIRECTORY_KEYS)  # one call; the buckets nothing returned are just empty
    assert [(a.peer, a.start) for a in found] == [(first.peer_id, 0), (second.peer_id, 3)]


# ---- failed reads ----

def test_an_empty_directory_is_no_read_when_this_node_knows_no_dht_node(monkeypatch, fast):
    fake = FakeSwarm([ann(IDS[0])], [])
    fake.answer(ann(IDS[0]))
    monitor = monitor_of(fake, monkeypatch)
    first = asyncio.run(monitor.refresh())
    assert gauge(monitor, "swarm_monitor_read_ok") == 1
    fake.routing = 0
    with pytest.raises(SwarmUnreachable, match="knows no other DHT node"):
        asyncio.run(monitor.refresh())
    assert monitor.snapshot is first and first.models[0].peers[0].state == "online"  # the last snapshot stays
    assert gauge(monitor, "swarm_monitor_read_ok") == 0
    assert gauge(monitor, "swarm_monitor_snapshot_age_seconds") >= 0


def test_an_empty_directory_after_a_full_one_is_read_again_before_it_is_believed(monkeypatch, fast):
    listed = ann(IDS[0])
    fake = FakeSwarm([listed], [], [listed], [], [])
    fake.answer(listed)
    monitor = monitor_of(fake, monkeypatch)
    asyncio.run(monitor.refresh())
    snap = asyncio.run(monitor.refresh())  # empty, then full again: a lost reply
    assert fake.read_count == 3 and snap.models[0].uncovered == ()
    snap = asyncio.run(monitor.refresh())  # empty twice: the swarm did empty; the model stays, all red
    assert fake.read_count == 5 and snap.models[0].peers == () and snap.models[0].uncovered == tuple(range(6))
    assert gauge(monitor, "swarm_monitor_read_ok") == 1


def test_a_read_that_raises_keeps_the_snapshot(monkeypatch, fast):
    fake = FakeSwarm(SwarmUnreachable("no DHT node answered"))
    monitor = monitor_of(fake, monkeypatch)
    with pytest.raises(SwarmUnreachable):
        asyncio.run(monitor.refresh())
    assert monitor.snapshot.taken_at is None and gauge(monitor, "swarm_monitor_read_ok") == 0
    assert gauge(monitor, "swarm_monitor_snapshot_age_seconds") is None


# ---- pings ----

def test_stalling_peers_cannot_hold_a_round_back(monkeypatch, fast):
    monkeypatch.setattr(monitor_module, "PING_CONCURRENCY", 4)
    stalling = [ann(Identity.generate()) for _ in range(100)]
    fake = FakeSwarm(stalling)
    monitor = monitor_of(fake, monkeypatch)
    started = time.monotonic()
    snap = asyncio.run(monitor.refresh())
    # the read may take 0.2 s, the pings 0.2 s more; without the deadline: 100 / 4 x 0.2 s = 5 s
    assert time.monotonic() - started < 1.5
    assert {p.state for p in snap.models[0].peers} == {"unreachable"} and len(fake.pinged) < 20


def test_peers_that_answered_are_pinged_first(monkeypatch, fast):
    monkeypatch.setattr(monitor_module, "PING_CONCURRENCY", 2)
    honest = ann(IDS[0])
    stalling = [ann(Identity.generate()) for _ in range(50)]
    fake = FakeSwarm([honest], [*stalling, honest])
    fake.answer(honest)
    monitor = monitor_of(fake, monkeypatch)
    asyncio.run(monitor.refresh())
    snap = asyncio.run(monitor.refresh())
    states = {p.peer: p.state for p in snap.models[0].peers}
    assert states[honest.peer] == "online" and snap.models[0].uncovered == ()


def test_only_peers_of_kept_models_are_pinged(monkeypatch, fast):
    monkeypatch.setattr(health, "MAX_MODELS", 2)
    live = ann(IDS[0], model="live")
    spam = [ann(ident, model=f"spam{i}") for i, ident in enumerate(IDS[1:])]
    fake = FakeSwarm([live], [live, *spam])
    fake.answer(live)
    monitor = monitor_of(fake, monkeypatch)
    asyncio.run(monitor.refresh())
    fake.pinged.clear()
    snap = asyncio.run(monitor.refresh())
    shown = [m.model for m in snap.models]
    assert len(shown) == 2 and "live" in shown
    assert sorted(fake.pinged) == sorted(a.peer for a in [live, *spam] if a.model in shown)


# ---- HTTP ----

def test_json_is_serialized_once_per_snapshot_and_carries_its_age(monkeypatch, fast):
    serialized = []
    to_json = health.Snapshot.to_json

    def counted(snapshot, interval):
        serialized.append(snapshot.taken_at)
        return to_json(snapshot, interval)

    monkeypatch.setattr(health.Snapshot, "to_json", counted)
    fake = FakeSwarm([ann(IDS[0])])
    fake.answer(ann(IDS[0]))
    monitor = monitor_of(fake, monkeypatch, interval=2.0)

    async def run():
        async with TestClient(TestServer(monitor.app())) as client:
            before = await (await client.get(JSON_PATH)).json()
            await monitor.refresh()
            count = len(serialized)
            docs = [await (await client.get(JSON_PATH)).json() for _ in range(3)]
            return before, count, docs

    before, count, docs = asyncio.run(run())
    assert before["taken_at"] is None and before["age_s"] is None and before["models"] == []
    assert len(serialized) == count  # three requests, no serialization
    for doc in docs:
        assert doc["refresh_interval"] == 2.0 and 0 <= doc["age_s"] < 5 and doc["models"][0]["model"] == "m"


def test_the_page_policy_allows_exactly_its_own_script_and_style(monkeypatch):
    monitor = monitor_of(FakeSwarm([]), monkeypatch)

    async def run():
        async with TestClient(TestServer(monitor.app())) as client:
            reply = await client.get("/")
            return await reply.read(), reply.headers["Content-Security-Policy"]

    page, policy = asyncio.run(run())
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert "unsafe-inline" not in policy and directives["default-src"] == "'none'"
    for tag in ("script", "style"):
        (body,) = re.findall(rf"<{tag}>(.*?)</{tag}>".encode(), page, re.S)
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert directives[f"{tag}-src"] == f"'sha256-{digest}'"
    assert {k: directives[k] for k in ("frame-ancestors", "base-uri", "form-action", "connect-src")} == {
        "frame-ancestors": "'none'", "base-uri": "'none'", "form-action": "'none'", "connect-src": "'self'"}
    assert b" style=" not in page  # style attributes would be refused by the policy
