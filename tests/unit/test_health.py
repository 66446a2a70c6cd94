"""The health monitor's pure core: states from records and pings, coverage, the number of blocks, the
models shown, JSON and gauges."""

from __future__ import annotations

import json
import random

import pytest

from bootstrap.health import (FORGET_AFTER, MAX_MODELS, SCHEMA_VERSION, Ping, Snapshot, build_snapshot, keep_models,
                              learn, list_models)
from bootstrap.monitor import describe_blocks
from swarm.errors import BadRequest
from swarm.net.identity import Identity
from swarm.net.records import Announcement
from swarm.net.messages import Info
from swarm.net.wire import Message

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
PEERS = [Identity.generate().peer_id for _ in range(5)]


def ann(peer: str, start: int, end: int, state: str = "online", model: str = "m", num_blocks: int = 6,
        **changes) -> Announcement:
    fields = dict(peer=peer, model=model, start=start, end=end, state=state, throughput=10.0, prefill_tps=100.0,
                  cache_tokens_left=1000, version="0.1.0", seq=1, issued_at=NOW - 3, num_blocks=num_blocks)
    return Announcement(**{**fields, **changes})


def ping(**info) -> Ping | None:
    """The ping of a peer whose info reply has these fields; None (as the monitor records a peer whose reply
    is malformed: unanswered) when the reply's decode refuses them."""
    try:
        return Ping(1.234, Info.from_message(Message("info", {"peer": PEERS[0], **info})))
    except BadRequest:
        return None


def answer(a: Announcement, **info) -> Ping:
    """The info reply of the peer of `a`, naming the model and span of its record."""
    return ping(model=a.model, start=a.start, end=a.end, **info)


def answers(*anns: Announcement) -> dict[str, Ping]:
    return {a.peer: answer(a) for a in anns}


def read(seen, anns, pings, now=NOW, rng=None):
    """One read as the monitor does it: list the models, keep some, learn from the pings, build the snapshot."""
    listed = list_models(seen, anns, now)
    kept = keep_models(listed, rng or random.Random(0))
    learned = learn(listed, kept, anns, pings, now)
    return learned, build_snapshot(anns, pings, {m: learned[m].num_blocks for m in kept}, now)


def test_only_reachable_online_peers_cover_blocks():
    anns = [ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6), ann(PEERS[2], 2, 4, state="joining"),
            ann(PEERS[3], 4, 6, state="offline")]
    snap = build_snapshot(anns, {PEERS[0]: answer(anns[0], sessions=2, cache_tokens_left=500)}, {"m": 6}, NOW)
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
    snap = build_snapshot(anns, answers(*anns), {"m": 6}, NOW)
    (model,) = snap.models
    assert [(p.start, p.end) for p in model.peers] == [(0, 4), (0, 6), (3, 6)]
    assert model.serving == (2, 2, 2, 3, 2, 2) and model.uncovered == ()


def test_a_model_without_peers_is_all_uncovered_and_info_values_are_checked():
    listed = ann(PEERS[0], 0, 2, model="a", num_blocks=2)
    assert answer(listed, sessions="many") is None and answer(listed, cache_tokens_left=-5) is None
    snap = build_snapshot([listed], {PEERS[0]: answer(listed, sessions="many", cache_tokens_left=-5)},
                          {"a": 2, "b": 3}, NOW)
    assert [m.model for m in snap.models] == ["a", "b"]
    # a malformed info reply is no answer: the peer is unreachable, its record's figures are shown
    assert snap.models[0].uncovered == (0, 1) and snap.models[0].peers[0].state == "unreachable"
    assert snap.models[0].peers[0].sessions is None and snap.models[0].peers[0].cache_tokens_left == 1000
    assert snap.models[1].peers == () and snap.models[1].uncovered == (0, 1, 2)


def test_json_document_and_gauges():
    anns = [ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6)]
    snap = build_snapshot(anns, {PEERS[0]: answer(anns[0], sessions=0)}, {"m": 6}, NOW)
    doc = json.loads(json.dumps(snap.to_json(5.0)))
    assert doc["schema"] == SCHEMA_VERSION and doc["taken_at"] == NOW and doc["refresh_interval"] == 5.0
    (model,) = doc["models"]
    assert model["model"] == "m" and model["num_blocks"] == 6 and model["uncovered"] == [3, 4, 5]
    assert set(model["peers"][0]) == {"peer", "name", "start", "end", "state", "throughput", "cache_tokens_left",
                                      "sessions", "queued", "version", "latency_ms", "record_age_s", "device",
                                      "dtype", "quant", "digest", "reach"}
    gauges = {(name, tuple(sorted(labels.items()))): value for name, _, value, labels in snap.gauges()}
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "online")))] == 1
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "unreachable")))] == 1
    assert gauges[("swarm_monitor_peers", (("model", "m"), ("state", "offline")))] == 0
    assert gauges[("swarm_monitor_uncovered_blocks", (("model", "m"),))] == 3
    assert gauges[("swarm_monitor_blocks", (("model", "m"),))] == 6
    assert Snapshot(None).to_json(5.0)["models"] == []


