"""Families whose layers take more than the hidden states: what crosses a span boundary carries it.

Gemma 4's per-layer inputs and Zamba2's word embeddings are computed by the client's head and passed through
every span; ZAYA's router state is returned by each span's last layer for the next span's first. Families with
hyper-connections (HY-V4, Qwen4-Exp, DeepSeek-V4) pass several residual streams from layer to layer: flattened on
the boundary, unflattened for a span's first layer and for the head's collapse of them. Ground truth
is the family's own model run by transformers in this process (`tests/family_harness.py` builds the tiny
checkpoints), through the head and three spans (`LocalChain`), prefill in two chunks then single tokens.
"""

from __future__ import annotations

import pytest
import torch
from family_harness import build
from transformers import AutoModelForCausalLM

from client.inference.local_chain import LocalChain
from swarm.errors import UnsupportedModel
from swarm.model import families
from swarm.model.blocks import SpanBlocks
from swarm.model.checkpoint import Checkpoint
from swarm.model.streams import Boundary, Stream
from swarm.span import Span

pytestmark = pytest.mark.models

PER_LAYER = dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=256)
CASES = {"gemma4_text": PER_LAYER, "zamba2": {}, "zaya": {}}
# What the first layer takes per token: HY-V4's 4 streams [4, hidden]; Qwen4-Exp's 4 streams side by side.
HYPER = {"hy_v4": (4, 64), "qwen4_exp_text": (256,)}


@pytest.fixture
def measured(monkeypatch):
    monkeypatch.setattr(families, "INEXACT", {})  # the table is what this measures


def cached_reference(path, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Transformers' own logits for `ids`: the prompt in one forward, then one token at a time on its cache (what
    its `generate` computes)."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = ref(ids[:, :prefill], use_cache=True)
    cache, logits = _cache_of(out), [out.logits]
    for i in range(prefill, ids.shape[1]):
        step = ref(ids[:, i:i + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[i]]))
        cache = _cache_of(step)
        logits.append(step.logits)
    return torch.cat(logits, dim=1)


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@pytest.mark.parametrize("model_type", sorted(CASES))
@torch.inference_mode()
def test_three_spans_equal_transformers(model_type, tmp_path, measured):
    path = build(model_type, tmp_path, **CASES[model_type])
    ids = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    want = cached_reference(path, ids, 9)
    chain = LocalChain(path, [Span(0, 2), Span(2, 4), Span(4, 6)])
    boundary = chain.checkpoint.boundary
    assert boundary.streams and all(b.hidden_size == boundary.width > boundary.hidden for b in chain.blocks)
    session = chain.session(1, 32)
    got = [session.step(ids[:, :5], 0), session.step(ids[:, 5:9], 5)]
    got += [session.step(ids[:, i:i + 1], i) for i in range(9, ids.shape[1])]
    assert (torch.cat(got, dim=1) - want).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_passed_through_streams_come_back_unchanged_and_carried_ones_change(tmp_path, measured):
    """A span returns the head's streams as it got them (what a client can compare) and its last layer's router
    state; what the head gives the first span holds no router state yet."""
    path = build("zaya", tmp_path)
    ckpt = Checkpoint(path)
    (stream,) = ckpt.boundary.streams
    assert stream.carried and not ckpt.boundary.passthrough()
    chain = LocalChain(path, [Span(0, 3), Span(3, 6)])
    x = chain.head.embed(torch.tensor([[5, 6, 7]]), 0)
    hidden, (state,) = ckpt.boundary.split(x)
    assert not state.any()
    y = chain.blocks[0](x, chain.blocks[0].new_cache(1, 8), 0)
    assert ckpt.boundary.split(y)[1][0].abs().sum() > 0

    path = build("gemma4_text", tmp_path / "gemma4", **PER_LAYER)
    ckpt = Checkpoint(path)
    blocks = SpanBlocks(ckpt, Span(2, 4))
    x = torch.randn(1, 3, blocks.hidden_size, generator=torch.Generator().manual_seed(0))
    y = blocks(x, blocks.new_cache(1, 8), 0)
    (start, end), = ckpt.boundary.passthrough()
    assert end == blocks.hidden_size and torch.equal(y[..., start:end], x[..., start:end])
    assert not torch.equal(y[..., :start], x[..., :start])


