"""Routing: the cheapest chain of peers over a synthetic swarm view, bans, cache room, claims believed only
as far as measured (and `SwarmClient.route` against floods of record-only identities, without sockets),
load, links between peers, random ties, the bounded wait for blocks, the re-route check, and the slow-peer
detector."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter

import pytest

from client.inference.routing import (CLAIM_CAP, LOAD_WEIGHT, UNKNOWN_BLOCK_MS, UNMEASURED_DELAY_MS, Bans, BlockWait, Hop,
                            Measurements, Offer, find_route, ranges_text, route_cost_ms, slower_than_assumed,
                            worth_switching)
from client.inference import swarm_client
from client.config import ClientConfig
from client.inference.hops import SlowDetector
from client.inference.swarm_client import MAX_PINGS, PING_ROUNDS
from swarm.errors import ConnectionLost, NoRoute
from swarm.net.records import Announcement
from swarm.span import Span

pytestmark = pytest.mark.unit


class Clock:
    """A fake monotonic clock the test advances by hand."""

    t = 0.0

    def __call__(self) -> float:
        return self.t


def measured(**figures: tuple[float, float, int]) -> Measurements:
    """Measurements from one decode step per peer: peer=(delay_ms, block_ms, blocks)."""
    m = Measurements()
    for peer, (delay, block, blocks) in figures.items():
        m.step(peer, rtt_ms=delay + block * blocks, compute_ms=block * blocks, tokens=1, blocks=blocks)
    return m


def route(offers, span, m=None, bans=None, **kw) -> list[Hop]:
    return find_route(offers, span, m or Measurements(), bans or Bans(), **kw)


def peers(hops: list[Hop]) -> list[str]:
    return [h.peer for h in hops]


def assert_chain(hops: list[Hop], span: Span) -> None:
    assert hops[0].span.start == span.start and hops[-1].span.end == span.end
    assert all(a.span.end == b.span.start for a, b in zip(hops, hops[1:]))


ONE_SLOW_TWO_FAST = [Offer("slow", Span(0, 6)), Offer("fast1", Span(0, 3)), Offer("fast2", Span(3, 6))]


@pytest.mark.parametrize("fast_delay,expected", [
    (10.0, [("fast1", Span(0, 3)), ("fast2", Span(3, 6))]),  # 2 * (10 + 3*5) = 50 < 10 + 6*10 = 70
    (40.0, [("slow", Span(0, 6))]),  # 2 * (40 + 3*5) = 110 > 70: the extra hop's delay is not worth it
])
def test_picks_the_cheaper_chain(fast_delay, expected):
    m = measured(slow=(10.0, 10.0, 6), fast1=(fast_delay, 5.0, 3), fast2=(fast_delay, 5.0, 3))
    assert route(ONE_SLOW_TWO_FAST, Span(0, 6), m) == [Hop(p, s) for p, s in expected]


def test_measured_compute_wins_over_announced_throughput():
    offers = [Offer("boaster", Span(0, 6), throughput=1000.0), Offer("honest", Span(0, 6), throughput=10.0)]
    m = Measurements()
    m.ping("boaster", 10.0)
    m.ping("honest", 10.0)
    assert peers(route(offers, Span(0, 6), m)) == ["boaster"]  # answered pings: their announcements decide
    m = measured(boaster=(10.0, 100.0, 6))  # measured: 10 + 600 ms against honest's 10 + 100 ms
    m.ping("honest", 10.0)
    m.step("boaster", rtt_ms=20.0, compute_ms=10.0, tokens=8, blocks=6)  # a fast prefill changes no block speed
    assert m.block_ms(offers[0]) == 100.0
    assert peers(route(offers, Span(0, 6), m)) == ["honest"]


def test_unmeasured_peer_gets_the_default_delay():
    offers = [Offer("a", Span(0, 4), throughput=10.0), Offer("b", Span(0, 4), throughput=10.0)]
    assert Measurements().expected_ms(offers[0], blocks=4, tokens=1) == UNMEASURED_DELAY_MS + 4 * UNKNOWN_BLOCK_MS
    for delay in (UNMEASURED_DELAY_MS - 1, UNMEASURED_DELAY_MS + 1, 10 * UNMEASURED_DELAY_MS):
        m = Measurements()
        m.ping("b", delay)
        assert peers(route(offers, Span(0, 4), m)) == ["b"]  # the one that answered, however slowly
    m = Measurements()
    m.ping("a", 30.0)
    m.ping("b", 20.0)
    assert peers(route(offers, Span(0, 4), m)) == ["b"]  # both answered: by their delays


def test_route_covers_exactly_the_requested_span():
    assert route([Offer("a", Span(0, 6))], Span(2, 4)) == [Hop("a", Span(2, 4))]
    offers = [Offer("a", Span(0, 4)), Offer("b", Span(2, 8)), Offer("c", Span(6, 10))]
    hops = route(offers, Span(1, 9))
    assert_chain(hops, Span(1, 9))
    assert peers(hops) == ["a", "b", "c"]  # every peer costs the same: the fewest hops


def test_avoids_peers_without_room_for_the_cache():
    clock = Clock()
    m = Measurements(cache_ttl=30.0, clock=clock)
    m.ping("small", 1.0)  # "small" is cheaper whenever it is eligible
    offers = [Offer("small", Span(0, 4), cache_tokens_left=100), Offer("big", Span(0, 4), cache_tokens_left=1000)]
    assert peers(route(offers, Span(0, 4), m, cache_tokens=50)) == ["small"]
    assert peers(route(offers, Span(0, 4), m, cache_tokens=500)) == ["big"]
    m.cache("small", 800)  # its last reply says it has room now
    clock.t = 30.0
    assert peers(route(offers, Span(0, 4), m, cache_tokens=500)) == ["small"]
    clock.t = 30.5  # the measurement expired: the announcement counts again
    assert peers(route(offers, Span(0, 4), m, cache_tokens=500)) == ["big"]
    m.cache("big", 10)
    with pytest.raises(NoRoute, match=r"2 without room for 500 cache tokens") as e:
        route(offers, Span(0, 4), m, cache_tokens=500)
    assert e.value.missing == (0, 1, 2, 3)


def test_ban_backoff_doubles_up_to_the_limit_and_success_resets_it():
    bans = Bans(base=5, limit=30, clock=Clock())
    assert [bans.ban("p", "timeout") for _ in range(5)] == [5, 10, 20, 30, 30]
    bans.succeeded("p")
    assert not bans.banned("p")
    assert bans.ban("p", "timeout") == 5 and bans.banned("p")
    bans.lift("p")
    assert not bans.banned("p")


def test_banned_peer_is_avoided_until_the_ban_expires():
    clock = Clock()
    bans = Bans(base=5, limit=300, clock=clock)
    m = measured(fast=(1.0, 1.0, 4), slow=(50.0, 50.0, 4))
    offers = [Offer("fast", Span(0, 4)), Offer("slow", Span(0, 4))]
    assert peers(route(offers, Span(0, 4), m, bans)) == ["fast"]
    bans.ban("fast", "timeout")
    clock.t = 4.9
    assert peers(route(offers, Span(0, 4), m, bans)) == ["slow"]
    clock.t = 5.0
    assert peers(route(offers, Span(0, 4), m, bans)) == ["fast"]
    assert bans.ban("fast", "timeout") == 10  # the second failure in a row: twice as long
    clock.t = 14.9
    assert peers(route(offers, Span(0, 4), m, bans)) == ["slow"]


def test_ban_backoff_stays_capped_after_many_failures():
    bans = Bans(base=5.0, limit=300.0, clock=Clock())  # float seconds, as from the client's config
    assert {bans.ban("p", "error") for _ in range(1100)} == {5, 10, 20, 40, 80, 160, 300}


def test_excluded_peer_is_not_used():
    m = measured(fast=(1.0, 1.0, 4))
    offers = [Offer("fast", Span(0, 4)), Offer("other", Span(0, 4))]
    assert peers(route(offers, Span(0, 4), m, exclude={"fast"})) == ["other"]
    with pytest.raises(NoRoute, match=r"2 avoided for this session"):
        route(offers, Span(0, 4), m, exclude={"fast", "other"})


def test_no_route_message_with_an_iterator_exclude():
    with pytest.raises(NoRoute, match=r"1 avoided for this session"):
        route([Offer("a", Span(0, 4))], Span(0, 4), exclude=iter(["a"]))


def test_no_route_names_the_missing_blocks_and_why():
    bans = Bans(clock=Clock())
    offers = [Offer("a", Span(0, 3)), Offer("b", Span(3, 6)), Offer("c", Span(6, 9))]
    bans.ban("b", "timeout")
    with pytest.raises(NoRoute) as e:
        route(offers, Span(0, 9), bans=bans, model="tiny-llama")
    assert e.value.missing == (3, 4, 5)
    assert "[3:6)" in str(e.value) and "tiny-llama" in str(e.value)
    assert "1 failed recently (timeout)" in str(e.value)
    # two separate gaps are named separately, and an unserved gap says nobody announces it
    offers = [Offer("a", Span(0, 2)), Offer("b", Span(2, 4)), Offer("c", Span(4, 6)), Offer("d", Span(6, 8))]
    bans.ban("d", "connection_lost")
    with pytest.raises(NoRoute) as e:
        route(offers, Span(0, 8), bans=bans)
    assert e.value.missing == (2, 3, 6, 7) and "blocks [2:4), [6:8) of" in str(e.value)
    assert "2 failed recently (connection_lost, timeout)" in str(e.value)
    with pytest.raises(NoRoute, match=r"blocks \[4:6\) of the model; peers announcing them: 0$") as e:
        route(offers[:2], Span(0, 6))
    assert e.value.missing == (4, 5)


def test_ties_are_broken_deterministically():
    twins = [Offer("b", Span(0, 4), throughput=10.0), Offer("a", Span(0, 4), throughput=10.0)]
    assert route(twins, Span(0, 4)) == route(twins[::-1], Span(0, 4)) == [Hop("a", Span(0, 4))]
    # one hop of 20 + 2*5 = 30 against two hops of 10 + 5 each: equal cost, fewer hops wins
    m = measured(z=(20.0, 5.0, 2), a=(10.0, 5.0, 1), b=(10.0, 5.0, 1))
    offers = [Offer("a", Span(0, 1)), Offer("b", Span(1, 2)), Offer("z", Span(0, 2))]
    assert route(offers, Span(0, 2), m) == route(offers[::-1], Span(0, 2), m) == [Hop("z", Span(0, 2))]


def warmed(ms: float = 10.0, warmup: int = 5, **kw) -> SlowDetector:
    detector = SlowDetector(warmup=warmup, **kw)
    assert not any(detector.observe(ms, 1) for _ in range(warmup))
    return detector


def test_slow_detector_ignores_warmup_and_prefill():
    detector = SlowDetector(factor=4, steps=1, warmup=5, floor_ms=0)
    assert not any(detector.observe(ms, 1) for ms in [10, 10, 10, 10, 1000])  # still warming up
    assert not any(detector.observe(1000, tokens=64) for _ in range(10))  # prefill steps are not compared
    assert detector.observe(1000, 1)  # the first slow decode step after warmup, with steps=1


def test_slow_detector_needs_most_recent_decode_steps_slow():
    detector = warmed(factor=4, steps=3, floor_ms=0)
    assert [detector.observe(ms, 1) for ms in [100, 10, 10, 100, 10]] == [False] * 5  # lone outliers never count
    assert detector.observe(100, 1)  # two of the last three are slow


def test_slow_detector_floor_ignores_jitter_on_a_tiny_baseline():
    detector = warmed(ms=1.0, factor=4, steps=3, floor_ms=50)
    assert not any(detector.observe(ms, 1) for ms in [5, 20, 51])  # 51 is not above 1 + 50
    assert [detector.observe(52, 1) for _ in range(2)] == [False, True]  # the window's median passes 51
    assert warmed(ms=1.0, factor=4, steps=1, floor_ms=0).observe(5, 1)  # without a floor, jitter would count


def test_reported_compute_is_clamped_to_the_measured_round_trip():
    m = Measurements()
    m.step("liar", rtt_ms=10.0, compute_ms=-5.0, tokens=1, blocks=2)
    assert m.peers["liar"].block_ms.value == 0.0 and m.delay_ms("liar") == 10.0
    m.step("nan", rtt_ms=10.0, compute_ms=float("nan"), tokens=1, blocks=2)
    assert m.peers["nan"].block_ms.value == 5.0 and m.delay_ms("nan") == 0.0
    m.step("boast", rtt_ms=10.0, compute_ms=500.0, tokens=1, blocks=1)
    assert m.peers["boast"].block_ms.value == 10.0


def test_forgotten_cache_figure_falls_back_to_the_announcement():
    m = Measurements(clock=Clock())
    offer = Offer("a", Span(0, 2), 10.0, 900)
    m.cache("a", 100)
    assert m.cache_left(offer) == 100
    m.forget_cache("a")
    assert m.cache_left(offer) == 900


# ---- claims believed only as far as measured (Sybil records) ----

FAKES = [Offer(f"fake{i:02d}", Span(0, 6), throughput=1e9, cache_tokens_left=10**9) for i in range(48)]
HONEST = [Offer("a", Span(0, 3), throughput=20.0, cache_tokens_left=1000),
          Offer("b", Span(3, 6), throughput=20.0, cache_tokens_left=1000)]


def test_a_fake_record_never_beats_a_peer_that_answered():
    slow = measured(a=(200.0, 80.0, 3), b=(200.0, 80.0, 3))  # stepped, and slower than anything assumed
    pinged = Measurements()
    for peer in ("a", "b"):
        pinged.ping(peer, 500.0)
    for m in (slow, pinged):
        assert peers(route(FAKES + HONEST, Span(0, 6), m)) == ["a", "b"]
        assert peers(route(FAKES + HONEST, Span(0, 6), m, rng=random.Random(1), cache_tokens=500)) == ["a", "b"]
    fake_cost = route_cost_ms([Hop("fake00", Span(0, 6))], {"fake00": FAKES[0]}, Measurements())
    assert fake_cost == UNMEASURED_DELAY_MS + 6 * UNKNOWN_BLOCK_MS  # what it claims counts for nothing


def test_unproven_peers_serve_only_blocks_no_proven_peer_serves():
    m = measured(a=(10.0, 5.0, 3))
    hops = route(FAKES[:2] + HONEST[:1], Span(0, 6), m)
    assert hops == [Hop("a", Span(0, 3)), Hop("fake00", Span(3, 6))]  # [3:6): only unproven peers serve it
    m.ping("fake01", 10.0)
    assert peers(route(FAKES[:2] + HONEST[:1], Span(0, 6), m)) == ["fake01"]  # both proven: the cheaper one
    # among unproven peers, claims decide nothing: fewer hops, then the lower id
    liars = [Offer("y", Span(0, 6), throughput=1e9), Offer("x", Span(0, 6), throughput=0.001)]
    assert peers(route(liars, Span(0, 6))) == ["x"]


def test_a_pinged_peers_claim_counts_at_most_claim_cap_times_the_fastest_measured():
    liar = Offer("liar", Span(0, 6), throughput=1e9)
    m = Measurements()
    m.ping("liar", 1.0)
    assert m.block_ms(liar) == pytest.approx(1000.0 / 6e9)  # nothing measured by steps yet: taken as announced
    m.step("h", rtt_ms=31.0, compute_ms=30.0, tokens=1, blocks=6)  # 5 ms per block
    assert m.block_ms(liar) == 5.0 / CLAIM_CAP
    assert m.block_ms(Offer("liar", Span(0, 6), throughput=1.0)) == 1000.0 / 6  # slower claims count as they are
    # the liar looks faster, but not so much faster that load stops spreading sessions
    load = spread([liar, Offer("h", Span(0, 6))], m)
    assert load["liar"] > load["h"] >= 1


class Flood:
    """A swarm view for `SwarmClient` without sockets: honest peers `a` [0:3) and `b` [3:6) that answer pings,
    and `fakes` record-only identities announcing [0:6) at 1e9 tokens/s with newer sequence numbers, whose
    pings fail at once (or never end, with `silent`)."""

    def __init__(self, monkeypatch, fakes: int, silent: bool = False, **config):
        self.fakes = [f"fake{i:03d}" for i in range(fakes)]
        self.silent, self.pinged, self.live = silent, [], {"a", "b"}
        anns = [self.ann("a", 0, 3, 20.0, 1), self.ann("b", 3, 6, 20.0, 1)]
        anns += [self.ann(p, 0, 6, 1e9, 10**12) for p in self.fakes]
        self.anns = {block: [a for a in anns if a.start <= block < a.end] for block in range(6)}
        monkeypatch.setattr(swarm_client.discovery, "announcements", self._announcements)
        monkeypatch.setattr(swarm_client.peer_session, "info", self._info)
        self.client = swarm_client.SwarmClient(None, "m", 6, ClientConfig(ping_timeout=0.05, **config))

    @staticmethod
    def ann(peer: str, start: int, end: int, throughput: float, seq: int) -> Announcement:
        return Announcement(peer, "m", start, end, "online", throughput, throughput, 10**6, "0.1.0", seq, 0.0)

    async def _announcements(self, node, model_id, num_blocks):
        return self.anns

    async def _info(self, node, peer, timeout=None):
        self.pinged.append(peer)
        if peer in self.live:
            return None
        if self.silent:
            await asyncio.sleep(3600)
        raise ConnectionLost(f"cannot reach {peer}")

    def route(self, **kw) -> list[Hop]:
        return asyncio.run(self.client.route(**kw))


@pytest.mark.parametrize("seed", range(5))
def test_a_fresh_client_routes_through_peers_that_answered_despite_a_flood(monkeypatch, seed):
    random.seed(seed)
    flood = Flood(monkeypatch, 60)
    assert peers(flood.route()) == ["a", "b"]
    tried = set(flood.pinged) - {"a", "b"}
    assert len(flood.pinged) == len(set(flood.pinged)) <= MAX_PINGS * (PING_ROUNDS + 1)  # each once, bounded
    assert tried and all(flood.client.bans.banned(p) for p in tried)
    before = len(flood.pinged)
    assert peers(flood.route()) == ["a", "b"] and len(flood.pinged) == before  # the view is fresh: no pings


def test_pings_of_a_bigger_flood_stay_bounded_in_count_and_time(monkeypatch):
    flood = Flood(monkeypatch, 1000, silent=True)
    started = time.monotonic()
    hops = flood.route(span=Span(0, 3))
    assert len(flood.pinged) <= MAX_PINGS * (PING_ROUNDS + 1)
    assert time.monotonic() - started < (PING_ROUNDS + 1) * 0.05 + 1.0
    # "a" may be among the few pinged; if not, an unproven fake is all that is left to try
    assert peers(hops) == ["a"] if "a" in flood.pinged else not flood.client.measurements.proven(hops[0].peer)


def test_allow_peers_ignores_every_other_record(monkeypatch):
    flood = Flood(monkeypatch, 60, allow_peers=("a", "b"))
    assert peers(flood.route()) == ["a", "b"] and sorted(flood.pinged) == ["a", "b"]
    assert set(flood.client.offers) == {"a", "b"}


# ---- load ----

def spread(offers, m, sessions: int = 8, **kw) -> Counter:
    """Routes for `sessions` sessions opened one after another by one client, each counted as load."""
    load: Counter = Counter()
    for _ in range(sessions):
        for hop in route(offers, Span(0, 6), m, load=load, **kw):
            load[hop.peer] += 1
    return load


def test_sessions_of_one_client_split_evenly_over_equal_replicas():
    twins = [Offer("a", Span(0, 6), throughput=100.0), Offer("b", Span(0, 6), throughput=100.0)]
    assert spread(twins, Measurements()) == {"a": 4, "b": 4}
    assert spread(twins, Measurements(), rng=random.Random(3)) == {"a": 4, "b": 4}
    # measured, and not quite equal: 10 + 6 * 5 = 40 ms against 12 + 6 * 5.2 = 43.2 ms per token
    assert sorted(spread(twins, measured(a=(10.0, 5.0, 6), b=(12.0, 5.2, 6))).values()) in ([4, 4], [3, 5])


def test_announced_load_raises_a_peers_cost():
    m = measured(a=(10.0, 5.0, 6), b=(10.0, 5.0, 6))
    busy = [Offer("a", Span(0, 6), sessions=2, queued=1), Offer("b", Span(0, 6), sessions=1)]
    assert peers(route(busy, Span(0, 6), m)) == ["b"]  # 10 + 30 * (1 + 0.5 * 3) = 85 against 55
    assert route_cost_ms([Hop("a", Span(0, 6))], {o.peer: o for o in busy}, m) == 10 + 30 * (1 + LOAD_WEIGHT * 3)
    # our own sessions count at once; the announcement includes them later, so the larger counts, not the sum
    assert peers(route(busy, Span(0, 6), m, load={"b": 2})) == ["b"]  # a: 2 + 1 queued; b: max(1, 2) = 2
    assert peers(route(busy, Span(0, 6), m, load={"b": 4})) == ["a"]
    # older peers announce no load: None counts as none
    assert peers(route([Offer("b", Span(0, 6)), Offer("a", Span(0, 6))], Span(0, 6), m)) == ["a"]


# ---- random ties ----

def test_seeded_tie_breaking_is_reproducible_and_spreads_over_seeds():
    twins = [Offer(p, Span(0, 4), throughput=10.0) for p in ("a", "b", "c")]
    chosen = [peers(route(twins, Span(0, 4), rng=random.Random(seed)))[0] for seed in range(30)]
    again = [peers(route(twins[::-1], Span(0, 4), rng=random.Random(seed)))[0] for seed in range(30)]
    assert chosen == again  # the same seed gives the same choice, whatever the order of the view
    assert set(chosen) == {"a", "b", "c"}
    assert peers(route(twins, Span(0, 4))) == ["a"]  # without an rng: the lowest peer id, as before


def test_random_ties_never_beat_a_cheaper_or_shorter_route():
    m = measured(fast=(1.0, 1.0, 4), slow=(1.0, 1.1, 4))
    offers = [Offer("fast", Span(0, 4)), Offer("slow", Span(0, 4))]
    assert {peers(route(offers, Span(0, 4), m, rng=random.Random(s)))[0] for s in range(20)} == {"fast"}
    m = measured(z=(20.0, 5.0, 2), a=(10.0, 5.0, 1), b=(10.0, 5.0, 1))  # equal cost: fewer hops still wins
    offers = [Offer("a", Span(0, 1)), Offer("b", Span(1, 2)), Offer("z", Span(0, 2))]
    assert all(route(offers, Span(0, 2), m, rng=random.Random(s)) == [Hop("z", Span(0, 2))] for s in range(20))


# ---- links between peers, when chaining ----

A, B, C = "12D3KooWfirstpeerAAAAAAAA", "12D3KooWnearclientBBBBBBBB", "12D3KooWneartheotherCCCCCCCC"


def test_chained_hops_are_priced_by_the_link_the_previous_peer_announced():
    m = measured(**{A: (10.0, 1.0, 3), B: (10.0, 1.0, 3), C: (30.0, 1.0, 3)})
    first = Offer(A, Span(0, 3), links={C[-8:]: 2.0, B[-8:]: 40.0})
    offers = [first, Offer(B, Span(3, 6)), Offer(C, Span(3, 6))]
    # relayed, the client's own delays count: B at 10 ms beats C at 30 ms
    assert peers(route(offers, Span(0, 6), m)) == [A, B]
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [A, C]  # A reaches C in 2 ms, B in 40 ms
    by_peer = {o.peer: o for o in offers}
    # one way around the loop: client -> A, A -> C, C -> client, and the compute
    assert route_cost_ms([Hop(A, Span(0, 3)), Hop(C, Span(3, 6))], by_peer, m, chain=True) == 10 / 2 + 3 + 2 / 2 + 30 / 2 + 3
    assert route_cost_ms([Hop(A, Span(0, 3)), Hop(C, Span(3, 6))], by_peer, m) == 10 + 3 + 30 + 3  # relayed
    # a link to a peer it does not name: the client's delay to that peer
    no_link = [Offer(A, Span(0, 3), links={"zzzzzzzz": 1.0}), Offer(B, Span(3, 6)), Offer(C, Span(3, 6))]
    assert peers(route(no_link, Span(0, 6), m, chain=True)) == [A, B]


def test_two_peers_near_the_client_but_far_apart_lose_to_a_pair_near_each_other():
    near_a, near_b, far_c, far_d = "12D3KooWnearAAAAAAAA", "12D3KooWnearBBBBBBBB", "12D3KooWfarCCCCCCCC", "12D3KooWfarDDDDDDDD"
    m = measured(**{near_a: (5.0, 1.0, 3), near_b: (5.0, 1.0, 3), far_c: (20.0, 1.0, 3), far_d: (20.0, 1.0, 3)})
    offers = [Offer(near_a, Span(0, 3), links={near_b[-8:]: 200.0}), Offer(near_b, Span(3, 6)),
              Offer(far_c, Span(0, 3), links={far_d[-8:]: 2.0}), Offer(far_d, Span(3, 6))]
    assert peers(route(offers, Span(0, 6), m)) == [near_a, near_b]  # relayed, the client's delays decide
    # chained: 5/2 + 200/2 + 5/2 against 20/2 + 2/2 + 20/2
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [far_c, far_d]
    by_peer = {o.peer: o for o in offers}
    assert route_cost_ms([Hop(far_c, Span(0, 3)), Hop(far_d, Span(3, 6))], by_peer, m, chain=True) == 21 + 6
    # no links at all: a chained route costs what it would relayed
    bare = [Offer(o.peer, o.span) for o in offers]
    assert peers(route(bare, Span(0, 6), m, chain=True)) == [near_a, near_b]
    assert route_cost_ms([Hop(near_a, Span(0, 3)), Hop(near_b, Span(3, 6))], {o.peer: o for o in bare}, m,
                         chain=True) == 10 + 6


def test_a_link_that_saves_more_than_its_hop_costs_is_still_priced_right():
    # A is far from the client and alone on [0:3); its link to B is short, so the hop to B costs less than
    # nothing on its own (B's answer need not travel back through A's long client link)
    m = measured(**{A: (100.0, 1.0, 3), B: (10.0, 1.0, 3), C: (5.0, 1.0, 3)})
    offers = [Offer(A, Span(0, 3), links={B[-8:]: 1.0}), Offer(B, Span(3, 6)), Offer(C, Span(3, 6))]
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [A, B]  # 100/2 + 1/2 + 10/2 against 100 + 5
    assert route_cost_ms([Hop(A, Span(0, 3)), Hop(B, Span(3, 6))], {o.peer: o for o in offers}, m,
                         chain=True) == 50 + 0.5 + 5 + 6


def test_the_first_hop_costs_the_clients_delay_whatever_links_say():
    m = measured(**{A: (50.0, 1.0, 6), B: (10.0, 1.0, 6)})
    offers = [Offer(A, Span(0, 6), links={B[-8:]: 0.1}), Offer(B, Span(0, 6), links={A[-8:]: 0.1})]
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [B]


def test_links_choose_between_chains_over_several_boundaries():
    """Three spans, two replicas of the middle one: the cheapest path depends on the peer before each hop,
    which Dijkstra over boundaries alone could not see."""
    names = {n: f"12D3KooW{n * 8}" for n in "abcde"}
    a, b1, b2, c = names["a"], names["b"], names["c"], names["d"]
    m = measured(**{a: (5.0, 1.0, 2), b1: (50.0, 1.0, 2), b2: (50.0, 1.0, 2), c: (50.0, 1.0, 2)})  # far from us
    offers = [Offer(a, Span(0, 2), links={b1[-8:]: 20.0, b2[-8:]: 1.0}), Offer(b1, Span(2, 4), links={c[-8:]: 1.0}),
              Offer(b2, Span(2, 4), links={c[-8:]: 1.0}), Offer(c, Span(4, 6))]
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [a, b2, c]
    offers[2] = Offer(b2, Span(2, 4), links={c[-8:]: 30.0})  # b2 is near a but far from c: b1's total is less
    assert peers(route(offers, Span(0, 6), m, chain=True)) == [a, b1, c]


def test_ranges_text():
    assert ranges_text([3, 4, 5, 8]) == "[3:6), [8:9)" and ranges_text([]) == "none"


# ---- the bounded wait for blocks ----

def test_block_wait_tries_about_every_interval_until_the_deadline():
    clock = Clock()
    wait = BlockWait(3.5, interval=1.0, clock=clock)
    delays = []
    while (delay := wait.next_delay()) is not None:
        delays.append(delay)
        clock.t += delay + 0.2  # each try takes 0.2 s
    assert delays == pytest.approx([1.0, 0.8, 0.8, 0.3])  # the last try at the deadline, 3.5 s in
    assert wait.waited == pytest.approx(3.7)


def test_block_wait_is_bounded_by_count_when_the_clock_stands_still():
    wait = BlockWait(3.0, interval=1.0, clock=lambda: 0.0)
    assert len([d for d in iter(wait.next_delay, None)]) == 4
    assert BlockWait(0.0, clock=Clock()).next_delay() is None


def test_block_wait_goes_at_once_after_a_try_longer_than_the_interval():
    clock = Clock()
    wait = BlockWait(10.0, interval=1.0, clock=clock)
    assert wait.next_delay() == 1.0
    clock.t = 3.5  # that try took 2.5 s (a ping that timed out)
    assert wait.next_delay() == 0.0


# ---- a second look at the route after the first decode steps ----

def test_slower_than_assumed_names_the_hops_measured_much_slower():
    assert slower_than_assumed([1.0, 2.0, 3.0], [2.5, 3.0, None]) == [0]  # 3.0 < 2 * 2.0; None: not measured
    assert slower_than_assumed([1.0], [2.0]) == []  # exactly twice is not more than twice
    assert slower_than_assumed([1.0, 1.0], [1.5, 9.0], factor=1.4) == [0, 1]


def test_worth_switching_needs_a_clear_margin():
    assert worth_switching(100.0, 69.0) and not worth_switching(100.0, 71.0)
    assert not worth_switching(100.0, 100.0) and not worth_switching(100.0, 120.0)


class NoRelayDials:
    """A transport like the light client's: it dials direct addresses only."""

    dials_relays = False


