"""Placement on synthetic swarms: capacities, the bottleneck, how many blocks and where, rebalancing and its
hysteresis, claims. No sockets, no clock."""

from __future__ import annotations

import itertools
import math

import pytest

from swarm.net import view
from peer import placement
from swarm.net.view import Server
from peer.placement import best_span, bottleneck, capacities, decide, plan, rebalance
from swarm.net.records import Announcement
from swarm.span import Span

pytestmark = pytest.mark.unit


def ann(peer: str, start: int, end: int, state: str = "online", seq: int = 1, throughput: float = 1.0,
        since: float | None = None) -> Announcement:
    return Announcement(peer=peer, model="m", start=start, end=end, state=state, throughput=throughput,
                        prefill_tps=1.0, cache_tokens_left=100, version="0.1.0", seq=seq, issued_at=0.0, since=since)


def by_block(*anns: Announcement) -> dict[int, list[Announcement]]:
    out: dict[int, list[Announcement]] = {}
    for a in anns:
        for block in a.span:
            out.setdefault(block, []).append(a)
    return out


def join_all(speeds: tuple[float, ...], memory: int, num_blocks: int) -> list[Server]:
    """Peers joining one after another, then rebalancing rounds until nobody moves (bounded)."""
    swarm: list[Server] = []
    for i, speed in enumerate(speeds):
        span = plan(swarm, f"p{i}", speed, memory, num_blocks).span
        swarm.append(Server(f"p{i}", span, speed / len(span), max_blocks=memory))
    for _ in range(10):
        moved = False
        for i, server in enumerate(list(swarm)):
            move = decide(swarm, server.peer, speeds[i], memory, num_blocks, server.span)
            if move is not None:
                swarm[i] = Server(server.peer, move.span, speeds[i] / len(move.span), max_blocks=memory)
                moved = True
        if not moved:
            return swarm
    raise AssertionError(f"still moving after 10 rounds: {swarm}")


def test_capacity_adds_each_peers_throughput_to_its_blocks():
    caps = capacities(4, [Server("a", Span(0, 2), 3.0), Server("b", Span(1, 4), 1.5)])
    assert caps == [3.0, 4.5, 1.5, 1.5]
    assert bottleneck(caps) == 1.5 and placement.holes(caps) == []
    assert placement.holes(capacities(3, [Server("a", Span(0, 1), 1.0)])) == [1, 2]


def test_servers_take_each_blocks_newest_record_and_skip_offline_ones():
    """A moving peer: its new span claimed (joining) while the rest of its old one is online; a stopped one
    (offline, newer) counts nowhere."""
    anns = by_block(ann("mover", 0, 4, seq=1), ann("stopped", 0, 2, seq=1))
    for b in (2, 3):  # the mover claimed [2:6): its newer record replaced the old one under blocks 2 and 3
        anns[b] = [a for a in anns[b] if a.peer != "mover"]
    for b, records in by_block(ann("mover", 2, 6, state="joining", seq=2, since=5.0)).items():
        anns.setdefault(b, []).extend(records)
    for b in (0, 1):
        anns[b].append(ann("stopped", 0, 2, state="offline", seq=2))
    got = sorted((s.peer, str(s.span), s.state) for s in view.servers(anns, 6))
    assert got == [("mover", "[0:2)", "online"), ("mover", "[2:6)", "joining")]
    assert view.servers(anns, 6, exclude={"mover"}) == []


def test_a_lone_peer_takes_every_block_that_fits():
    assert plan([], "a", 10.0, 30, 30).span == Span(0, 30)
    assert plan([], "a", 10.0, 12, 30).span == Span(0, 12)


def test_a_joining_peer_fills_holes_first():
    swarm = [Server("a", Span(0, 10), 1.0)]
    assert plan(swarm, "b", 1.0, 10, 30).span == Span(10, 20)
    assert plan(swarm, "b", 1.0, 25, 30).span == Span(10, 30)  # all the holes, not more