def test_layers_sharing_keys_and_values_across_layers_are_refused_by_config(tmp_path):
    """Gemma 3n's and the smaller Gemma 4s' last layers attend with keys and values earlier layers computed in the
    same forward: a span boundary would cut them, so such checkpoints are refused before any weight loads."""
    from family_harness import tiny_config

    config = tiny_config("gemma4_text", num_kv_shared_layers=2, **PER_LAYER)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="gemma4_text.*num_kv_shared_layers"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("model_type", sorted(HYPER))
@torch.inference_mode()
def test_hyper_connections_cross_spans_flattened(model_type, tmp_path, measured):
    """The head's embeddings are the family's residual streams (each the token's embedding, before any layer),
    flattened; three spans and the head's collapse and final norm equal transformers' cached steps."""
    path = build(model_type, tmp_path)
    ids = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    want = cached_reference(path, ids, 9)
    chain = LocalChain(path, [Span(0, 2), Span(2, 4), Span(4, 6)])
    boundary = chain.checkpoint.boundary
    assert boundary.shape == HYPER[model_type] and boundary.width == 256 and not boundary.streams
    assert all(b.hidden_size == 256 for b in chain.blocks) and chain.head.hidden_size == 256
    embedded = chain.head.embed(ids[:, :3], 0)
    table = chain.head.embed_tokens.weight[ids[:, :3]]
    assert embedded.shape == (1, 3, 256) and torch.equal(boundary.unflatten(embedded).reshape(1, 3, 4, 64),
                                                         table.unsqueeze(2).expand(-1, -1, 4, -1))
    session = chain.session(1, 32)
    got = [session.step(ids[:, :5], 0), session.step(ids[:, 5:9], 5)]
    got += [session.step(ids[:, i:i + 1], i) for i in range(9, ids.shape[1])]
    assert (torch.cat(got, dim=1) - want).abs().max().item() <= 1e-4


def test_the_boundary_flattens_and_unflattens_the_hidden_states_alone():
    streams = (Stream("original_hidden_states", 8),)
    boundary = Boundary(12, streams, (3, 4))
    hidden, stream = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 8)
    flat = boundary.join(boundary.flatten(hidden), [stream])
    assert flat.shape == (2, 5, boundary.width) == (2, 5, 20)
    back, (part,) = boundary.split(flat)
    assert torch.equal(boundary.unflatten(back), hidden) and torch.equal(part, stream)
    plain = Boundary(12)  # one stream of hidden states: nothing to reshape
    assert plain.flatten(back) is back and plain.unflatten(back) is back
    with pytest.raises(ValueError, match=r"\[3, 5\]"):
        Boundary(12, (), (3, 5))


def test_token_ids_a_layer_needs_are_refused_by_config(tmp_path):
    """Qwen4-Exp's per-layer n-gram embeddings and DeepSeek-V4's hash-routed experts read the token ids, which the
    boundary does not carry (the wire's 16-bit and 8-bit encodings would not keep them exactly)."""
    from family_harness import tiny_config

    tiny_config("qwen4_exp_text", ple_layer_ids=[1, 5]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=r"layers \[0, 4\] embed n-grams of the token ids"):
        Checkpoint(tmp_path)


def test_a_span_of_hy_v4_starts_at_a_block_choosing_its_own_tokens(tmp_path):
    """HY-V4's "shared" blocks reuse the tokens the block before chose (handed from layer to layer, not across
    spans): a span starting at one is refused, naming the blocks it can start at."""
    from swarm.errors import BadRequest

    path = build("hy_v4", tmp_path)
    with pytest.raises(BadRequest, match=r"one of the blocks \[0, 2, 4\]"):
        SpanBlocks(Checkpoint(path), Span(1, 3))