def test_a_reply_for_another_model_or_span_is_unreachable_and_covers_nothing():
    anns = [ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6), ann(PEERS[2], 0, 6)]
    pings = {PEERS[0]: ping(model="other", start=0, end=3), PEERS[1]: ping(model="m", start=3, end=5),
             PEERS[2]: ping(model="m", start=False, end=6)}  # JSON false is not block 0
    seen, snap = read({}, anns, pings)
    (model,) = snap.models
    assert {p.peer: p.state for p in model.peers} == {p: "unreachable" for p in PEERS[:3]}
    assert model.uncovered == tuple(range(6)) and all(p.latency_ms is None for p in model.peers)
    assert not seen["m"].trusted and seen["m"].reachable == 0


def test_forged_records_cannot_shrink_a_model_to_look_served():
    # one live peer serves half of a 30-block model; two forged records (never pinged) say it has 1 block
    live = ann(PEERS[0], 0, 15, num_blocks=30)
    forged = [ann(p, 0, 1, state="offline", num_blocks=1) for p in PEERS[1:3]]
    seen, snap = read({}, [live, *forged], answers(live))
    (model,) = snap.models
    assert model.num_blocks == 30 and model.uncovered == tuple(range(15, 30))
    assert seen["m"].trusted and seen["m"].reachable == 1


def test_forged_records_cannot_stretch_a_model():
    live = [ann(PEERS[0], 0, 3), ann(PEERS[1], 3, 6)]
    forged = [ann(p, 0, 1, state=s, num_blocks=4096) for p, s in zip(PEERS[2:], ("joining", "online", "online"))]
    _, snap = read({}, [*live, *forged], answers(*live))
    assert snap.models[0].num_blocks == 6 and snap.models[0].uncovered == ()


def test_blocks_are_what_live_peers_vote_for_but_never_fewer_than_their_largest_end():
    live = [ann(PEERS[0], 0, 4, num_blocks=4), ann(PEERS[1], 0, 4, num_blocks=4), ann(PEERS[2], 2, 6, num_blocks=6)]
    _, snap = read({}, live, answers(*live))
    assert snap.models[0].num_blocks == 6 and snap.models[0].serving == (2, 2, 3, 3, 1, 1)


def test_without_a_live_peer_the_last_trusted_count_stays():
    live = ann(PEERS[0], 0, 6)
    seen, _ = read({}, [live], answers(live))
    forged = ann(PEERS[1], 0, 2, state="offline", num_blocks=2)
    for records in ([live, forged, ann(PEERS[2], 0, 2, state="joining", num_blocks=2)], [forged], []):
        seen, snap = read(seen, records, {}, now=NOW + 10)
        assert snap.models[0].num_blocks == 6 and snap.models[0].uncovered == tuple(range(6))


def test_before_any_peer_answered_the_records_vote_and_nothing_looks_served():
    anns = [ann(PEERS[0], 0, 4, state="joining", num_blocks=8), ann(PEERS[1], 4, 8, state="joining", num_blocks=8),
            ann(PEERS[2], 0, 10, state="offline", num_blocks=10)]
    seen, snap = read({}, anns, {})
    assert snap.models[0].num_blocks == 10  # the vote (8) is widened to the largest end, 10
    assert snap.models[0].uncovered == tuple(range(10)) and not seen["m"].trusted


def test_models_are_remembered_then_forgotten():
    seen, _ = read({}, [ann(PEERS[0], 0, 6)], {})
    later = NOW + FORGET_AFTER
    seen, snap = read(seen, [ann(PEERS[1], 0, 2, model="other", num_blocks=2)], {}, now=later)
    assert [(m.model, m.num_blocks, m.uncovered) for m in snap.models] == [("m", 6, tuple(range(6))),
                                                                           ("other", 2, (0, 1))]
    seen, snap = read(seen, [], {}, now=later + 1)
    assert [m.model for m in snap.models] == ["other"] and set(seen) == {"other"}


def test_a_model_with_a_live_peer_is_never_dropped_for_spam():
    real = ann(PEERS[0], 0, 6, model="real")
    spam = [ann(PEERS[1], 0, 1, model=f"spam{i}", num_blocks=1) for i in range(MAX_MODELS + 50)]
    seen, _ = read({}, [real], answers(real))
    for step in range(5):  # newer records every time, never an answer
        seen, snap = read(seen, [real, *spam], answers(real), now=NOW + step, rng=random.Random(step))
        assert len(snap.models) == MAX_MODELS and "real" in {m.model for m in snap.models}
        assert len(seen) <= len(spam) + 1
    assert next(m for m in snap.models if m.model == "real").uncovered == ()


def test_a_new_model_is_reached_among_many_models_that_never_answer():
    spam = [ann(PEERS[1], 0, 1, model=f"spam{i}", num_blocks=1) for i in range(4 * MAX_MODELS)]
    seen, _ = read({}, spam, {})
    real = ann(PEERS[0], 0, 6, model="real")
    rng = random.Random(1)
    for step in range(1, 50):  # the answer counts only in a read that keeps the model (the monitor pings no other)
        seen, snap = read(seen, [*spam, real], answers(real), now=NOW + step, rng=rng)
        if seen["real"].reachable:
            break
    assert seen["real"].reachable == 1
    for later in range(step + 1, step + 5):  # found once, it stays
        seen, snap = read(seen, [*spam, real], answers(real), now=NOW + later, rng=rng)
        assert "real" in {m.model for m in snap.models}


def test_describe_blocks():
    assert describe_blocks((3, 4, 5, 9)) == "[3:6) [9:10)"
    assert describe_blocks((0,)) == "[0:1)"
