"""Checkpoints that cannot be split into blocks fail early, with a message naming the model type."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from swarm.model.blocks import SpanBlocks
from swarm.model.checkpoint import Checkpoint
from swarm.model.head import ModelHead
from swarm.errors import BadRequest, CheckpointError, UnsupportedModel
from swarm.span import Span

pytestmark = pytest.mark.models


@pytest.mark.parametrize("model_type", ["t5", "bart", "deepseek_v32"])
def test_unsupported_architectures_are_named(model_type, tmp_path):
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never reached: refused on the config alone
    with pytest.raises(UnsupportedModel) as err:
        Checkpoint(tmp_path)
    message = str(err.value)
    assert repr(model_type) in message
    assert "docs/models.md" in message


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
