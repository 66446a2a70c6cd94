"""Every model type in transformers' causal-LM mapping, through three chained spans, against transformers.

For each type: a tiny random checkpoint from a config with fixed seeds and the values real
checkpoints use where a class default would be neutral (embedding and logit multipliers, logit
scales, soft-caps, short sliding windows); then our head and three spans (prefill in two chunks,
greedy steps, a rollback with a different continuation) against the whole model run by
transformers in this process. The outcome of a type is one of:

- "exact": greedy tokens identical and every logit within `TOLERANCE` (float32);
- "inexact": measured otherwise, and so refused (by `swarm/model/families.py`'s `INEXACT`, with the reason);
  the comparison runs with that table set aside, so the measurement is made every time;
- "refused": a typed `UnsupportedModel` before any weight loads, with its reason (or a `CheckpointError`);
- "unchecked": no tiny model of it could be built here (listed in `UNCHECKED`, with why; its config alone
  is still opened, and must be refused with a typed error);
- "wrong" or "crash": a defect (the test over the mapping fails on either); an untyped error out of
  opening a checkpoint is a crash.

Used by `tests/models/test_every_family.py` and by `benchmarks/model_coverage.py`, which writes
`docs/models.md`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

TOLERANCE = 1e-4
PROMPT, FIRST_CHUNK, STEPS, BACK = 9, 5, 8, 4
BLOCKS = 6

# Small sizes, under the names configs take them (aliases resolve through each config's attribute map).
SIZES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2, tie_word_embeddings=False,
    # mixtures of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, num_shared_experts=1, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    n_group=1, topk_group=1,
    # other names of the same sizes
    d_model=64, decoder_layers=BLOCKS, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4,
    decoder_ffn_dim=128, encoder_ffn_dim=128, rotary_dim=8,
    # latent attention
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)

# Values real checkpoints use where the class default is neutral (1.0, off): neutral defaults hide a
# part that is not applied. Set only where the config has the field.
REALISTIC = dict(
    embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
    logit_scale=0.0625, scale_emb=12.0, dim_model_base=32, scale_depth=1.4,
    final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=16,
    sliding_window=4, use_sliding_window=True, max_window_layers=3,
    embedding_scale=2.0, output_multiplier_scale=0.5, mup_width_multiplier=2.0,
    lm_head_multiplier=0.5, ssm_in_multiplier=1.5, ssm_out_multiplier=0.7, ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9],
    attention_in_multiplier=1.3, attention_out_multiplier=0.8, key_multiplier=0.9, mlp_multipliers=[1.2, 0.8],
)

_BLT_PART = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 max_position_embeddings=256, num_hidden_layers=2)

# Per type, where the generic sizes do not fit the class (a part given whole is taken as given).
OVERRIDES: dict[str, dict] = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 3),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=BLOCKS, max_seq_len=256,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "dots3_note": dict(head_dim=16), "dots3_note_text": dict(head_dim=16),
    "gemma3n_text": dict(num_kv_shared_layers=2, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    # The larger Gemma 4 checkpoints have no per-layer inputs (the smaller ones do, and share keys and values
    # across layers: tests/models/test_every_family.py::test_per_layer_inputs_are_exact, tests/models/test_streams.py).
    "gemma4": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=0),
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=0),
    "gemma4_unified": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=0),
    "gemma4_unified_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=0),
    "gemma4_assistant": dict(vocab_size_per_layer_input=0, hidden_size_per_layer_input=0),
    "gemma4_unified_assistant": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=0),
    "inkling2_text": dict(vocab_size=201024), "inkling2_loop_text": dict(vocab_size=201024),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                           indexer_compress_ratio=2, hc_lowrank=8),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                      indexer_compress_ratio=2, hc_lowrank=8),
    # Indexers keep fewer tokens than a prompt has (by default they keep 2048: every token, the indexer unused),
    # with enough heads that no two tokens tie on a score of 0 (at 4 heads, tokens every head scores below 0 tie,
    # and transformers' own cached steps then choose other tokens than its full forward);
    # GLM's "shared" blocks reuse the previous block's choice (each span here starts at a "full" one).
    "deepseek_v32": dict(index_topk=3, index_n_heads=16, index_head_dim=16),
    "glm_moe_dsa": dict(index_topk=3, index_n_heads=16, index_head_dim=16,
                        indexer_types=["full", "shared"] * (BLOCKS // 2)),
    "axk2": dict(index_topk=3, index_n_heads=16, index_head_dim=16),
    "hy_v4": dict(index_topk=3, index_n_heads=16, index_head_dim=16,
                  indexer_types=["full", "shared"] * (BLOCKS // 2)),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "xlnet": dict(n_head=4, d_head=16),
    "zaya": dict(num_experts_per_tok=1),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16),
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4),
    "bamba": dict(attn_layer_indices=[1, 4], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 3, mamba_n_heads=8, mamba_d_head=16,
                             mamba_d_state=16),
    # Zamba's hybrid layers share one attention block (tied across layers), as in its released checkpoints;
    # its layer kinds are derived again from the period and offset (a pick of the 76 default ones has no hybrid).
    "zamba": dict(attn_layer_period=3, attn_layer_offset=1, mamba_dt_rank=8, tie_word_embeddings=True,
                  layers_block_type=None),
    # BLT's parts (byte patcher, local encoder and decoder, global transformer), given whole: sizes must agree.
    "blt": dict(encoder_hash_byte_group_vocab=1000, patcher_config=_BLT_PART,
                global_config=dict(_BLT_PART, hidden_size=128), encoder_config=dict(_BLT_PART, hidden_size_global=128),
                decoder_config=dict(_BLT_PART, hidden_size_global=128)),
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32],
                     attn_layers=["local", "lsh"] * 3, local_attn_chunk_length=8, lsh_attn_chunk_length=8),
}


@dataclass
class Outcome:
    model_type: str
    result: str  # exact | inexact | refused | unchecked | wrong | crash
    detail: str = ""
    max_diff: float | None = None
    seconds: float = 0.0


def model_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# Types whose default config transformers itself refuses: built from these instead.
BASES: dict[str, dict] = {
    "gemma4_assistant": dict(text_config={"model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                                          "vocab_size_per_layer_input": 0}),
}

# Types no tiny model could be built of here (transformers refuses every small config tried); the test
# checks that this is still so, so that a fix shows up.
UNCHECKED: dict[str, str] = {
    "dots3_note": "its per-layer attention overrides fail transformers' own validation at small sizes",
    "dots3_note_text": "its per-layer attention overrides fail transformers' own validation at small sizes",
}


def tiny_config(model_type: str, **changes):
    """A small config of `model_type` with realistic non-neutral values, deterministic; `changes` replace
    sizes or overrides (e.g. `tie_word_embeddings=True`)."""
    base = AutoConfig.for_model(model_type, **BASES.get(model_type, {}))
    wanted = {**SIZES, **OVERRIDES.get(model_type, {}), **changes}
    return _shrunk(base, wanted, model_type)


# Towers of composite models (vision, audio) only need to build: the swarm serves the language model.
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             depth=1, num_layers=1, embed_dim=32, head_dim=16)
SUBCONFIGS = ("text_config", "vision_config", "audio_config", "decoder_config", "encoder_config", "vq_config",
              "speech_config", "depth_decoder_config")


def _shrunk(config, wanted: dict, model_type: str, tower: bool = False):
    data = config.to_dict()
    fields = set(data) | set(getattr(config, "attribute_map", {}))
    blocks = _layers(config)
    kwargs = {k: v for k, v in (TOWER if tower else wanted).items() if k in fields}
    if not tower:
        kwargs.update({k: v for k, v in REALISTIC.items() if k in fields and k not in OVERRIDES.get(model_type, {})})
    if "head_dim" in kwargs and "head_dim" not in data:
        kwargs.pop("head_dim")
    if "head_dim" in kwargs and "qk_rope_head_dim" in kwargs and "head_dim" not in OVERRIDES.get(model_type, {}):
        # latent attention: rotary tables span the rope part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    target = kwargs.get("num_hidden_layers", kwargs.get("decoder_layers", BLOCKS))
    # Per-layer settings follow a pick of the original layers (first and last kept); with no per-layer
    # overrides, layer kinds instead take turns, so that every span mixes them.
    picked = _per_layer(list(range(blocks)), target, cycle=False) if blocks else []
    per_layer = data.get("per_layer_config")
    for key, value in data.items():
        if key in kwargs or key in SUBCONFIGS:
            continue
        if isinstance(value, list) and blocks and len(value) == blocks and len(value) != target:
            if key == "layer_types" and not per_layer:
                kwargs[key] = _per_layer(value, target, cycle=True)
            else:
                kwargs[key] = [value[j] for j in picked]
        elif key == "per_layer_config" and isinstance(value, dict) and blocks:
            kwargs[key] = {i: value[str(j)] if str(j) in value else value[j] for i, j in enumerate(picked)
                           if str(j) in value or j in value}
    if "layer_types" in data and isinstance(data["layer_types"], list) and len(data["layer_types"]) == target:
        kwargs["layer_types"] = _per_layer(data["layer_types"], target, cycle=True)
    spare = iter(range(SIZES["vocab_size"] - 1, 200, -1))  # special tokens of towers, inside the small vocabulary
    for key, value in data.items():
        if key.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= SIZES["vocab_size"]:
            kwargs.setdefault(key, next(spare))
    parts = {}
    for name in SUBCONFIGS:
        part = getattr(config, name, None)
        if name in kwargs:  # given whole in OVERRIDES
            continue
        if isinstance(part, dict) and "model_type" in part:
            part = AutoConfig.for_model(part["model_type"], **{k: v for k, v in part.items() if k != "model_type"})
        if part is not None and hasattr(part, "to_dict"):
            parts[name] = _shrunk(part, wanted, model_type, tower=name != "text_config")
    if "kv_lora_rank" in kwargs:  # latent attention has as many key-value heads as query heads
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    # Only what changes is passed: whatever the class derives (per-layer lists, head widths) is derived again.
    return AutoConfig.for_model(data.get("model_type") or model_type, **kwargs, **parts)


def _layers(config) -> int | None:
    for name in ("num_hidden_layers", "decoder_layers", "n_layer", "num_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _per_layer(values: list, n: int, cycle: bool) -> list:
    """`n` entries of a per-layer list: its distinct values in turn (layer kinds mix in every span), or
    entries spread over it (first and last kept)."""
    if cycle:
        kinds = list(dict.fromkeys(values))
        return [kinds[i % len(kinds)] for i in range(n)]
    if n == 1:
        return values[:1]
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


MAX_PARAMETERS = 40_000_000


def build(model_type: str, directory: Path, seed: int = 0, **changes) -> Path:
    config = tiny_config(model_type, **changes)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config has {size / 1e6:.0f}M parameters: shrink it in OVERRIDES")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


@torch.inference_mode()
def check(model_type: str, directory: Path) -> Outcome:
    """Build, then compare or record the refusal; never raises."""
    from client.inference.local_chain import LocalChain
    from swarm.model.checkpoint import Checkpoint
    from swarm.errors import CheckpointError, UnsupportedModel
    from swarm.span import split_evenly

    from swarm.model import families

    started = time.monotonic()
    listed = families.INEXACT.get(model_type)
    if model_type in UNCHECKED:
        try:
            build(model_type, directory)
        except Exception:  # noqa: BLE001 - still cannot be built: as recorded
            untyped = open_config_alone(model_type, directory)
            if untyped:
                return Outcome(model_type, "crash", untyped)
            return Outcome(model_type, "unchecked", UNCHECKED[model_type])
        return Outcome(model_type, "crash", "listed as unbuildable, but a tiny model was built: check it")
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    inexact, families.INEXACT = families.INEXACT, {}  # measured every time, not taken from the table
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                path = build(model_type, directory)
            except Exception as exc:  # noqa: BLE001 - transformers itself cannot build the class from this config
                # Then a checkpoint of it must still be refused with a reason, from its config alone.
                directory.mkdir(parents=True, exist_ok=True)
                try:
                    tiny_config(model_type).save_pretrained(directory)
                    Checkpoint(directory)
                except UnsupportedModel as refusal:
                    return Outcome(model_type, "refused", str(refusal), seconds=time.monotonic() - started)
                except Exception:  # noqa: BLE001
                    pass
                return Outcome(model_type, "crash", f"building the tiny model: {type(exc).__name__}: {exc}"[:300],
                               seconds=time.monotonic() - started)
            try:
                ckpt = Checkpoint(path)
            except (UnsupportedModel, CheckpointError) as exc:
                return Outcome(model_type, "refused", str(exc), seconds=time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - opening fails only with a typed error: a defect
                return Outcome(model_type, "crash", f"opening raised {type(exc).__name__}: {exc}"[:300],
                               seconds=time.monotonic() - started)
            try:
                outcome = _compare(ckpt, path, LocalChain, split_evenly)
            except UnsupportedModel as exc:
                return Outcome(model_type, "refused", str(exc), seconds=time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - recorded as a defect
                return Outcome(model_type, "crash", f"{type(exc).__name__}: {exc}"[:300],
                               seconds=time.monotonic() - started)
    finally:
        quiet.setLevel(level)
        families.INEXACT = inexact
    outcome.seconds = time.monotonic() - started
    if outcome.result == "wrong" and listed is not None:
        outcome.result, outcome.detail = "inexact", f"{outcome.detail} (refused: {listed})"
    return outcome


def open_config_alone(model_type: str, directory: Path, **changes) -> str:
    """Open a directory holding only the tiny config of `model_type` (no model of it could be built): it
    must be refused with a typed error. Returns what went wrong, or "" when it was."""
    from swarm.errors import CheckpointError, UnsupportedModel
    from swarm.model.checkpoint import Checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    try:
        tiny_config(model_type, **changes).save_pretrained(directory)
    except Exception:  # noqa: BLE001 - not even its config can be built small: nothing to open
        return ""
    try:
        Checkpoint(directory)
    except (UnsupportedModel, CheckpointError):
        return ""
    except Exception as exc:  # noqa: BLE001 - the defect this reports
        return f"opening its config alone raised {type(exc).__name__}: {exc}"[:300]
    return "a checkpoint without weights was opened"


def _compare(ckpt, path: Path, LocalChain, split_evenly) -> Outcome:  # noqa: N803
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = ckpt.text_config.vocab_size
    ids = torch.randint(3, min(vocab, 256), (1, PROMPT), generator=torch.Generator().manual_seed(1))
    # plain greedy: none of the class's default processors (n-gram bans, forced tokens, minimum lengths)
    ref.generation_config = GenerationConfig(max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids))

    from swarm.span import span_starts

    # cut only where a span may start (GLM's and HY's "shared" blocks take the previous block's indexer choice)
    chain = LocalChain(path, split_evenly(ckpt.num_blocks, 3, span_starts(ckpt.config))).session(1, PROMPT + STEPS + 8)
    logits = [chain.step(ids[:, :FIRST_CHUNK], 0), chain.step(ids[:, FIRST_CHUNK:], FIRST_CHUNK)]
    tokens = ids
    for _ in range(STEPS):
        nxt = logits[-1][:, -1:].argmax(-1)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits.append(chain.step(nxt, tokens.shape[1] - 1))
    ours = torch.cat(logits, dim=1)[:, :-1]
    theirs = ref(tokens[:, :-1]).logits
    diff = (ours - theirs).abs().max().item()
    back = tokens.shape[1] - BACK
    other = torch.tensor([[5, 6, 7]])
    rolled = chain.step(other, back)
    alt = torch.cat([tokens[:, :back], other], dim=1)
    diff = max(diff, (rolled - ref(alt).logits[:, back:]).abs().max().item())
    # Greedy tokens of transformers' own forward over the whole sequence (no cache): the model itself.
    full = ids
    for _ in range(STEPS):
        full = torch.cat([full, ref(full).logits[:, -1:].argmax(-1)], dim=1)
    same = torch.equal(tokens, full)
    note = "" if torch.equal(full, expected) else "transformers' cached generate() differs from its own full forward"
    batched, alone = batched_steps(chain.chain.blocks[0])
    notes = [note, "" if batched else "steps of several sessions run one at a time"]
    note = "; ".join(n for n in notes if n)
    if same and diff <= TOLERANCE and alone <= TOLERANCE:
        return Outcome(ckpt.model_type, "exact", note, max_diff=diff)
    if same and diff <= TOLERANCE:
        return Outcome(ckpt.model_type, "wrong", f"batched decode steps differ from steps alone by {alone:.2e} "
                       "(relative)", max_diff=diff)
    cached = _as_transformers_steps(ref, tokens, alt, back, ours, rolled)
    if cached is not None and torch.equal(tokens, expected) and alone <= TOLERANCE:
        itself, ours_vs_cached = cached
        if itself > TOLERANCE and ours_vs_cached <= TOLERANCE:
            why = CACHED_DIFFERS.get(ckpt.model_type)
            if why is None:
                return Outcome(ckpt.model_type, "wrong", f"max logit difference {diff:.2e} from the full forward, "
                               f"{ours_vs_cached:.1e} from transformers' own cached steps, which differ from its full "
                               f"forward by {itself:.1e}: say why in CACHED_DIFFERS", max_diff=diff)
            note = "; ".join(n for n in [f"as transformers generates: its own cached steps differ from its full "
                                         f"forward by {itself:.1e} ({why}); spans equal its cached steps within "
                                         f"{ours_vs_cached:.1e}", note] if n)
            return Outcome(ckpt.model_type, "exact", note, max_diff=ours_vs_cached)
    return Outcome(ckpt.model_type, "wrong", f"max logit difference {diff:.2e}; greedy tokens "
                   f"{'identical' if same else 'differ'}", max_diff=diff)


# Types whose own cached steps (how transformers generates) differ from their forward over the whole sequence by
# more than `TOLERANCE`, and why: spans are compared with transformers' cached steps, chunk for chunk, instead.
CACHED_DIFFERS = {
    "nemotron_h": "its Mamba-2 mixers clamp the time step to time_step_min over several tokens, not in a one-token step",
    "zamba2": "its Mamba-2 mixers clamp the time step to time_step_min over several tokens, not in a one-token step",
    "minimax": "float rounding: its full forward computes lightning attention in blocks, its cached steps one token "
               "at a time",
}


def _as_transformers_steps(ref, tokens, alt, back: int, ours, rolled) -> tuple[float, float] | None:
    """Transformers' own cached forward run in the chunks the spans ran (prefill in two chunks, one-token steps, and
    for the rollback the same steps up to it, then the continuation): how far it is from its full forward, and how
    far the spans' logits are from it. None where the family's cache cannot be driven this way."""
    def steps(seq, chunks):
        out, past, at = [], None, 0
        for n in chunks:
            o = ref(seq[:, at:at + n], past_key_values=past, use_cache=True)
            past, at = o.past_key_values, at + n
            out.append(o.logits)
        return torch.cat(out, dim=1)

    main = [FIRST_CHUNK, PROMPT - FIRST_CHUNK] + [1] * (tokens.shape[1] - 1 - PROMPT)
    rollback = [FIRST_CHUNK, PROMPT - FIRST_CHUNK] + [1] * (back - PROMPT) + [alt.shape[1] - back]
    try:
        cached, cached_alt = steps(tokens[:, :-1], main), steps(alt, rollback)[:, back:]
    except Exception:  # noqa: BLE001 - a family whose cache is not returned as past_key_values
        return None
    itself = max((cached - ref(tokens[:, :-1]).logits).abs().max().item(),
                 (cached_alt - ref(alt).logits[:, back:]).abs().max().item())
    return itself, max((ours - cached).abs().max().item(), (rolled - cached_alt).abs().max().item())


RAGGED_LENGTHS = (1, 9, 30)  # sessions at very different lengths in one batch


@torch.inference_mode()
def batched_steps(blocks) -> tuple[bool, float]:
    """Two one-token steps of sessions at `RAGGED_LENGTHS` run as one batch (`decode_batch`) and one at a time:
    whether the batch shared a forward, and the largest difference of an output relative to its magnitude."""
    g = torch.Generator().manual_seed(7)
    pairs = [(blocks.new_cache(1, 64), blocks.new_cache(1, 64)) for _ in RAGGED_LENGTHS]
    for (a, b), n in zip(pairs, RAGGED_LENGTHS):
        x = torch.randn(1, n, blocks.hidden_size, generator=g)
        blocks(x, a, 0)
        blocks(x, b, 0)
    worst = 0.0
    for _ in range(2):
        xs = [torch.randn(1, 1, blocks.hidden_size, generator=g) for _ in pairs]
        alone = [blocks(x, a, a.length) for x, (a, _) in zip(xs, pairs)]
        batched = blocks.decode_batch([(b, x, None) for x, (_, b) in zip(xs, pairs)])
        worst = max([worst] + [((o - e).abs().max() / e.abs().max().clamp_min(1e-6)).item()
                               for o, e in zip(batched, alone)])
    return blocks.ragged and not blocks.recurrent, worst


def run_all(root: Path, types: list[str] | None = None, progress=None) -> list[Outcome]:
    out = []
    for i, model_type in enumerate(types or model_types()):
        outcome = check(model_type, root / model_type.replace("/", "_"))
        outcome.model_type = model_type
        out.append(outcome)
        if progress:
            progress(i + 1, outcome)
    return out


