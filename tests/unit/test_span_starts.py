"""Spans start only where a span of the model may start (`swarm.span.span_starts`): HY v4's and GLM's "shared"
blocks take the previous block's indexer choice inside the family's layer loop, so no span starts there. Every
place that chooses spans keeps to it: a local chain's split, a peer's placement and its --blocks, a client's
route. A model whose every block is a start is split, placed and routed exactly as without starts."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from client.inference.routing import Bans, Hop, Measurements, Offer, find_route
from peer import placement
from peer.config import PeerConfig
from peer.server import first_span
from swarm.errors import BadRequest, NoRoute
from swarm.net.view import Server
from swarm.span import Span, check_start, span_starts, split_evenly

pytestmark = pytest.mark.unit

HY = AutoConfig.for_model("hy_v4", num_hidden_layers=14)  # its default: blocks 2-4, 6-8, 10-12 are "shared"
HY_STARTS = (0, 1, 5, 9, 13)


def allowed_end(span: Span, starts, total: int) -> bool:
    return span.end == total or span.end in starts


def test_span_starts_reads_the_indexer_types_of_the_config():
    assert span_starts(HY) == HY_STARTS
    glm = AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=6, indexer_types=["full", "shared"] * 3)
    assert span_starts(glm) == (0, 2, 4)
    assert span_starts(AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=6)) == tuple(range(6))  # all "full"
    assert span_starts(AutoConfig.for_model("llama", num_hidden_layers=5)) == tuple(range(5))
    assert span_starts(SimpleNamespace(num_hidden_layers=3)) == (0, 1, 2)


@pytest.mark.parametrize("blocks,parts", [(30, 3), (6, 3), (7, 3), (5, 5), (16, 1), (14, 4)])
def test_a_split_with_every_block_a_start_is_the_even_split(blocks, parts):
    assert split_evenly(blocks, parts, tuple(range(blocks))) == split_evenly(blocks, parts)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_a_split_cuts_only_at_starts(parts):
    spans = split_evenly(14, parts, HY_STARTS)
    assert [b for s in spans for b in s] == list(range(14))
    assert all(s.start in HY_STARTS for s in spans)
    assert split_evenly(14, 3, HY_STARTS) == [Span(0, 5), Span(5, 9), Span(9, 14)]  # the even cuts 5 and 9


def test_a_split_into_more_spans_than_starts_is_refused():
    with pytest.raises(BadRequest, match=r"\[0, 1, 5, 9, 13\]"):
        split_evenly(14, 6, HY_STARTS)


def test_check_start_names_the_starts():
    check_start(Span(5, 9), HY_STARTS, 14)
    check_start(Span(9, 14), HY_STARTS, 14)
    with pytest.raises(BadRequest, match=r"start at block 2.*one of the blocks \[0, 1, 5, 9, 13\]"):
        check_start(Span(2, 5), HY_STARTS, 14)
    with pytest.raises(BadRequest, match=r"end before block 7.*one of the blocks \[0, 1, 5, 9, 13\] or at the "
                                         r"model's end 14"):
        check_start(Span(5, 7), HY_STARTS, 14)
    with pytest.raises(BadRequest, match="outside"):
        check_start(Span(9, 15), HY_STARTS, 14)
    check_start(Span(5, 7), HY_STARTS)  # a sub-span run by a peer: only its start matters


def test_explicit_blocks_starting_or_ending_where_no_span_may_are_refused_naming_the_starts():
    def first(blocks: str):
        config = PeerConfig(model=Path("m"), blocks=Span.parse(blocks))
        return first_span(config, [], "me", 10.0, 14, 14, None, HY_STARTS)

    assert first("5:9").span == Span(5, 9)
    with pytest.raises(BadRequest, match=r"one of the blocks \[0, 1, 5, 9, 13\]"):
        first("2:9")
    with pytest.raises(BadRequest, match=r"one of the blocks \[0, 1, 5, 9, 13\] or at the model's end 14"):
        first("1:4")
    assert first_span(PeerConfig(model=Path("m")), [], "me", 10.0, 4, 14, None, HY_STARTS).span.start in HY_STARTS


def random_caps(rng: random.Random, total: int) -> list[float]:
    return [0.0 if rng.random() < 0.3 else rng.uniform(0.1, 10.0) for _ in range(total)]


@pytest.mark.parametrize("seed", range(40))
def test_placement_starts_and_ends_spans_only_where_a_span_may_start(seed):
    rng = random.Random(seed)
    total = 14
    caps = random_caps(rng, total)
    speed, memory = rng.uniform(0.5, 20.0), rng.randint(1, total)
    prefer = rng.choice([None, rng.randint(1, memory)])
    min_blocks = rng.choice([1, memory])
    local = rng.choice([None, random_caps(rng, total)])
    best = placement.best_span(caps, speed, memory, prefer, min_blocks, local, HY_STARTS)
    assert best.span.start in HY_STARTS
    fits = any(allowed_end(Span(s, s + n), HY_STARTS, total) for s in HY_STARTS
               for n in range(min(min_blocks, memory), memory + 1) if s + n <= total)
    assert allowed_end(best.span, HY_STARTS, total) or not fits
    # with every block a start, exactly what it chooses without starts
    assert placement.best_span(caps, speed, memory, prefer, min_blocks, local, range(total)) == \
        placement.best_span(caps, speed, memory, prefer, min_blocks, local)


def test_peers_joining_and_rebalancing_serve_spans_a_route_can_use():
    """Peers with room for 3 blocks of HY (whose starts are 4 blocks apart) serve [0:1) or the last span, never
    blocks past a start that no route could reach; peers with room for 4 or more cover the model."""
    total, swarm = 14, []
    for i, memory in enumerate([3, 6, 6, 4, 5, 3]):
        span = placement.plan(swarm, f"p{i}", 1.0 + i, memory, total, starts=HY_STARTS).span
        assert span.start in HY_STARTS and allowed_end(span, HY_STARTS, total), span
        swarm.append(Server(f"p{i}", span, (1.0 + i) / len(span), max_blocks=memory))
    for _ in range(10):  # bounded rebalancing rounds
        moved = False
        for i, server in enumerate(list(swarm)):
            move = placement.decide(swarm, server.peer, 1.0 + i, server.max_blocks, total, server.span,
                                    starts=HY_STARTS)
            if move is not None:
                assert move.span.start in HY_STARTS and allowed_end(move.span, HY_STARTS, total), move
                swarm[i] = Server(server.peer, move.span, (1.0 + i) / len(move.span), max_blocks=server.max_blocks)
                moved = True
        if not moved:
            break
    assert not placement.holes(placement.capacities(total, swarm))
    offers = [Offer(s.peer, s.span) for s in swarm]
    hops = find_route(offers, Span(0, total), Measurements(), Bans(), starts=HY_STARTS)
    assert all(h.span.start in HY_STARTS for h in hops)


def measured(**figures: tuple[float, float, int]) -> Measurements:
    m = Measurements()
    for peer, (delay, block, blocks) in figures.items():
        m.step(peer, rtt_ms=delay + block * blocks, compute_ms=block * blocks, tokens=1, blocks=blocks)
    return m


def test_a_route_cuts_between_peers_only_where_a_span_may_start():
    """A fast peer on [0:4) and a slow one on [1:14): unconstrained, the fast one serves all its blocks and the slow
    one the rest from block 4; with HY's starts no hop starts at 4 (nor at 2 or 3), so the cut falls at block 1."""
    offers = [Offer("fast", Span(0, 4)), Offer("slow", Span(1, 14))]
    m = measured(fast=(1.0, 1.0, 4), slow=(1.0, 50.0, 13))
    assert find_route(offers, Span(0, 14), m, Bans()) == [Hop("fast", Span(0, 4)), Hop("slow", Span(4, 14))]
    assert find_route(offers, Span(0, 14), m, Bans(), starts=HY_STARTS) == \
        [Hop("fast", Span(0, 1)), Hop("slow", Span(1, 14))]


