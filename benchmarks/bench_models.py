"""The models the swarm benchmark runs, with their prompts and default swarm shapes.

- `demo`: the demo model (SmolLM2-135M-Instruct, 30 blocks), prompted through its chat template;
- `large`: a random-weight Llama-shaped checkpoint (hidden 2048, 16 blocks, intermediate 5632, 16 heads,
  4 KV heads, vocab 32000, float32, about 3.4 GB), built once with a fixed seed and cached;
- `tiny`: the tests' tiny random llama (6 blocks, hidden 64), built fresh in the run's directory.

Invariants: a cached `large` checkpoint is complete (built in a hidden sibling, renamed into place);
random-weight models are prompted with fixed token ids, so no tokenizer is needed.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

LARGE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
LARGE_SEED = 0
DEMO_PROMPT = "Give three tips for staying healthy."
PROMPT_TOKENS = 24  # of the random-weight models' prompts


@dataclass(frozen=True)
class BenchModel:
    name: str
    path: Path
    prompt: torch.Tensor  # [1, tokens] input ids
    spans: tuple[str, ...]  # default swarm shape: one "start:end" per peer
    about: str  # one line for the report


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def fixed_prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))


def build_large(directory: Path) -> Path:
    """The `large` checkpoint in `directory`, built and saved on first use (progress on stderr)."""
    if (directory / "config.json").exists():
        return directory
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.monotonic()
    partial = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    config = AutoConfig.for_model("llama", **LARGE)
    log(f"building the large random model (seed {LARGE_SEED}) into {directory}: initialising weights")
    torch.manual_seed(LARGE_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    log(f"{n / 1e6:.0f}M parameters initialised in {time.monotonic() - started:.0f} s; saving safetensors")
    model.save_pretrained(partial, max_shard_size="1GB")
    del model
    partial.rename(directory)
    size = sum(f.stat().st_size for f in directory.iterdir()) / 2**30
    log(f"large model ready in {time.monotonic() - started:.0f} s ({size:.1f} GiB)")
    return directory


def spans_of(num_blocks: int, peers: int) -> tuple[str, ...]:
    from swarm.span import split_evenly

    return tuple(f"{s.start}:{s.end}" for s in split_evenly(num_blocks, peers))


def load(name: str, workdir: Path) -> BenchModel:
    """The benchmark model `name`; `workdir` holds what is built fresh for one run."""
    from swarm.cli import cache_home

    if name == "demo":
        from transformers import AutoTokenizer

        from swarm.local.demo_model import default_demo_dir, prepare_demo_model

        path = prepare_demo_model(default_demo_dir(cache_home()))
        tokenizer = AutoTokenizer.from_pretrained(path)
        text = tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}], tokenize=False,
                                             add_generation_prompt=True)
        return BenchModel(name, path, tokenizer(text, return_tensors="pt").input_ids, spans_of(30, 3),
                          "SmolLM2-135M-Instruct (30 blocks, hidden 576), the demo model; chat prompt "
                          f"{DEMO_PROMPT!r}")
    if name == "large":
        path = build_large(Path(cache_home()) / "models" / "bench-large-llama-h2048-l16")
        return BenchModel(name, path, fixed_prompt(LARGE["vocab_size"]), ("0:6", "6:11", "11:16"),
                          "random-weight Llama shape (16 blocks, hidden 2048, intermediate 5632, 16 heads, 4 KV "
                          f"heads, vocab 32000, 0.85B parameters); {PROMPT_TOKENS} fixed prompt token ids")
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import COMMON, build_tiny_checkpoint

        path = build_tiny_checkpoint("llama", workdir / "tiny-llama")
        return BenchModel(name, path, fixed_prompt(COMMON["vocab_size"]), spans_of(COMMON["num_hidden_layers"], 2),
                          f"the tests' tiny random llama (6 blocks, hidden 64); {PROMPT_TOKENS} fixed prompt token ids")
    raise ValueError(f"unknown model {name!r}: demo, large or tiny")