@pytest.mark.parametrize("memory", [20, 15])
@pytest.mark.parametrize("speeds", list(itertools.permutations((4.0, 2.0, 1.0))))
def test_unequal_peers_in_any_start_order(speeds, memory):
    """4:2:1 peers with the same memory, in every start order: the model is covered, the bottleneck is at
    least what their memory allows with the fast peer full (0.2 tokens/s: the slow and middle peers
    together carry the blocks the fast one cannot hold), no peer serves more than its stage share (give
    or take the rebalancing's hysteresis: a block, or the margin), and with room for 20 blocks the slow
    peer serves the fewest."""
    swarm = join_all(speeds, memory, 30)
    caps = capacities(30, swarm)
    assert placement.holes(caps) == []
    assert bottleneck(caps) >= 0.2 - 1e-9
    assert bottleneck(caps) >= 0.85 * placement.ideal(30, speeds)
    stage = placement.stage_time([(s, memory) for s in speeds], 30)
    shares = {s.peer: math.ceil(speeds[int(s.peer[1:])] * stage - 1e-9) for s in swarm}  # at least the share
    assert all(len(s.span) <= max(shares[s.peer] + 1, shares[s.peer] * (1 + placement.MARGIN)) for s in swarm)
    if memory == 20:
        length = {speeds[int(s.peer[1:])]: len(s.span) for s in swarm}
        assert length[1.0] == min(length.values()) < length[4.0]


def test_with_room_for_everything_spans_follow_speed():
    """Three peers that can each hold the model: one copy in proportion to speed (16, 10 and 4 blocks at a
    stage time of 5 s at most; the shares are 18, 8 and 4 at 30/7 s), not full replicas next to a slow one."""
    swarm = join_all((4.0, 2.0, 1.0), 30, 30)
    assert [len(s.span) for s in swarm] == [16, 10, 4]
    assert bottleneck(capacities(30, swarm)) == pytest.approx(0.2)
    assert bottleneck(capacities(30, swarm)) >= 0.85 * placement.ideal(30, (4.0, 2.0, 1.0))


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_slow_peer_serves_its_share_alone_not_next_to_a_fast_one(order):
    """The unequal machines of the benchmark (speeds from block costs of 8, 20.1 and 62.1 ms, memory for 20
    of 30 blocks), in every start order: no two peers serve the same block (a replica several times slower
    than its neighbour would carry stragglers, docs/placement.md), every hop stays within the stage time,
    and the bottleneck is within 16% of the ideal."""
    speeds = [1000 / 8.0, 1000 / 20.1, 1000 / 62.1]
    joined = join_all(tuple(speeds[i] for i in order), 20, 30)
    caps = capacities(30, joined)
    assert placement.holes(caps) == []
    served = [b for s in joined for b in s.span]
    assert len(served) == len(set(served)) == 30
    stage = placement.stage_time([(s, 20) for s in speeds], 30)
    assert all(len(s.span) / s.speed <= stage * 1.25 for s in joined)
    assert bottleneck(caps) >= 0.84 * placement.ideal(30, speeds)


def test_stage_time_covers_the_model_a_whole_number_of_times():
    assert placement.stage_time([(4.0, 30), (2.0, 30), (1.0, 30)], 30) == pytest.approx(30 / 7)  # one copy
    assert placement.stage_time([(4.0, 15), (2.0, 15), (1.0, 15)], 30) == pytest.approx(5.0)  # fast one full
    assert placement.stage_time([(5.0, 20)], 30) == pytest.approx(4.0)  # alone, too small: its memory full
    # many equal peers with room for 10 blocks each: the median fills its memory, 10 copies of 30 blocks
    assert placement.stage_time([(1.0, 10)] * 30, 30) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        placement.stage_time([], 30)


def test_a_slow_peer_takes_a_short_span_when_a_long_one_buys_nothing():
    """Blocks all equally served: any span leaves the bottleneck where it is, so the slow peer keeps to its
    stage share instead of spreading a little over many blocks."""
    swarm = [Server("fast", Span(0, 20), 0.2, max_blocks=20), Server("mid", Span(10, 30), 0.1, max_blocks=20),
             Server("mid2", Span(0, 10), 0.1, max_blocks=20)]
    choice = plan(swarm, "slow", 1.0, 20, 30)
    assert len(choice.span) <= 10


