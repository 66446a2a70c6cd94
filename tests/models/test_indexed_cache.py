"""Indexed attention (dynamic sparse attention: an indexer picks the past tokens each query attends to) in our
cache: the indexer's keys are one more part of a session's pooled rows, so a rollback, a fork, a copy and a
failover replay each give transformers' own logits for the sequence they end up holding. The tiny models keep
3 tokens per query (`family_harness.OVERRIDES`), so wrong indexer keys choose other tokens and change the logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.inference.local_chain import LocalChain, LocalSession
from swarm.errors import BadRequest
from swarm.model.blocks import SpanBlocks
from swarm.span import Span, split_evenly

pytestmark = pytest.mark.models

TOLERANCE = 1e-4
TOKENS = [[11, 42, 7, 99, 23, 5, 64, 18, 31, 77, 50, 9]]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def model(request, tmp_path_factory):
    """(checkpoint, transformers' model, our chain of three spans) of a tiny indexed model."""
    from family_harness import build

    path = build(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference, LocalChain(path, split_evenly(6, 3))


def expected(reference, ids: list[int], start: int) -> torch.Tensor:
    """Transformers' logits for positions [start, len(ids)) of a whole forward over `ids` (no cache)."""
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[:, start:]


def steps(session: LocalSession, ids: list[int], start: int, chunks=(1,)) -> torch.Tensor:
    """Logits of `ids[start:]` fed to `session` from `start`, in chunks of the given sizes (the last repeated)."""
    out, position, i = [], start, 0
    while position < len(ids):
        n = min(chunks[min(i, len(chunks) - 1)], len(ids) - position)
        out.append(session.step(torch.tensor([ids[position:position + n]]), position))
        position, i = position + n, i + 1
    return torch.cat(out, dim=1)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.shape == theirs.shape and (ours - theirs).abs().max().item() <= TOLERANCE


def test_the_indexer_keys_are_a_part_of_the_rows(model):
    path, _, chain = model
    blocks = chain.blocks[1]
    layout = blocks.kv_layout
    indexed = [p for p in layout.parts if p.name == "indexer"]
    width = blocks.config.index_head_dim
    kinds = getattr(blocks.config, "indexer_types", None) or ["full"] * blocks.num_blocks
    assert [p.layer for p in indexed] == [i for i in blocks.span if kinds[i] == "full"]  # "shared": no indexer
    assert all((p.key_heads, p.key_dim, p.value_heads, p.value_dim) == (1, width, 0, 0) for p in indexed)
    kv = sum(p.key_heads * p.key_dim + p.value_heads * p.value_dim for p in layout.parts if p.name == "kv")
    assert layout.token_elements == kv + len(indexed) * width  # memory is counted for them like keys and values
    cache = blocks.new_cache(1, 32)
    blocks(torch.randn(1, 5, blocks.hidden_size), cache, 0)
    layer = cache.own[0]
    assert layer.indexer_keys.shape == (1, 5, width) and layer.keys.shape[-2] == 5


def test_a_rollback_then_another_continuation_is_transformers(model):
    _, reference, chain = model
    session = chain.session(1, 32)
    ids = TOKENS[0]
    first = steps(session, ids[:10], 0, chunks=(5, 3, 1))
    assert close(first, expected(reference, ids[:10], 0))
    other = ids[:6] + [3, 4, 5, 6]
    assert close(steps(session, other, 6, chunks=(2, 1)), expected(reference, other, 6))
    assert close(steps(session, other[:4] + [8], 4), expected(reference, other[:4] + [8], 4))  # back again


def test_a_fork_at_a_shorter_length_runs_on_as_transformers(model):
    _, reference, chain = model
    ids = TOKENS[0]
    source = chain.session(1, 32)
    steps(source, ids[:10], 0, chunks=(5, 3, 1))
    fork = LocalSession(chain, [cache.fork(6) for cache in source.caches])
    assert fork.position == 6 and source.position == 10
    other = ids[:6] + [40, 41, 42]
    assert close(steps(fork, other, 6), expected(reference, other, 6))
    assert close(steps(source, ids, 10), expected(reference, ids, 10))  # the source is not moved by the fork


def test_a_copy_runs_on_alone_and_leaves_its_source_alone(model):
    _, reference, chain = model
    ids = TOKENS[0]
    source = chain.session(1, 32)
    steps(source, ids[:9], 0, chunks=(5, 4))
    copy = LocalSession(chain, [cache.fork(9) for cache in source.caches])
    mine = ids[:9] + [60, 61, 62]
    assert close(steps(copy, mine, 9, chunks=(2, 1)), expected(reference, mine, 9))
    assert close(steps(source, ids, 9), expected(reference, ids, 9))
    assert close(steps(copy, mine[:7] + [63], 7), expected(reference, mine[:7] + [63], 7))  # rolled back over both


@torch.inference_mode()
def test_a_failover_replay_on_other_blocks_gives_the_same_logits(model):
    path, reference, chain = model
    ids = TOKENS[0]
    session = chain.session(1, 32)
    steps(session, ids[:8], 0, chunks=(5, 2, 1))
    other = LocalChain(path, [Span(0, 4), Span(4, 6)])  # another placement, fresh caches: the history replayed
    replay = other.session(1, 32)
    replay.step(torch.tensor([ids[:8]]), 0)
    went_on, replayed = steps(session, ids, 8), steps(replay, ids, 8)
    assert close(replayed, went_on) and close(replayed, expected(reference, ids, 8))


@torch.inference_mode()
def test_a_span_replays_its_own_inputs_on_other_blocks(model):
    path, _, chain = model
    blocks, span = chain.blocks[1], chain.blocks[1].span
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, n, blocks.hidden_size, generator=g) for n in (4, 1, 1)]
    cache, position = blocks.new_cache(1, 32), 0
    for x in inputs:
        blocks(x, cache, position)
        position += x.shape[1]
    fresh = SpanBlocks(path, span)
    again = fresh.new_cache(1, 32)
    fresh(torch.cat(inputs, dim=1), again, 0)
    nxt = torch.randn(1, 1, blocks.hidden_size, generator=g)
    assert close(fresh(nxt, again, position), blocks(nxt, cache, position))


