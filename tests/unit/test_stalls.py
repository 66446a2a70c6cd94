"""Peers that stalled a client (`SwarmClient.ban`, `client.inference.stalls`): a missed deadline before any completed
step costs the peer a long avoidance, here and for the machine's later clients; a peer that served first gets the
usual backoff; the file is bounded, expires and survives garbage."""

from __future__ import annotations

import json

import pytest

from client.config import ClientConfig
from client.inference import stalls
from client.inference.stalls import STALL_S, StallMemory
from client.inference.swarm_client import SwarmClient

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def client(memory: StallMemory | None) -> SwarmClient:
    return SwarmClient(None, "m", 6, ClientConfig(), stalls=memory)


def test_a_peer_that_stalls_before_any_step_is_avoided_long_and_by_the_next_client(tmp_path):
    clock = Clock()
    memory = StallMemory(tmp_path / "stalled.json", clock)
    first = client(memory)
    first.ban("sybil", "timeout")
    assert first.bans.reasons["sybil"] == "stalled" and first.bans.until["sybil"] - first.bans.clock() > STALL_S - 5
    first.succeeded("honest")
    first.ban("honest", "timeout")  # it served this client before: a failure, the usual backoff
    assert first.bans.reasons["honest"] == "timeout" and first.bans.until["honest"] - first.bans.clock() < 10
    later = client(memory)
    assert later.bans.banned("sybil") and later.bans.reasons["sybil"] == "stalled" and not later.bans.banned("honest")
    later.bans.lift("sybil")  # a failure, not a lie: a ping lifts it when nothing else serves its blocks
    assert not later.bans.banned("sybil")
    clock.now += STALL_S
    assert memory.load() == {}


def test_without_a_memory_a_stall_is_avoided_in_this_client_only(tmp_path):
    alone = client(None)
    alone.ban("sybil", "timeout")
    assert alone.bans.reasons["sybil"] == "stalled" and not client(None).bans.banned("sybil")


def test_the_memory_is_bounded_and_survives_garbage(tmp_path, monkeypatch):
    monkeypatch.setattr(stalls, "KEEP", 8)
    path = tmp_path / "stalled.json"
    clock = Clock()
    memory = StallMemory(path, clock)
    path.write_text("not json")
    assert memory.load() == {}
    path.write_text(json.dumps({"a": "soon", "b": clock.now + 10, "x" * 200: clock.now + 10}))
    assert memory.load() == {"b": 10.0}
    for i in range(18):
        clock.now += 0.001
        memory.remember(f"p{i}")
    kept = json.loads(path.read_text())
    assert len(kept) == 8 and "p0" not in kept and "p17" in kept
