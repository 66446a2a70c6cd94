"""Tiny random checkpoints built from configs with fixed seeds, one per decoder family under test.

Each has 6 blocks so that three spans of two can be chained; sliding windows are shorter than the
test sequences so that windowed masks matter. `build_servable_checkpoint` adds a tokenizer (one token per
byte, then an end token), so that `swarm api` can serve the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2, tie_word_embeddings=False,
)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=6),
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": dict(
        sliding_window=5, tie_word_embeddings=True, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    ),
    "phi3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
}


def build_tiny_checkpoint(family: str, directory: Path, seed: int = 0, max_shard_size: str | None = None,
                          **overrides) -> Path:
    """Write a random-weight checkpoint of `family` into `directory` (deterministic for a seed); `overrides`
    replace config fields (e.g. a wider model whose compute outweighs loopback noise)."""
    kwargs = {**COMMON, **FAMILIES[family], **overrides}
    if family == "phi3":
        kwargs.pop("head_dim")  # phi3 derives it from hidden size and heads
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    return directory


def build_servable_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny checkpoint with a tokenizer saved beside it: one token per byte (byte-level, no merges), then
    `<eos>`, the model's end token (its vocabulary is 257 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    build_tiny_checkpoint(family, directory, seed, vocab_size=len(vocab), eos_token_id=vocab["<eos>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)
    return directory