def test_blocks_served_but_not_by_spans_a_route_can_cut_between_is_no_route():
    """Every block is served, but by a peer whose span starts where no span may (one that read the model otherwise):
    no chain cuts only at starts, so no route, naming the blocks past the last start it reached."""
    offers = [Offer("a", Span(0, 4)), Offer("b", Span(4, 14))]
    assert [h.peer for h in find_route(offers, Span(0, 14), Measurements(), Bans())] == ["a", "b"]
    with pytest.raises(NoRoute, match=r"blocks \[1:14\) of the model cutting between peers only where a span may "
                                      r"start \(blocks \[0:2\), \[5:6\), \[9:10\), \[13:14\)\)") as info:
        find_route(offers, Span(0, 14), Measurements(), Bans(), starts=HY_STARTS)
    assert info.value.missing == tuple(range(1, 14))
    hops = find_route(offers + [Offer("c", Span(1, 5))], Span(0, 14), Measurements(), Bans(), starts=HY_STARTS)
    assert hops == [Hop("a", Span(0, 1)), Hop("c", Span(1, 5)), Hop("b", Span(5, 14))]


@pytest.mark.parametrize("seed", range(30))
def test_routes_over_random_swarms_start_every_hop_at_a_start(seed):
    rng = random.Random(seed)
    total, cuts = 14, list(HY_STARTS) + [14]
    offers = [Offer(f"full{i}", Span(0, total)) for i in range(rng.randint(0, 1))]
    for i in range(rng.randint(3, 9)):
        a = rng.randrange(len(cuts) - 1)
        b = rng.randrange(a + 1, len(cuts))
        offers.append(Offer(f"p{i}", Span(cuts[a], cuts[b])))
    offers += [Offer("first", Span(0, 5)), Offer("rest", Span(5, 14))]
    m = measured(**{o.peer: (rng.uniform(1, 50), rng.uniform(1, 20), len(o.span)) for o in offers})
    hops = find_route(offers, Span(0, total), m, Bans(), starts=HY_STARTS)
    assert all(h.span.start in HY_STARTS for h in hops)
    assert [b for h in hops for b in h.span] == list(range(total))
    # with every block a start, exactly the route without starts
    assert find_route(offers, Span(0, total), m, Bans(), starts=range(total)) == \
        find_route(offers, Span(0, total), m, Bans())
