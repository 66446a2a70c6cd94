"""Blocks in other precisions, on the CPU: bfloat16 and int8 weights load only what they serve, compute close
to float32 (int8 weights computing in bfloat16), take the memory their format says, reuse only blocks of
their own format, and run the same cached decode as a stateless forward."""

from __future__ import annotations

import pytest
import torch

from swarm.model.blocks import SpanBlocks
from swarm.span import Span

pytestmark = pytest.mark.models


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def test_int8_and_bfloat16_blocks_stay_close_to_float32(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    full = SpanBlocks(path, Span(0, 6))
    int8 = SpanBlocks(path, Span(0, 6), "bfloat16", quant="int8")
    half = SpanBlocks(path, Span(0, 6), "bfloat16")
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    expected = full(x)
    assert relative_error(int8(x), expected) < 0.05
    assert relative_error(half(x), expected) < 0.05
    assert sum(type(m).__name__ == "Int8Linear" for m in int8.modules()) == 6 * 7  # q k v o gate up down
    assert int8.precision.format == "int8/bfloat16" and half.precision.format == "bfloat16"
    # weights: int8 linears a quarter of float32 (their scales and the norms in bfloat16), bfloat16 half
    assert int8.weight_bytes() <= 0.3 * full.weight_bytes()
    assert half.weight_bytes() == full.weight_bytes() // 2


@torch.inference_mode()
def test_an_int8_token_s_output_depends_on_its_own_input_only(tiny_checkpoint):
    """Decode steps of several sessions batched together, or one by one: the same numbers, bit for bit; and
    a cached decode agrees with a forward of the whole sequence as closely as bfloat16 does."""
    path = tiny_checkpoint("llama")
    blocks = SpanBlocks(path, Span(1, 4), "bfloat16", quant="int8")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, 64, generator=g) for n in (3, 5, 4)]
    caches = [blocks.new_cache(1, 16) for _ in prompts]
    for prompt, cache in zip(prompts, caches):
        blocks(prompt, cache, 0)
    steps = [torch.randn(1, 1, 64, generator=g) for _ in prompts]
    batched = blocks.decode_batch([(cache, x, None) for cache, x in zip(caches, steps)])
    for prompt, cache, x, out in zip(prompts, caches, steps, batched):
        alone = blocks.new_cache(1, 16)
        blocks(prompt, alone, 0)
        assert torch.equal(blocks(x, alone, prompt.shape[1]), out)
    half = SpanBlocks(path, Span(1, 4), "bfloat16")
    x = torch.randn(1, 7, 64, generator=g)
    for b in (blocks, half):
        cache = b.new_cache(1, 16)
        steps = torch.cat([b(x[:, :4], cache, 0)] + [b(x[:, i:i + 1], cache, i) for i in range(4, 7)], 1)
        assert relative_error(steps, b(x)) < 0.02


def test_blocks_are_reused_only_in_their_own_format(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    int8 = SpanBlocks(path, Span(0, 3), "bfloat16", quant="int8")
    moved = SpanBlocks(path, Span(2, 5), "bfloat16", quant="int8", reuse=int8)
    assert moved.layers[0] is int8.layers[2]
    with pytest.raises(ValueError, match="cannot reuse"):
        SpanBlocks(path, Span(2, 5), "bfloat16", reuse=int8)
