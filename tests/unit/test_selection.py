"""How many blocks fit in a memory budget (where they go: test_placement.py)."""

from __future__ import annotations

import pytest

from peer.selection import blocks_for_budget

pytestmark = pytest.mark.unit


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
