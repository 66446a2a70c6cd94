"""The health monitor's pure core: states from records and pings, coverage, the models shown, JSON and gauges."""

from __future__ import annotations

import json

import pytest

from bootstrap.health import (FORGET_AFTER, MAX_MODELS, SCHEMA_VERSION, Ping, Snapshot, build_snapshot,
                              remember_models)
from bootstrap.monitor import describe_blocks
from swarm.identity import Identity
from swarm.records import Announcement

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
PEERS = [Identity.generate().peer_id for _ in range(5)]


def ann(peer: str, start: int, end: int, state: str = "online", model: str = "m", num_blocks: int = 6,
        **changes) -> Announcement:
    fields = dict(peer=peer, model=model, start=start, end=end, state=state, throughput=10.0, prefill_tps=100.0,
                  cache_tokens_left=1000, version="0.1.0", seq=1, issued_at=NOW - 3, num_blocks=num_blocks)
    return Announcement(**{**fields, **changes})


def ping(**info) -> Ping:
    return Ping(1.234, info)


def test_only_reachable_online_peers_cover_blocks():
    anns = [ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6), ann(PEERS[2], 2, 4, state="joining"),
            ann(PEERS[3], 4, 6, state="offline")]
    snap = build_snapshot(anns, {PEERS[0]: ping(sessions=2, cache_tokens_left=500)}, {"m": 6}, NOW)
    (model,) = snap.models
    states = {p.peer: p.state for p in model.peers}
    assert states == {PEERS[0]: "online", PEERS[1]: "unreachable", PEERS[2]: "joining", PEERS[3]: "offline"}
    assert model.uncovered == (3, 4, 5)
    assert model.serving == (1, 1, 1, 0, 0, 0)
    first = next(p for p in model.peers if p.peer == PEERS[0])
    assert (first.sessions, first.cache_tokens_left, first.latency_ms, first.record_age_s) == (2, 500, 1.23, 3.0)
    assert first.name == "…" + PEERS[0][-8:]
    unreachable = next(p for p in model.peers if p.peer == PEERS[1])
    assert (unreachable.sessions, unreachable.cache_tokens_left, unreachable.latency_ms) == (None, 1000, None)


def test_peers_sorted_by_span_and_overlaps_counted():
    anns = [ann(PEERS[0], 3, 6), ann(PEERS[1], 0, 4), ann(PEERS[2], 0, 6)]
    snap = build_snapshot(anns, {p: ping() for p in PEERS}, {"m": 6}, NOW)
    (model,) = snap.models
    assert [(p.start, p.end) for p in model.peers] == [(0, 4), (0, 6), (3, 6)]
    assert model.serving == (2, 2, 2, 3, 2, 2) and model.uncovered == ()


def test_a_model_without_peers_is_all_uncovered_and_info_values_are_checked():
    snap = build_snapshot([ann(PEERS[0], 0, 2, model="a", num_blocks=2)],
                          {PEERS[0]: ping(sessions="many", cache_tokens_left=-5)}, {"a": 2, "b": 3}, NOW)
    assert [m.model for m in snap.models] == ["a", "b"]
    assert snap.models[0].uncovered == () and snap.models[0].peers[0].sessions is None
    assert snap.models[0].peers[0].cache_tokens_left == 1000  # a bad info figure falls back to the record's
    assert snap.models[1].peers == () and snap.models[1].uncovered == (0, 1, 2)


def test_json_document_and_gauges():
    snap = build_snapshot([ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6)], {PEERS[0]: ping(sessions=0)}, {"m": 6}, NOW)
    doc = json.loads(json.dumps(snap.to_json(5.0)))
    assert doc["schema"] == SCHEMA_VERSION and doc["taken_at"] == NOW and doc["refresh_interval"] == 5.0
    (model,) = doc["models"]
    assert model["model"] == "m" and model["num_blocks"] == 6 and model["uncovered"] == [3, 4, 5]
    assert set(model["peers"][0]) == {"peer", "name", "start", "end", "state", "throughput", "cache_tokens_left",
                                      "sessions", "version", "latency_ms", "record_age_s"}
    gauges = {(name, tuple(sorted(labels.items()))): value for name, _, value, labels in snap.gauges()}
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "online")))] == 1
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "unreachable")))] == 1
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "offline")))] == 0
    assert gauges[("swarm_monitor_uncovered_blocks", (("model", "m"),))] == 3
    assert gauges[("swarm_monitor_blocks", (("model", "m"),))] == 6
    assert Snapshot(None).to_json(5.0)["models"] == []


def test_models_are_remembered_then_forgotten_and_bounded():
    seen = remember_models({}, [ann(PEERS[0], 0, 3, num_blocks=6), ann(PEERS[1], 0, 3, num_blocks=6),
                                ann(PEERS[2], 0, 3, num_blocks=99)], NOW)
    assert seen == {"m": (6, NOW)}  # what most peers say: one peer cannot widen the map
    later = NOW + FORGET_AFTER
    seen = remember_models(seen, [ann(PEERS[0], 0, 2, model="other", num_blocks=2)], later)
    assert seen == {"m": (6, NOW), "other": (2, later)}
    assert remember_models(seen, [], later + 1) == {"other": (2, later)}
    many = [ann(PEERS[0], 0, 1, model=f"m{i}", num_blocks=1, issued_at=NOW) for i in range(MAX_MODELS + 10)]
    assert len(remember_models({}, many, NOW)) == MAX_MODELS


def test_describe_blocks():
    assert describe_blocks((3, 4, 5, 9)) == "[3:6) [9:10)"
    assert describe_blocks((0,)) == "[0:1)"