def test_num_blocks_fixes_the_length():
    assert len(best_span([0.0] * 10, 1.0, 4, min_blocks=4).span) == 4
    assert len(best_span([5.0] * 10, 1.0, 4, prefer_blocks=1, min_blocks=4).span) == 4


def test_rebalance_fills_a_hole_when_it_has_room():
    """[15:30) lost its only peer; a peer on [0:15) (as is b) moves there: the bottleneck is then b's 1.0,
    where serving all 30 blocks would leave [15:30) at 0.5."""
    caps = capacities(30, [Server("b", Span(0, 15), 1.0)])
    move = rebalance(caps, 15.0, Span(0, 15), 30)
    assert move is not None and move.span == Span(15, 30) and move.holes == 0 and move.bottleneck == 1.0
    alone = rebalance([0.0] * 30, 15.0, Span(0, 15), 30)  # nobody else left: it takes the whole model
    assert alone is not None and alone.span == Span(0, 30)


def test_rebalance_does_not_move_when_moving_only_shifts_the_hole():
    caps = [0.0] * 30  # its partner died; it can hold 15 blocks: wherever it goes, 15 blocks stay empty
    assert rebalance(caps, 15.0, Span(0, 15), 15) is None


def test_rebalance_moves_a_redundant_replica_to_the_weak_blocks():
    caps = capacities(30, [Server("b", Span(0, 15), 1.0), Server("c", Span(15, 30), 0.2)])
    move = rebalance(caps, 15.0, Span(0, 15), 15)
    assert move is not None and move.span == Span(15, 30)


def test_hysteresis_no_move_for_a_gain_within_the_margin():
    """Moving would raise the bottleneck by 10%: below the 20% margin, so the peer stays; at 40% it moves."""
    caps = capacities(20, [Server("b", Span(0, 10), 1.0), Server("c", Span(10, 20), 1.0)])
    # serving [0:10) at 1.0/block-span: blocks 10..19 stay at 1.0 either way
    assert rebalance(caps, 10.0, Span(0, 10), 10) is None
    caps[15] = 0.9  # a slightly weaker block: moving there gains 10% on the bottleneck
    assert rebalance(caps, 10.0, Span(0, 10), 10, margin=0.2) is None
    caps[15] = 0.5
    move = rebalance(caps, 10.0, Span(0, 10), 10, margin=0.2)
    assert move is not None and move.span.start <= 15 < move.span.end


def test_a_settled_swarm_makes_no_move_for_many_periods():
    speeds = (4.0, 2.0, 1.0, 3.0, 1.5)
    swarm = join_all(speeds, 12, 30)
    for _ in range(20):  # a figure that wobbles by 5% moves nobody
        for i, server in enumerate(swarm):
            for wobble in (0.95, 1.05):
                assert decide(swarm, server.peer, speeds[i] * wobble, 12, 30, server.span) is None


def test_an_earlier_claim_wins():
    swarm = [Server("a", Span(0, 10), 1.0), Server("x", Span(10, 20), 1.0, "joining", since=5.0),
             Server("y", Span(10, 20), 1.0, "joining", since=7.0)]
    assert {s.peer for s in placement.claims_before(swarm, "y", 7.0)} == {"a", "x"}
    assert {s.peer for s in placement.claims_before(swarm, "x", 5.0)} == {"a"}
    tied = swarm + [Server("w", Span(10, 20), 1.0, "joining", since=5.0)]
    assert "w" in {s.peer for s in placement.claims_before(tied, "x", 5.0)}  # equal times: the lower id wins
    assert "x" not in {s.peer for s in placement.claims_before(tied, "w", 5.0)}


def test_a_later_claimant_backs_off():
    """Two peers go for the same hole: with the earlier claim counted, the later one's move is no longer
    worth it."""
    swarm = [Server("a", Span(0, 10), 1.0), Server("b", Span(0, 10), 1.0), Server("c", Span(10, 20), 1.0)]
    # c died: both a and b would take [10:20)
    alive = swarm[:2]
    assert decide(alive, "a", 10.0, 10, 20, Span(0, 10)) is not None
    assert decide(alive, "b", 10.0, 10, 20, Span(0, 10)) is not None
    claimed = alive + [Server("a", Span(10, 20), 1.0, "joining", since=1.0)]
    later = placement.claims_before(claimed, "b", 2.0)
    assert decide(later, "b", 10.0, 10, 20, Span(0, 10)) is None


