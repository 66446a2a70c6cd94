"""Caches of families whose forward keeps state in caches of its own kinds or class, against transformers.

- DeepSeek-V4's compressed attention (`swarm.model.compressed`): its forward run whole on a session's
  `SpanCache` equals its full forward after a chunked prefill and decode steps, after a rollback into the
  middle of a compression window, and in a fork; a rollback to a position whose compressor state was not kept
  is a `BadRequest` naming those it can return to. Its hash-routed layers need the token ids, so a checkpoint
  with them is refused; one without them runs in three spans, its residual streams crossing them.
- MiniMax's own cache class (`swarm.model.family_cache`): three chained spans equal transformers' forward on
  its own `MiniMaxCache` with the same chunks (bit for bit), rollback and fork included.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import get_layer_types_and_kwargs

from family_harness import build
from swarm.errors import BadRequest, UnsupportedModel
from swarm.model.cache import SpanCache
from swarm.model.checkpoint import Checkpoint
from swarm.model.kv import KVLayout, Pool
from swarm.span import Span

pytestmark = pytest.mark.models

TOLERANCE = 1e-4
IDS = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(1))
CHUNKS = [(0, 5), (5, 11)] + [(i, i + 1) for i in range(11, 30)]  # a chunked prefill, then decode steps


def alternative(start: int) -> torch.Tensor:
    alt = IDS.clone()
    alt[:, start:] = torch.arange(5, 5 + IDS.shape[1] - start)
    return alt


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """Tiny DeepSeek-V4 whose both compressors emit entries within 30 tokens (windows of 4 and 8) and whose
    indexer picks fewer entries than there are."""
    path = build("deepseek_v4", tmp_path_factory.mktemp("deepseek_v4"), index_topk=2, index_n_heads=4,
                 index_head_dim=16, o_lora_rank=16,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def v4_cache(model) -> SpanCache:
    config = model.config
    kinds, per_layer = get_layer_types_and_kwargs(config)
    n = config.num_hidden_layers
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(kinds)
    layout = KVLayout.of({i: (1, config.head_dim, 1, config.head_dim) for i in range(n)}, torch.float32,
                         torch.device("cpu"))
    return SpanCache(Span(0, n), 1, 64, n, kinds, [1] * n, Pool(layout, 1024), None, per_layer)


def v4_step(model, cache: SpanCache, ids: torch.Tensor, position: int) -> torch.Tensor:
    cache.rollback(position)
    cache.begin(ids.shape[1])
    logits = model(input_ids=ids, cache=cache.kv, use_cache=True,
                   position_ids=torch.arange(position, position + ids.shape[1])[None]).logits
    cache.advance(ids.shape[1])
    return logits


@torch.inference_mode()
def test_compressed_attention_steps_roll_back_and_fork_exactly(v4):
    _, model = v4
    cache = v4_cache(model)
    ours = torch.cat([v4_step(model, cache, IDS[:, a:b], a) for a, b in CHUNKS], dim=1)
    assert (ours - model(IDS).logits).abs().max() <= TOLERANCE
    layer = cache.own[1]
    assert layer.entry_count["compressor"] == 30 // 4 and layer.entry_count["indexer"] == 30 // 4

    # rollback into the middle of both compressors' windows (25 = 6 * 4 + 1 = 3 * 8 + 1), then other tokens
    alt = alternative(25)
    rolled = v4_step(model, cache, alt[:, 25:], 25)
    assert (rolled - model(alt).logits[:, 25:]).abs().max() <= TOLERANCE

    # a fork at a kept step end runs on as the full forward; the source, stepping on, is not changed by it
    fork = cache.fork(23)
    other = alternative(23)
    assert (v4_step(model, fork, other[:, 23:], 23) - model(other).logits[:, 23:]).abs().max() <= TOLERANCE
    again = v4_step(model, cache, IDS[:, 25:], 25)
    assert (again - model(IDS).logits[:, 25:]).abs().max() <= TOLERANCE


@torch.inference_mode()
def test_compressed_attention_refuses_positions_it_did_not_keep(v4):
    _, model = v4
    cache = v4_cache(model)
    for a, b in CHUNKS:
        v4_step(model, cache, IDS[:, a:b], a)
    kept = sorted(cache.snapshots)
    assert kept == list(range(23, 31))
    with pytest.raises(BadRequest, match=r"compressed-attention state .*\[23, 24, 25, 26, 27, 28, 29, 30\].* not to 7"):
        cache.rollback(7)
    with pytest.raises(BadRequest, match=r"\[23, 24, 25, 26, 27, 28, 29, 30\].* not at 7"):
        cache.fork(7)
    assert cache.length == 30  # nothing moved

    def fail(module, args, output):
        raise RuntimeError("a layer failed")

    handle = model.model.layers[3].register_forward_hook(fail)  # after three layers changed their compressors
    try:
        with pytest.raises(RuntimeError):
            v4_step(model, cache, torch.tensor([[9]]), 30)
    finally:
        handle.remove()
    cache.abort()
    longer = torch.cat([IDS, torch.tensor([[9]])], dim=1)
    assert (v4_step(model, cache, longer[:, 30:], 30) - model(longer).logits[:, 30:]).abs().max() <= TOLERANCE
    fresh = v4_step(model, cache, IDS[:, :9], 0)  # back to 0 is always possible
    assert (fresh - model(IDS[:, :9]).logits).abs().max() <= TOLERANCE


def test_a_span_of_deepseek_v4_is_refused_before_weights_load(v4):
    path, _ = v4
    with pytest.raises(UnsupportedModel, match=r"layers \[0\] pick their experts by token id \(hash_moe\)"):
        Checkpoint(path)


@torch.inference_mode()
def test_deepseek_v4_without_hash_routing_runs_in_three_spans(tmp_path):
    """Its 4 residual streams [batch, tokens, 4, hidden] cross the spans flattened; compressed attention, its
    indexer (16 heads: no ties) and the head's collapse of the streams as transformers computes them."""
    from safetensors.torch import load_file, save_file

    from client.inference.local_chain import LocalChain

    path = build("deepseek_v4", tmp_path, index_topk=2, index_n_heads=16, index_head_dim=16, o_lora_rank=16,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                 mlp_layer_types=["moe"] * 6)
    # transformers saves the final norm as "model.norm.weight", which its own loading renames to "kv_norm";
    # DeepSeek's checkpoints name it "norm.weight" (scaled, so that a norm left at ones would show)
    state = load_file(path / "model.safetensors")
    state["norm.weight"] = state.pop("model.norm.weight") * 1.5
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chain = LocalChain(path, [Span(0, 2), Span(2, 4), Span(4, 6)])
    assert chain.checkpoint.boundary.shape == (4, 64)
    session = chain.session(1, 32)
    got = torch.cat([session.step(IDS[:, a:b], a) for a, b in CHUNKS], dim=1)
    assert (got - model(IDS).logits).abs().max() <= TOLERANCE
    back = session.step(IDS[:, 27:30] + 1, 27)  # the end of the last steps: a rollback the compressors kept
    assert (back - model(torch.cat([IDS[:, :27], IDS[:, 27:30] + 1], 1)).logits[:, 27:]).abs().max() <= TOLERANCE


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    from client.inference.local_chain import LocalChain

    path = build("minimax", tmp_path_factory.mktemp("minimax"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LocalChain(path, [Span(0, 2), Span(2, 4), Span(4, 6)]), model


def own_cache_logits(model, ids: torch.Tensor, chunks) -> torch.Tensor:
    """Transformers' forward on its own `MiniMaxCache`, step by step in `chunks`."""
    cache, out = None, []
    for a, b in chunks:
        result = model(ids[:, a:b], cache=cache, use_cache=True)
        cache = result.cache
        out.append(result.logits)
    return torch.cat(out, dim=1)


@torch.inference_mode()
def test_minimax_spans_equal_its_own_cache_through_rollback_and_fork(minimax):
    chain, model = minimax
    session = chain.session(1, 64)
    ours = torch.cat([session.step(IDS[:, a:b], a) for a, b in CHUNKS], dim=1)
    assert torch.equal(ours, own_cache_logits(model, IDS, CHUNKS))
    # Its own cached forward (a recurrence per token) and its full forward (a block at once) differ by float
    # rounding only; measured 1.9e-4 on these logits (of magnitude 7).
    assert (ours - model(IDS).logits).abs().max() <= 1e-3

    alt = alternative(25)
    rolled = session.step(alt[:, 25:], 25)
    assert torch.equal(rolled, own_cache_logits(model, alt, CHUNKS[:-5] + [(25, 30)])[:, 25:])

    from client.inference.local_chain import LocalSession

    fork = LocalSession(chain, [cache.fork(23) for cache in session.caches])
    other = alternative(23)
    assert torch.equal(fork.step(other[:, 23:], 23), own_cache_logits(model, other, CHUNKS[:-7] + [(23, 30)])[:, 23:])
    assert torch.equal(session.step(IDS[:, 25:26], 25), ours[:, 25:26])  # the source is not moved by its fork

    with pytest.raises(BadRequest, match=r"recurrent state .*not to 3"):
        session.step(IDS[:, 3:4], 3)
