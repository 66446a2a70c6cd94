"""`SpanCache.fork`: a fork at a position runs on exactly as the original would have from there (bit for bit: it
is compared with a twin cache that ran the same steps and rolled back to that position); it holds the source's
full attention blocks by reference (memory for the prefix once, whatever the number of forks) and copies only
the last partial one; and the two diverge without changing each other: the source goes on stepping and rolls
back over the shared blocks (which it then copies before writing), the fork is not moved. Recurrent states are
copied, never shared."""

from __future__ import annotations

import os

import pytest
import torch

from swarm.errors import BadRequest
from swarm.model.blocks import SpanBlocks
from swarm.model.cache import SpanCache
from swarm.model.kv import MappedRows
from swarm.span import Span

pytestmark = pytest.mark.models

BATCH, MAX_LENGTH = 2, 96
PREFIX = (5, 3, 1, 1)  # the source's steps: a chunked prefill, then two decode steps (ends at 5, 8, 9, 10)


def hidden(blocks: SpanBlocks, tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(BATCH, tokens, blocks.hidden_size, generator=torch.Generator().manual_seed(seed))


def run_prefix(blocks: SpanBlocks, span: Span, steps=PREFIX) -> SpanCache:
    cache, position = blocks.new_cache(BATCH, MAX_LENGTH, span), 0
    for i, tokens in enumerate(steps):
        blocks(hidden(blocks, tokens, i), cache, position)
        position += tokens
    return cache


def state_tensors(cache: SpanCache) -> list[torch.Tensor]:
    found = [t for layer in cache.stateful for states in (layer.conv_states, layer.recurrent_states)
             for t in states.values()]
    found += [t for snap in cache.snapshots.values() for state in snap
              for states in (state["conv_states"], state["recurrent_states"]) for t in states.values()]
    return [t for t in found if isinstance(t, torch.Tensor) and t.numel()]


@torch.inference_mode()
def check_fork(blocks: SpanBlocks, span: Span, length: int) -> None:
    source = run_prefix(blocks, span)
    fork = source.fork(length)
    assert fork.length == length and fork.span == span
    assert sorted(fork.snapshots) == [p for p in sorted(source.snapshots) if p <= length]
    shared = {t.untyped_storage().data_ptr() for t in state_tensors(source)}
    assert not shared & {t.untyped_storage().data_ptr() for t in state_tensors(fork)}, "the fork shares states"

    twin = run_prefix(blocks, span)  # the same steps; the step below rolls it back to `length` first
    nxt = hidden(blocks, 2, 100)
    assert torch.equal(blocks(nxt, fork, length), blocks(nxt, twin, length))

    # the source goes on: steps, rolls back to 0 (over the blocks it shares), steps again; the fork is not moved
    blocks(hidden(blocks, 3, 200), source, source.length)
    blocks(hidden(blocks, 4, 201), source, 0)
    after = hidden(blocks, 1, 300)
    assert torch.equal(blocks(after, fork, length + 2), blocks(after, twin, length + 2))
    assert fork.length == twin.length == length + 3


@pytest.fixture(scope="module")
def attention(tiny_checkpoint):
    return SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))


@pytest.mark.parametrize("span, length", [(Span(0, 6), 10), (Span(0, 6), 8), (Span(0, 6), 6), (Span(2, 5), 1)])
def test_an_attention_fork_runs_on_as_the_original(attention, span, length):
    check_fork(attention, span, length)


@pytest.fixture(scope="module", params=["granitemoehybrid", "falcon_h1"])
def recurrent(request, tmp_path_factory):
    """Blocks with recurrent and attention layers: alternating (granitemoehybrid), or both in every layer
    (falcon_h1)."""
    from family_harness import build

    return SpanBlocks(build(request.param, tmp_path_factory.mktemp(request.param) / "ckpt"), Span(0, 6))


@pytest.mark.parametrize("length", [10, 5])  # the current length, the end of an earlier step (a snapshot)
def test_a_recurrent_fork_runs_on_as_the_original(recurrent, length):
    check_fork(recurrent, Span(0, 6), length)


@torch.inference_mode()
def test_a_fork_past_the_end_or_between_recurrent_snapshots_is_refused(attention, recurrent):
    with pytest.raises(BadRequest, match="holds 10"):
        run_prefix(attention, Span(0, 6)).fork(11)
    cache = run_prefix(recurrent, Span(0, 6))
    with pytest.raises(BadRequest, match="recurrent state is kept only at"):
        cache.fork(6)  # inside the 3-token step from 5 to 8: no state was kept there
    assert cache.fork(0).length == 0 and cache.length == 10


def resident(pool) -> int:
    """Bytes of memory the pool's file holds (pages written and not given back)."""
    return os.fstat(pool.fd).st_blocks * 512