def test_best_span_rejects_impossible_input():
    with pytest.raises(ValueError):
        best_span([], 1.0, 3)
    with pytest.raises(ValueError):
        best_span([1.0], 0.0, 1)


def test_clients_route_by_each_peers_newest_online_span():
    moving = by_block(ann("m", 0, 4, seq=1))
    for b, records in by_block(ann("m", 2, 6, state="joining", seq=2)).items():  # claimed, still loading
        moving[b] = [a for a in moving.get(b, []) if b < 2] + records
    assert view.online(moving)["m"].span == Span(0, 4)
    for b, records in by_block(ann("m", 2, 6, seq=3)).items():  # moved: the new span online...
        moving[b] = [a for a in moving.get(b, []) if a.seq != 2] + records
    for b in (0, 1):  # ... and the rest of the old one offline, under its own blocks
        moving[b].append(ann("m", 0, 4, state="offline", seq=4))
    assert view.online(moving)["m"].span == Span(2, 6)
    left = by_block(ann("gone", 0, 3, seq=1), ann("gone", 0, 3, state="offline", seq=2))
    assert view.online(left) == {}
    backed_off = by_block(ann("b", 0, 3, seq=1), ann("b", 3, 6, state="offline", seq=3))  # a claim taken back
    assert view.online(backed_off)["b"].span == Span(0, 3)


def test_whole_shares_keep_the_slowest_stage_quickest():
    """Shares of 17.1, 8.6 and 4.3 blocks: rounded down to 17, 8 and 4, and the block left over goes where one
    more costs least (the fast peer: 18 blocks at 4 is 4.5 s, the same as 9 at 2, less than 5 at 1), not 18,
    9 and 5 (rounded up: 32 blocks, and the slow hop at 5 s)."""
    assert placement.whole_shares([(4.0, 30), (2.0, 30), (1.0, 30)], 30) == [18, 8, 4]
    assert placement.whole_shares([(1.0, 30), (2.0, 30), (4.0, 30)], 30) == [4, 8, 18]
    assert placement.whole_shares([(4.0, 3), (2.0, 30), (1.0, 30)], 30) == [3, 18, 9]  # the fast one is full
    assert sum(placement.whole_shares([(float(s), 20) for s in range(1, 40)], 80)) == 6 * 80  # whole copies


# ---- regions: the peers near a joining peer complete a chain of their own ----

def join_in_regions(order: list[str], memory: int, num_blocks: int) -> list[tuple[str, Server]]:
    """Peers of equal speed joining one after another, each in the region named in `order`; a peer's near
    peers are those of its own region (as `Distances` would find them). Then rebalancing rounds (bounded)."""
    swarm: list[tuple[str, Server]] = []
    for i, where in enumerate(order):
        near = {s.peer for r, s in swarm if r == where}
        span = plan([s for _, s in swarm], f"p{i}", 1.0, memory, num_blocks, near).span
        swarm.append((where, Server(f"p{i}", span, 1.0 / len(span), max_blocks=memory)))
    for _ in range(10):
        moved = False
        for i, (where, me) in enumerate(swarm):
            others = [s for _, s in swarm]
            near = {s.peer for r, s in swarm if r == where and s.peer != me.peer}
            to = decide(others, me.peer, 1.0, memory, num_blocks, me.span, near=near)
            if to is not None:
                swarm[i] = (where, Server(me.peer, to.span, 1.0 / len(to.span), max_blocks=memory))
                moved = True
        if not moved:
            return swarm
    raise AssertionError(f"still moving after 10 rounds: {swarm}")


def covered(swarm: list[tuple[str, Server]], region: str, num_blocks: int) -> bool:
    return not placement.holes(capacities(num_blocks, [s for r, s in swarm if r == region]))


@pytest.mark.parametrize("order", [["eu", "us", "eu", "us"], ["eu", "eu", "us", "us"], ["us", "eu", "eu", "us"]])
def test_peers_joining_in_two_regions_make_each_region_hold_the_whole_model(order):
    swarm = join_in_regions(order, memory=15, num_blocks=30)
    assert covered(swarm, "eu", 30) and covered(swarm, "us", 30), swarm


