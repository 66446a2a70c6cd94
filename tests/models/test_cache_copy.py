"""`SpanCache.copy`: a copy at a position runs on exactly as the original would have from there (bit for bit:
it is compared with a twin cache that ran the same steps and rolled back to that position), and it shares
nothing with the original, which goes on stepping and rolling back without changing the copy."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import BadRequest
from swarm.model.blocks import SpanBlocks
from swarm.model.cache import SpanCache
from swarm.span import Span

pytestmark = pytest.mark.models

BATCH, MAX_LENGTH = 2, 32
PREFIX = (5, 3, 1, 1)  # the source's steps: a chunked prefill, then two decode steps (ends at 5, 8, 9, 10)


def hidden(blocks: SpanBlocks, tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(BATCH, tokens, blocks.hidden_size, generator=torch.Generator().manual_seed(seed))


def run_prefix(blocks: SpanBlocks, span: Span) -> SpanCache:
    cache, position = blocks.new_cache(BATCH, MAX_LENGTH, span), 0
    for i, tokens in enumerate(PREFIX):
        blocks(hidden(blocks, tokens, i), cache, position)
        position += tokens
    return cache


def tensors(cache: SpanCache) -> list[torch.Tensor]:
    found = [t for layer in cache.own for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    found += [t for layer in cache.stateful for states in (layer.conv_states, layer.recurrent_states)
              for t in states.values()]
    found += [t for snap in cache.snapshots.values() for state in snap
              for states in (state["conv_states"], state["recurrent_states"]) for t in states.values()]
    return [t for t in found if isinstance(t, torch.Tensor) and t.numel()]


@torch.inference_mode()
def check_copy(blocks: SpanBlocks, span: Span, length: int) -> None:
    source = run_prefix(blocks, span)
    copy = source.fork(length)
    assert copy.length == length and copy.span == span
    assert sorted(copy.snapshots) == [p for p in sorted(source.snapshots) if p <= length]
    shared = {t.untyped_storage().data_ptr() for t in tensors(source)}
    assert not shared & {t.untyped_storage().data_ptr() for t in tensors(copy)}, "the copy shares tensors"

    twin = run_prefix(blocks, span)  # the same steps; the step below rolls it back to `length` first
    nxt = hidden(blocks, 2, 100)
    assert torch.equal(blocks(nxt, copy, length), blocks(nxt, twin, length))

    # the source goes on: steps, rolls back to 0, steps again; the copy is not moved by any of it
    blocks(hidden(blocks, 3, 200), source, source.length)
    blocks(hidden(blocks, 4, 201), source, 0)
    after = hidden(blocks, 1, 300)
    assert torch.equal(blocks(after, copy, length + 2), blocks(after, twin, length + 2))
    assert copy.length == twin.length == length + 3


@pytest.fixture(scope="module")
def attention(tiny_checkpoint):
    return SpanBlocks(tiny_checkpoint("llama"), Span(0, 6))


@pytest.mark.parametrize("span, length", [(Span(0, 6), 10), (Span(0, 6), 8), (Span(0, 6), 6), (Span(2, 5), 1)])
def test_an_attention_copy_runs_on_as_the_original(attention, span, length):
    check_copy(attention, span, length)


@pytest.fixture(scope="module", params=["granitemoehybrid", "falcon_h1"])
def recurrent(request, tmp_path_factory):
    """Blocks with recurrent and attention layers: alternating (granitemoehybrid), or both in every layer
    (falcon_h1)."""
    from family_harness import build

    return SpanBlocks(build(request.param, tmp_path_factory.mktemp(request.param) / "ckpt"), Span(0, 6))


@pytest.mark.parametrize("length", [10, 5])  # the current length, the end of an earlier step (a snapshot)
def test_a_recurrent_copy_runs_on_as_the_original(recurrent, length):
    check_copy(recurrent, Span(0, 6), length)


@torch.inference_mode()
def test_a_copy_past_the_end_or_between_recurrent_snapshots_is_refused(attention, recurrent):
    with pytest.raises(BadRequest, match="holds 10"):
        run_prefix(attention, Span(0, 6)).fork(11)
    cache = run_prefix(recurrent, Span(0, 6))
    with pytest.raises(BadRequest, match="recurrent state is kept only at"):
        cache.fork(6)  # inside the 3-token step from 5 to 8: no state was kept there
    assert cache.fork(0).length == 0 and cache.length == 10
