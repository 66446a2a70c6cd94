"""Block selection: which span a new peer serves, from what the swarm already serves."""

from __future__ import annotations

import pytest

from swarm.records import Announcement
from swarm.selection import blocks_for_budget, choose_span, coverage
from swarm.span import Span

pytestmark = pytest.mark.unit


def ann(peer: str, start: int, end: int, state: str = "online") -> Announcement:
    return Announcement(peer=peer, model="m", start=start, end=end, state=state, throughput=1.0, prefill_tps=1.0,
                        cache_tokens_left=100, version="0.1.0", seq=1, issued_at=0.0)


def by_block(*anns: Announcement) -> dict[int, list[Announcement]]:
    """What a DHT lookup returns: the announcements found under each block's key."""
    out: dict[int, list[Announcement]] = {}
    for a in anns:
        for block in a.span:
            out.setdefault(block, []).append(a)
    return out


@pytest.mark.parametrize("counts,n,expected", [
    ([0, 0, 0, 0], 2, Span(0, 2)),  # all equal: lowest start
    ([1, 1, 0, 0, 1, 1], 2, Span(2, 4)),  # the unserved window
    ([0, 5, 5, 1, 1, 1], 2, Span(0, 2)),  # the weakest block decides before the total
    ([0, 3, 0, 1, 2], 2, Span(2, 4)),  # equal weakest block: least total
    ([2, 0, 1, 0, 1, 3], 2, Span(1, 3)),  # equal weakest and total: lowest start
    ([3, 3, 3], 3, Span(0, 3)),  # the whole model
    ([4, 2, 7], 1, Span(1, 2)),
])
def test_choose_span(counts, n, expected):
    assert choose_span(counts, n) == expected
    assert choose_span(list(counts), n) == expected  # a pure function of its input


def test_peers_started_one_after_another_cover_the_model():
    swarm: list[Announcement] = []
    for i in range(3):
        span = choose_span(coverage(6, by_block(*swarm)), 2)
        swarm.append(ann(f"peer{i}", span.start, span.end, state="joining"))
    assert [a.span for a in swarm] == [Span(0, 2), Span(2, 4), Span(4, 6)]
    assert coverage(6, by_block(*swarm)) == [1] * 6
    # a fourth peer doubles up the first blocks
    assert choose_span(coverage(6, by_block(*swarm)), 2) == Span(0, 2)


@pytest.mark.parametrize("counts,n", [([0] * 6, 0), ([0] * 6, 7), ([0] * 6, -1), ([], 1)])
def test_choose_span_rejects_impossible_sizes(counts, n):
    with pytest.raises(ValueError, match=f"cannot choose {n} blocks"):
        choose_span(counts, n)


def test_coverage_counts_distinct_serving_peers():
    anns = by_block(ann("a", 0, 3), ann("b", 1, 2, state="joining"), ann("c", 0, 4, state="offline"),
                    ann("me", 2, 4), ann("d", 3, 6))
    anns[0].append(ann("a", 0, 1))  # the same peer found twice under one key counts once
    anns[-1] = [ann("x", 0, 1)]  # keys outside the model are ignored
    anns[9] = [ann("x", 9, 10)]
    assert coverage(4, anns, exclude="me") == [1, 2, 1, 1]
    assert coverage(4, anns) == [1, 2, 2, 2]
    assert coverage(4, {}) == [0, 0, 0, 0]


@pytest.mark.parametrize("budget,block,cache,num_blocks,expected", [
    (1000, 90, 10, 50, 10),
    (1099, 90, 10, 50, 10),  # floor division
    (100, 90, 10, 50, 1),
    (10**9, 90, 10, 16, 16),  # clamped to the model
])
def test_blocks_for_budget(budget, block, cache, num_blocks, expected):
    assert blocks_for_budget(budget, block, cache, num_blocks) == expected


def test_budget_below_one_block_says_what_to_do():
    with pytest.raises(ValueError, match="cannot hold one block .100 bytes") as info:
        blocks_for_budget(99, 90, 10, 16)
    assert "raise the budget" in str(info.value)