def test_a_transport_that_cannot_dial_relays_routes_around_peers_behind_nats_and_never_bans_them(monkeypatch):
    def swarm(*anns) -> Flood:
        flood = Flood(monkeypatch, 0)
        flood.anns = {block: [a for a in anns if a.start <= block < a.end] for block in range(6)}
        flood.client.node, flood.live = NoRelayDials(), {"a", "b", "nat"}
        return flood

    def ann(peer, start, end, reach):
        return dataclasses.replace(Flood.ann(peer, start, end, 20.0, 1), reach=reach)

    a, nat, b = ann("a", 0, 3, "direct"), ann("nat", 3, 6, "relay"), ann("b", 3, 6, "direct")
    flood = swarm(a, nat, b)
    assert peers(flood.route()) == ["a", "b"]
    assert "nat" not in flood.pinged and not flood.client.bans.banned("nat")
    flood = swarm(a, nat)  # only a peer behind a NAT serves [3:6): no route, and the error says why
    with pytest.raises(NoRoute, match="1 more peers serve them behind NATs"):
        flood.route()
    assert "nat" not in flood.pinged and not flood.client.bans.banned("nat")
    flood = swarm(a, nat)
    flood.client.node = None  # the daemon's transport reaches it through its relay
    assert peers(flood.route()) == ["a", "nat"]