def test_without_distances_the_same_peers_leave_each_region_half_the_model():
    # the placement by throughput alone (no near peers known): the third peer doubles the first half
    swarm: list[Server] = []
    for i in range(4):
        swarm.append(Server(f"p{i}", plan(swarm, f"p{i}", 1.0, 15, 30).span, 1.0 / 15, max_blocks=15))
    regions = {"eu": [swarm[0], swarm[2]], "us": [swarm[1], swarm[3]]}
    assert all(placement.holes(capacities(30, peers)) for peers in regions.values()), swarm


def test_a_region_without_room_for_the_model_counts_for_nothing():
    served = [Server("far", Span(0, 30), 1.0 / 30, max_blocks=30), Server("near", Span(0, 10), 0.1, max_blocks=10)]
    # the near peer and this one hold 20 blocks at most: the region cannot be whole, throughput decides
    assert placement.region(served, {"near"}, 10, 30) is None
    assert plan(served, "me", 1.0, 10, 30, near={"near"}).local == 0
    # with room for the rest the region counts: the blocks no near peer serves win
    assert placement.region(served, {"near"}, 20, 30) is not None
    assert plan(served, "me", 1.0, 20, 30, near={"near"}).span == Span(10, 30)


def test_a_peer_that_completes_its_region_stays_there_for_the_bottleneck():
    # eu: a [0:15) and b [15:30); us: c [0:15), f, g and h [15:30). Throughput alone moves b to [0:15) (the
    # swarm's bottleneck from 2 copies to 3), which would leave its region without [15:30): it stays.
    half = [Server("a", Span(0, 15), 1 / 15, max_blocks=15), Server("c", Span(0, 15), 1 / 15, max_blocks=15)]
    half += [Server(p, Span(15, 30), 1 / 15, max_blocks=15) for p in "fgh"]
    assert decide(half, "b", 1.0, 15, 30, Span(15, 30)).span == Span(0, 15)
    assert decide(half, "b", 1.0, 15, 30, Span(15, 30), near={"a"}) is None
    # a peer of a region that holds [0:15) only moves to the blocks it lacks, within its share of the region
    eu = [Server("a", Span(0, 15), 1 / 15, max_blocks=15), Server("b", Span(0, 15), 1 / 15, max_blocks=15)]
    assert decide(half[1:] + eu, "e", 1.0, 15, 30, Span(0, 15), near={"b"}).span == Span(15, 30)
    three = decide(half[1:] + eu, "e", 1.0, 15, 30, Span(0, 15), near={"a", "b"})  # a share of 10 blocks in 3
    assert three.span == Span(15, 25) and three.local == 5


@pytest.mark.parametrize("seed", range(40))
def test_peers_in_regions_settle_whatever_their_speeds_and_memory(seed):
    # near is mutual (a fixed cut on round trips): peers of unequal speed and memory, in 2 or 3 regions,
    # joining in a random order, stop moving within a few rounds
    import random

    rng = random.Random(seed)
    blocks = rng.choice([8, 12, 30])
    peers = [(f"p{i}", rng.choice("abc"[:rng.choice([2, 3])]), rng.choice([10.0, 20.0, 40.0]),
              rng.randint(max(1, blocks // 4), blocks)) for i in range(rng.randint(3, 8))]
    swarm: dict[str, Server] = {}
    for name, where, speed, memory in peers:
        near = {p for p, w, _, _ in peers if w == where and p in swarm}
        span = plan(list(swarm.values()), name, speed, memory, blocks, near).span
        swarm[name] = Server(name, span, speed / len(span), max_blocks=memory)
    for _ in range(12):
        moved = False
        for name, where, speed, memory in peers:
            near = {p for p, w, _, _ in peers if w == where and p != name}
            to = decide(list(swarm.values()), name, speed, memory, blocks, swarm[name].span, near=near)
            if to is not None:
                swarm[name] = Server(name, to.span, speed / len(to.span), max_blocks=memory)
                moved = True
        if not moved:
            return
    raise AssertionError(f"still moving after 12 rounds: {peers} {swarm}")
