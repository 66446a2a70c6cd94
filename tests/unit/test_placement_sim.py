"""The placement simulator (benchmarks/placement_sim.py): a tiny swarm gives real, reproducible numbers,
and the shortcuts it takes (incremental capacities, the pre-filter before `rebalance`, Petals' weakest
window) agree with what they stand for."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from placement_sim import Config, Layer, Ours, Simulator, make_peers, may_move, simulate, weakest_start  # noqa: E402
from swarm.net.view import Server  # noqa: E402
from peer.placement import capacities, rebalance  # noqa: E402
from swarm.span import Span  # noqa: E402

pytestmark = pytest.mark.unit

TINY = Config(peers=40, blocks=16, hours=1.0, seed=0)


@pytest.fixture(scope="module")
def tiny():
    return {rule: simulate(TINY, rule) for rule in ("ours", "petals")}


def comparable(result):
    return replace(result, wall_s=0.0)


def test_ours_beats_petals_on_the_bottleneck(tiny):
    ours, petals = tiny["ours"], tiny["petals"]
    assert 0.0 < petals.ratio < ours.ratio <= 1.0
    assert ours.ratio > 0.9


def test_metrics_are_in_range(tiny):
    for result in tiny.values():
        assert 0.0 <= result.hole_pct <= 100.0
        assert 0.0 <= result.hole_s_per_h <= 3600.0
        assert result.moves >= 0 and result.moves_per_peer_h >= 0.0
        assert 1.0 <= result.mean_blocks <= TINY.blocks
        assert 0.5 * TINY.peers < result.mean_live < 1.5 * TINY.peers  # arrivals keep the population up


def test_a_fixed_seed_reproduces_and_another_differs(tiny):
    assert comparable(simulate(TINY, "ours")) == comparable(tiny["ours"])
    assert comparable(simulate(replace(TINY, seed=1), "petals")) != comparable(tiny["petals"])


def test_both_rules_see_the_same_peers():
    assert make_peers(TINY) == make_peers(TINY)
    assert [p.device for p in make_peers(replace(TINY, seed=1))] != [p.device for p in make_peers(TINY)]


def test_moves_are_counted_per_live_peer_hour():
    cfg = replace(TINY, margin=0.0, hours=0.25, warmup_s=900.0)  # no margin: peers chase every small gain
    result = simulate(cfg, "ours")
    assert result.moves > 0
    assert result.moves_per_peer_h == pytest.approx(result.moves / (result.mean_live * cfg.hours))
    assert result.quick_removes <= result.moves
    assert sum(result.counters.reasons.values()) == result.moves  # each move has one reason


def test_a_sparse_swarm_has_holes_a_fraction_of_the_time():
    result = simulate(replace(TINY, peers=4, blocks=40), "ours")  # too little room to cover 40 blocks
    assert 0.0 < result.hole_pct <= 100.0
    assert result.hole_s_per_h == pytest.approx(36.0 * result.hole_pct)


def test_layer_matches_placement_capacities():
    rng = random.Random(1)
    layer, served = Layer(12), []
    for _ in range(300):
        if served and rng.random() < 0.45:
            server = served.pop(rng.randrange(len(served)))
            layer.remove(server.span, server.throughput)
        else:
            start = rng.randrange(12)
            server = Server(f"p{len(served)}", Span(start, rng.randint(start + 1, 12)), rng.uniform(1, 100))
            served.append(server)
            layer.add(server.span, server.throughput)
        assert layer.caps.tolist() == pytest.approx(capacities(12, served), rel=1e-9, abs=1e-9)
        assert layer.has_hole() == any(c == 0 for c in capacities(12, served))


def test_the_prefilter_only_skips_what_rebalance_would_refuse():
    rng = random.Random(2)
    skipped = 0
    for _ in range(400):
        blocks = rng.randint(4, 24)
        base = rng.uniform(1, 100)
        caps = np.array([max(0.0, base * rng.uniform(0.7, 1.3)) if rng.random() > 0.01 else 0.0
                         for _ in range(blocks)])
        start = rng.randrange(blocks)
        span = Span(start, rng.randint(start + 1, blocks))
        speed, room = base * rng.uniform(0.01, 1.0), rng.randint(len(span), blocks)
        prefer = rng.choice([None, rng.randint(len(span), room)])  # the caller skips only when span <= prefer
        if not may_move(caps, span, speed, room, 0.2):
            skipped += 1
            assert rebalance(caps.tolist(), speed, span, room, 0.2, prefer) is None
    assert skipped > 200  # the check above is not vacuous


def test_weakest_start_is_petals_lexicographic_minimum():
    rng = random.Random(3)
    for _ in range(300):
        values = [float(rng.choice([0, 1, 2, 3])) for _ in range(rng.randint(1, 12))]  # many ties
        length = rng.randint(1, len(values))
        expected = min((sorted(values[i:i + length]), i) for i in range(len(values) - length + 1))[1]
        assert weakest_start(np.array(values), length) == expected


def test_the_prefilter_changes_no_decision(monkeypatch):
    import placement_sim

    exact = replace(TINY, stage_refresh_s=0.0, hours=0.5, warmup_s=900.0)  # a fresh stage share per check
    filtered = simulate(exact, "ours")
    monkeypatch.setattr(placement_sim, "may_move", lambda *args: True)  # call rebalance on every check
    unfiltered = simulate(exact, "ours")
    assert unfiltered.counters.prefiltered == 0 < filtered.counters.prefiltered
    assert filtered.counters.rebalance_calls > 0
    assert replace(unfiltered, counters=None, wall_s=0.0) == replace(filtered, counters=None, wall_s=0.0)


class Audited(Simulator):
    """Checks, every few events, that the incremental books match the peers' own spans."""

    def handle(self, kind, pid, gen):
        super().handle(kind, pid, gen)
        self.audits = getattr(self, "audits", 0) + 1
        if self.audits % 97:
            return
        live, view = [], []
        for p in self.peers.values():
            ours = f"p{p.spec.pid}"
            if p.old is not None:
                self.moving = getattr(self, "moving", 0) + 1
                live.append(Server(ours, p.old, p.spec.speed / len(p.old)))
                view.append(live[-1])
            if p.state == "online":
                live.append(Server(ours, p.span, p.spec.speed / len(p.span)))
            if p.state in ("joining", "online"):
                view.append(Server(ours, p.span, p.spec.speed / len(p.span)))
        blocks = self.cfg.blocks
        assert self.live.caps.tolist() == pytest.approx(capacities(blocks, live), rel=1e-9, abs=1e-6)
        assert self.view.caps.tolist() == pytest.approx(capacities(blocks, view), rel=1e-9, abs=1e-6)
        assert self.loaded == len(live)
        assert self.loaded_speed == pytest.approx(sum(s.speed for s in live))


def test_the_books_balance_through_moves():
    cfg = replace(TINY, margin=0.0, hours=0.25, warmup_s=900.0)  # many moves, most make-before-break
    sim = Audited(cfg, Ours(), make_peers(cfg))
    sim.run()
    assert sim.audits > 97 and sim.moves > 0 and getattr(sim, "moving", 0) > 0  # audited mid-move too
