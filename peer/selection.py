"""How many blocks fit in a peer's memory budget: pure. Where they go is `peer.placement`'s."""

from __future__ import annotations


def blocks_for_budget(memory_budget: int, block_bytes: int, cache_bytes_per_block: int, num_blocks: int) -> int:
    """How many blocks fit in `memory_budget` bytes, each with its weights and its share of the cache."""
    per_block = block_bytes + cache_bytes_per_block
    n = memory_budget // per_block
    if n < 1:
        raise ValueError(f"a memory budget of {memory_budget} bytes cannot hold one block ({per_block} bytes "
                         "with its cache); raise the budget or lower --cache-tokens")
    return int(min(n, num_blocks))
