"""Checkpoints that cannot be split into blocks fail early, with a message naming the model type."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from swarm.model.blocks import SpanBlocks
from swarm.model.checkpoint import Checkpoint, read_config
from swarm.model.head import ModelHead
from swarm.errors import BadRequest, CheckpointError, UnsupportedModel
from swarm.span import Span

pytestmark = pytest.mark.models


@pytest.mark.parametrize("model_type", ["t5", "bart", "gemma4_unified_text"])
def test_unsupported_architectures_are_named(model_type, tmp_path):
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never reached: refused on the config alone
    with pytest.raises(UnsupportedModel) as err:
        Checkpoint(tmp_path)
    message = str(err.value)
    assert repr(model_type) in message
    assert "docs/models.md" in message


def _save_tiny(config, directory):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_a_config_without_a_layer_count_is_refused(tmp_path):
    """BLT (a byte patcher, local encoder and decoder around a global transformer) has no single stack of
    decoder layers: its config has no `num_hidden_layers`, which used to escape as an AttributeError."""
    part = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                max_position_embeddings=256, num_hidden_layers=2)
    config = AutoConfig.for_model("blt", encoder_hash_byte_group_vocab=1000, patcher_config=part,
                                  encoder_config=dict(part, hidden_size_global=128),
                                  decoder_config=dict(part, hidden_size_global=128),
                                  global_config=dict(part, hidden_size=128))
    path = _save_tiny(config, tmp_path)
    with pytest.raises(UnsupportedModel, match="model type 'blt': its config gives no number of decoder layers") as err:
        Checkpoint(path)
    assert isinstance(err.value.__cause__, AttributeError)
    with pytest.raises(UnsupportedModel, match="'blt'"):
        read_config(path)


def test_weights_tied_between_layers_are_refused(tmp_path):
    """Zamba's hybrid layers share one attention block: a block's weights live in another block (and on disk
    only once), which used to escape as transformers' ValueError about `tie_weights_keys` when the head tied
    its weights."""
    config = AutoConfig.for_model("zamba", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256, attn_layer_period=3,
                                  attn_layer_offset=1, mamba_dt_rank=8, max_position_embeddings=256)
    assert config.tie_word_embeddings  # as released
    path = _save_tiny(config, tmp_path)
    with pytest.raises(UnsupportedModel, match=r"model type 'zamba' ties weights of its decoder layers .*"
                                               r"model\.layers\.4\.shared_transf.* is model\.layers\.2\.shared_transf"):
        Checkpoint(path)


def test_unreadable_configs_are_typed(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_family_yet", "num_hidden_layers": 2}')
    with pytest.raises(UnsupportedModel, match="model type 'no_such_family_yet' is not known to transformers"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not a JSON object") as err:
        Checkpoint(tmp_path)
    assert err.value.__cause__ is not None
    # a known type whose values transformers' own validation rejects
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}')
    with pytest.raises(CheckpointError, match="model type 'llama': transformers cannot read"):
        Checkpoint(tmp_path)


def test_missing_weights_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        Checkpoint(tmp_path)
    AutoConfig.for_model("llama", num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="safetensors"):
        Checkpoint(tmp_path)


def test_span_outside_the_model(tiny_checkpoint):
    with pytest.raises(BadRequest, match="outside"):
        SpanBlocks(tiny_checkpoint("llama"), Span(4, 7))


def test_truncated_checkpoint_names_the_block(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("llama")
    shutil.copytree(src, tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    tensors.pop("model.layers.3.mlp.down_proj.weight")
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    SpanBlocks(tmp_path / "ckpt", Span(0, 3))  # untouched blocks still load
    with pytest.raises(CheckpointError, match="block 3"):
        SpanBlocks(tmp_path / "ckpt", Span(2, 4))

    tensors.pop("model.embed_tokens.weight")
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensors .*embed_tokens"):
        ModelHead(tmp_path / "ckpt")


@pytest.mark.parametrize("model_type, expected", [
    ("llama", 2 * 32 * 128 * 4),  # the same for every block
    ("gemma4_text", 2 * 4 * 512 * 4),  # full-attention blocks' 512-wide heads, not the sliding ones' 256
    ("mamba", 0),  # a recurrent state, none per token
])
def test_a_peer_counts_the_cache_of_its_largest_block_per_token(model_type, expected):
    """What a peer reserves per cached token and block, read from the config of every kind of family (a config
    whose blocks differ has no single head width: transformers refuses to give one)."""
    class Config:  # only what the count reads
        text_config = AutoConfig.for_model(model_type).get_text_config(decoder=True)

    import torch

    assert Checkpoint.cache_bytes_per_token(Config(), torch.float32) == expected
