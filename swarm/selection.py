"""Which blocks a new peer should serve: a pure function of what the swarm already serves.

The rule: take the window of `n` consecutive blocks whose weakest block is served least; among equal
windows, the one with the least total service; then the lowest start. Service counts every peer that
announced itself joining or online for a block (a joining peer will serve it soon, so a second peer
started right after it goes elsewhere). Deterministic, so peers started one after another with no
flags cover the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from swarm.records import Announcement
from swarm.span import Span


def coverage(num_blocks: int, announcements: Mapping[int, Iterable[Announcement]], exclude: str | None = None,
             now: float | None = None) -> list[int]:
    """How many distinct peers serve (or are about to serve) each block."""
    counts = [0] * num_blocks
    for block, anns in announcements.items():
        if 0 <= block < num_blocks:
            counts[block] = len({a.peer for a in anns if a.state in ("joining", "online") and a.peer != exclude})
    return counts


def choose_span(counts: list[int], n: int) -> Span:
    """The best window of `n` blocks given per-block service counts (see the module docstring)."""
    total = len(counts)
    if not 1 <= n <= total:
        raise ValueError(f"cannot choose {n} blocks out of {total}")
    best = min(range(total - n + 1), key=lambda s: (min(counts[s:s + n]), sum(counts[s:s + n]), s))
    return Span(best, best + n)


def blocks_for_budget(memory_budget: int, block_bytes: int, cache_bytes_per_block: int, num_blocks: int) -> int:
    """How many blocks fit in `memory_budget` bytes, each with its weights and its share of the cache."""
    per_block = block_bytes + cache_bytes_per_block
    n = memory_budget // per_block
    if n < 1:
        raise ValueError(f"a memory budget of {memory_budget} bytes cannot hold one block ({per_block} bytes "
                         "with its cache); raise the budget or lower --cache-tokens")
    return int(min(n, num_blocks))