@torch.inference_mode()
def test_batched_steps_run_one_at_a_time_with_the_numbers_of_steps_alone(model):
    _, _, chain = model
    blocks = chain.blocks[0]
    g = torch.Generator().manual_seed(5)
    pairs = [(blocks.new_cache(1, 32), blocks.new_cache(1, 32)) for _ in (2, 7)]
    for (a, b), n in zip(pairs, (2, 7)):
        x = torch.randn(1, n, blocks.hidden_size, generator=g)
        blocks(x, a, 0)
        blocks(x, b, 0)
    xs = [torch.randn(1, 1, blocks.hidden_size, generator=g) for _ in pairs]
    alone = [blocks(x, a, a.length) for x, (a, _) in zip(xs, pairs)]
    batched = blocks.decode_batch([(b, x, None) for x, (_, b) in zip(xs, pairs)])
    assert not blocks.ragged  # an indexer scores its cached keys itself: no ragged batch
    assert all(torch.equal(o, e) for o, e in zip(batched, alone))
    assert [b.length for _, b in pairs] == [3, 8]


@torch.inference_mode()
def test_indexer_positions_kept_on_the_cache_follow_rollbacks_and_forks(model):
    _, _, chain = model
    blocks = chain.blocks[1]
    cache = blocks.new_cache(1, 32)
    blocks(torch.randn(1, 10, blocks.hidden_size), cache, 0)
    entry = cache.kv.layers[0]  # the entry a family keeps its indexers' positions on (outside this span here)
    entry.indexer_position_ids = torch.arange(10).view(1, 1, 10).expand(3, 1, 10)
    cache.rollback(6)
    assert torch.equal(entry.indexer_position_ids, torch.arange(6).view(1, 1, 6).expand(3, 1, 6))
    fork = cache.fork(4)
    theirs = fork.kv.layers[0].indexer_position_ids
    assert torch.equal(theirs, torch.arange(4).view(1, 1, 4).expand(3, 1, 4))
    entry.indexer_position_ids = torch.zeros(3, 1, 6, dtype=torch.long)
    assert torch.equal(fork.kv.layers[0].indexer_position_ids, theirs)  # not shared with the source


def test_a_span_starting_at_a_block_that_reuses_the_previous_choice_is_refused(model):
    """A span may start at a block that runs its own indexer (every block of DeepSeek-V3.2), never at one that
    reuses the previous block's choice (GLM's "shared" blocks here)."""
    path, _, chain = model
    kinds = getattr(chain.blocks[0].config, "indexer_types", None)
    if not kinds or "shared" not in kinds:
        assert SpanBlocks(path, Span(1, 6)).starts == tuple(range(6))
        return
    start = kinds.index("shared")
    with pytest.raises(BadRequest, match="takes what block"):
        SpanBlocks(path, Span(start, 6))
    with pytest.raises(BadRequest, match="takes what block"):
        chain.blocks[0](torch.randn(1, 1, chain.blocks[0].hidden_size), span=Span(start, chain.blocks[0].span.end))
