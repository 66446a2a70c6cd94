"""Spans of decoder blocks chained head -> span -> span -> span -> head match transformers' own model.

Ground truth is the whole model loaded by transformers in this process. For every family: a chunked
prefill, 16 greedy decode steps, then a rollback that replaces the last tokens; logits within 1e-4
(float32) and greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES
from transformers import AutoModelForCausalLM

from client.inference.local_chain import LocalChain
from swarm.model.blocks import SpanBlocks
from swarm.errors import BadRequest
from swarm.model.head import ModelHead
from swarm.span import Span, split_evenly

pytestmark = pytest.mark.models

TOLERANCE = 1e-4
PROMPT_LEN, CHUNK, DECODE_STEPS = 11, 4, 16


def Chain(path, spans: list[Span], batch: int = 1, max_length: int = 64, dtype="float32"):
    """Head and spans in one process, one cache per span: the shape of a swarm route."""
    return LocalChain(path, spans, dtype=dtype).session(batch, max_length)


def reference(path, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # random weights: keep generating past an "end" token
    return model


def prompt(batch: int = 1, length: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_three_spans_match_transformers(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    ref = reference(path)
    ids = prompt()
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                            do_sample=False)

    chain = Chain(path, split_evenly(6, 3))
    logits = [chain.prefill(ids, CHUNK)]
    tokens = ids
    for _ in range(DECODE_STEPS):
        nxt = logits[-1][:, -1:].argmax(-1)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits.append(chain.step(nxt, tokens.shape[1] - 1))
    assert torch.equal(tokens, expected), f"{family}: greedy tokens differ from transformers"

    ours = torch.cat(logits, dim=1)[:, :-1]
    theirs = ref(tokens[:, :-1]).logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOLERANCE, f"{family}: max logit difference {diff:.2e} > {TOLERANCE}"

    # Roll every cache back 6 tokens and take a different continuation: as if never sent.
    back = tokens.shape[1] - 6
    other = torch.tensor([[5, 6, 7]])
    rolled = chain.step(other, back)
    alt = torch.cat([tokens[:, :back], other], dim=1)
    diff_rb = (rolled - ref(alt).logits[:, back:]).abs().max().item()
    assert diff_rb <= TOLERANCE, f"{family}: after rollback, logit difference {diff_rb:.2e}"
    assert all(c.length == back + 3 for c in chain.caches)
    print(f"{family}: max |logit diff| {max(diff, diff_rb):.2e}")


@torch.inference_mode()
def test_batch_with_left_padding_matches_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    ids = prompt(batch=2, length=9, seed=3)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # the second sequence is 3 tokens shorter, padded on the left
    ref = reference(path)
    expected = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)

    chain = Chain(path, split_evenly(6, 3), batch=2)
    last = chain.prefill(ids, 4, mask)[:, -1:]
    tokens = ids
    for _ in range(8):
        nxt = last.argmax(-1)
        tokens, mask = torch.cat([tokens, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        last = chain.step(nxt, tokens.shape[1] - 1, mask)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@torch.inference_mode()
def test_half_precision_spans_track_transformers(dtype, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    torch_dtype = getattr(torch, dtype)
    chain = Chain(path, split_evenly(6, 3), dtype=dtype)
    assert all(p.dtype == torch_dtype for b in chain.chain.blocks for p in b.parameters())
    ids = prompt(length=10)
    ours = chain.prefill(ids, 4).float()
    theirs = reference(path, torch_dtype)(ids).logits.float()
    exact = reference(path)(ids).logits
    # Same dtype, different kernel order: close to transformers in that dtype, and near float32.
    assert (ours - theirs).abs().max().item() <= 0.05 * theirs.abs().max().item()
    assert (ours - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


def test_span_holds_only_its_parameters(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref = reference(path)
    blocks = SpanBlocks(path, Span(2, 4))
    expected = sum(p.numel() for i in (2, 3) for p in ref.model.layers[i].parameters())
    assert blocks.num_parameters() == expected
    head = ModelHead(path)
    head_expected = sum(p.numel() for m in (ref.model.embed_tokens, ref.model.norm, ref.lm_head) for p in m.parameters())
    assert head.num_parameters() == head_expected
    assert head.num_parameters() + sum(SpanBlocks(path, s).num_parameters() for s in split_evenly(6, 3)) == \
        ref.num_parameters()


@torch.inference_mode()
def test_a_span_that_overlaps_loaded_blocks_shares_them(tiny_checkpoint):
    """What a moving peer does: the overlap of the old and new spans is shared, not read again, and the
    new span computes exactly what a fresh load does; blocks of another dtype are refused."""
    path = tiny_checkpoint("qwen3")
    old = SpanBlocks(path, Span(0, 4))
    moved, fresh = SpanBlocks(path, Span(2, 6), reuse=old), SpanBlocks(path, Span(2, 6))
    assert moved.layers[0] is old.layers[2] and moved.layers[1] is old.layers[3]
    assert moved.layers[2] is not fresh.layers[2]
    hidden = torch.randn(2, 7, moved.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(moved(hidden), fresh(hidden))
    inside = SpanBlocks(path, Span(1, 3), reuse=old)  # nothing to read
    assert all(a is b for a, b in zip(inside.layers, old.layers[1:3]))
    with pytest.raises(ValueError, match="cannot reuse"):
        SpanBlocks(path, Span(2, 6), dtype="bfloat16", reuse=old)


def test_sharded_checkpoint_reads_only_the_span_shards(tmp_path):
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path / "ckpt", max_shard_size="40KB")
    ref = reference(path)
    import json

    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {f for name, f in weight_map.items() if name.startswith(("model.layers.4.", "model.layers.5."))}
    removed = {f for f in weight_map.values()} - needed
    assert removed, "the test needs shards that the span does not use"
    for f in removed:
        (path / f).unlink()
    blocks = SpanBlocks(path, Span(4, 6))
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = hidden
        for layer_idx in (4, 5):
            expected = _reference_layer(ref, layer_idx, expected)
        assert (blocks(hidden) - expected).abs().max().item() <= TOLERANCE


def _reference_layer(ref, i, hidden):
    from transformers.masking_utils import create_causal_mask

    pos = torch.arange(hidden.shape[1]).unsqueeze(0)
    mask = create_causal_mask(config=ref.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=pos)
    return ref.model.layers[i](hidden, attention_mask=mask, position_ids=pos,
                               position_embeddings=ref.model.rotary_emb(hidden, pos))


@torch.inference_mode()
def test_bad_steps_raise_typed_errors(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    blocks = SpanBlocks(path, Span(0, 2))
    cache = blocks.new_cache(batch_size=1, max_length=8)
    good = torch.zeros(1, 3, 64)
    bad_inputs = [
        (torch.zeros(1, 3, 63), 0),  # wrong hidden size
        (torch.zeros(3, 64), 0),  # wrong rank
        (torch.zeros(1, 3, 64, dtype=torch.int64), 0),  # not floating point
        (torch.zeros(2, 3, 64), 0),  # batch differs from the session's
        (good, 1),  # skips past the cache end
        (good, -1),
        (torch.zeros(1, 9, 64), 0),  # beyond max length
    ]
    for hidden, position in bad_inputs:
        with pytest.raises(BadRequest):
            blocks(hidden, cache, position)
    assert cache.length == 0
    blocks(good, cache, 0)
    assert cache.length == 3
    with pytest.raises(BadRequest):
        blocks(good, None, 2)  # stateless forwards start at 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_sub_span_of_served_blocks_runs_like_its_own_span(family, tiny_checkpoint):
    """A peer serving [0:6) runs a session on [2:5) exactly as a peer serving only [2:5) would."""
    path = tiny_checkpoint(family)
    served, sub = SpanBlocks(path, Span(0, 6)), Span(2, 5)
    alone = SpanBlocks(path, sub)
    torch.manual_seed(0)
    x = torch.randn(1, 7, 64)
    big, small = served.new_cache(1, 16, sub), alone.new_cache(1, 16)
    torch.testing.assert_close(served(x, big), alone(x, small), atol=1e-5, rtol=1e-5)
    y = torch.randn(1, 1, 64)
    torch.testing.assert_close(served(y, big, 7), alone(y, small, 7), atol=1e-5, rtol=1e-5)
    assert big.length == small.length == 8
    torch.testing.assert_close(served(x, span=sub), alone(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(BadRequest, match="not within"):
        alone(x, span=Span(0, 3))


@torch.inference_mode()
def test_recurrent_state_rolls_back_to_kept_step_ends_only(tmp_path):
    """A recurrent span keeps its state at the ends of the last steps: rolling back to one of them, or to
    0, is exact; to anywhere else it is a typed refusal that leaves the cache as it was."""
    from family_harness import build

    from swarm.model.cache import SNAPSHOTS

    path = build("mamba2", tmp_path / "ckpt")
    blocks = SpanBlocks(path, Span(0, 6))
    hidden = torch.randn(1, 14, blocks.hidden_size, generator=torch.Generator().manual_seed(5))
    cache = blocks.new_cache(1, 32)
    outs = [blocks(hidden[:, i:i + 1], cache, i) for i in range(12)]
    assert sorted(cache.snapshots) == list(range(13 - SNAPSHOTS, 13))
    with pytest.raises(BadRequest, match="recurrent state"):
        blocks(hidden[:, 2:3], cache, 2)
    assert cache.length == 12
    again = blocks(hidden[:, 9:10], cache, 9)  # back to the end of step 9, then the same token
    assert torch.allclose(again, outs[9], atol=1e-5)
    fresh = blocks.new_cache(1, 32)
    first = blocks(hidden[:, 0:1], fresh, 0)
    assert torch.allclose(blocks(hidden[:, 0:1], cache, 0), first, atol=1e-5)  # back to the start


@torch.inference_mode()
def test_head_logits_take_any_leading_shape(tiny_checkpoint):
    head = ModelHead(tiny_checkpoint("gemma3_text"))
    hidden = torch.randn(3, 4, head.hidden_size, generator=torch.Generator().manual_seed(2))
    full = head.logits(hidden)
    assert full.shape == (3, 4, head.vocab_size)
    assert torch.allclose(head.logits(hidden[:, -1]), full[:, -1], atol=1e-6)