@torch.inference_mode()
def test_forks_hold_the_prefix_once_and_copy_only_its_last_partial_block(tiny_checkpoint):
    blocks = SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))
    pool = blocks.pool
    if not pool.mapped:
        # runs wherever the suite runs (Linux, CPU); elsewhere the pool keeps a tensor per block and forks copy,
        # which the fork tests above cover
        pytest.skip("this pool keeps a tensor per block (not Linux, or not a CPU): its forks copy, they share "
                    "no block")
    block = pool.block_tokens
    prefix = 3 * block + 5  # three full blocks and a partial one per row
    source = run_prefix(blocks, Span(0, 6), steps=(prefix,))
    assert isinstance(source.rows, MappedRows) and pool.used == BATCH * 4
    before = resident(pool)
    partial = before - BATCH * 3 * pool.block_bytes  # the pages the partial blocks' tokens were written to
    assert 0 < partial < BATCH * pool.block_bytes
    forks = [source.fork(prefix) for _ in range(8)]
    # each fork maps the source's three full blocks and holds one block of its own: the partial one, copied
    for fork in forks:
        assert [t[:3] for t in fork.rows.tables] == [t[:3] for t in source.rows.tables]
        assert all(len(t) == 4 and t[3] not in source.rows.tables[r] for r, t in enumerate(fork.rows.tables))
    assert pool.used == BATCH * (4 + 8)
    assert resident(pool) == before + 8 * partial  # 8 copies of the partial blocks' pages, no prefix again
    # each diverges on its own; the source's blocks hold what they held
    keys = [layer.keys.clone() for layer in source.attention]
    for i, fork in enumerate(forks):
        blocks(hidden(blocks, 20, 400 + i), fork, prefix)  # past the partial block: a new block each
    assert all(torch.equal(layer.keys, k) for layer, k in zip(source.attention, keys))
    assert all(torch.equal(f.attention[0].keys[..., :prefix, :], keys[0]) for f in forks)
    for cache in (source, *forks):
        cache.release()
    assert (pool.used, pool.reserved, resident(pool)) == (0, 0, 0)  # every block back, its memory too


@torch.inference_mode()
def test_a_write_into_a_shared_block_copies_it_first(tiny_checkpoint):
    blocks = SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))
    pool = blocks.pool
    source = run_prefix(blocks, Span(0, 6), steps=(2 * pool.block_tokens,))
    fork = source.fork(2 * pool.block_tokens)
    shared = [list(t) for t in source.rows.tables]
    keys = fork.attention[0].keys.clone()
    blocks(hidden(blocks, 3, 500), source, pool.block_tokens + 1)  # back into the second block, and on
    if pool.mapped:
        assert [t[0] for t in source.rows.tables] == [t[0] for t in shared]  # the first block still shared
        assert all(t[1] != s[1] for t, s in zip(source.rows.tables, shared))  # the second copied before written
        assert fork.rows.tables == shared
    assert torch.equal(fork.attention[0].keys, keys)


@torch.inference_mode()
def test_a_block_that_cannot_be_mapped_leaves_the_cache_as_it_was(tiny_checkpoint, monkeypatch):
    blocks = SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))
    pool = blocks.pool
    if not pool.mapped:
        # runs wherever the suite runs (Linux, CPU); a tensor pool maps nothing, so nothing can fail to map
        pytest.skip("this pool keeps a tensor per block (not Linux, or not a CPU): it maps no page that could fail")
    source = run_prefix(blocks, Span(0, 6), steps=(2 * pool.block_tokens,))
    fork = source.fork(2 * pool.block_tokens)
    tables, used, reserved = [list(t) for t in source.rows.tables], pool.used, pool.reserved
    keys = source.attention[0].keys.clone()
    real, calls = type(source.rows)._place, []

    def failing(self, row, index, copy_of):
        calls.append(index)
        if len(calls) == 2:
            raise OSError("no room for another mapping")
        return real(self, row, index, copy_of)

    monkeypatch.setattr(type(source.rows), "_place", failing)
    with pytest.raises(OSError):  # back into the shared first block (a copy), and on past the second
        blocks(hidden(blocks, 2 * pool.block_tokens, 600), source, pool.block_tokens - 2)
    monkeypatch.undo()
    assert source.rows.tables == tables and (pool.used, pool.reserved) == (used, reserved)
    back = pool.block_tokens - 2  # the step rolled the cache back first, as any step at a lower position does
    assert source.length == back and torch.equal(source.attention[0].keys, keys[..., :back, :])
    assert torch.equal(fork.attention[0].keys, keys)
    blocks(hidden(blocks, 1, 601), source, source.length)  # and it goes on
