"""Time to first token through the swarm against transformers locally, on the demo prompt and a 1,000-token
prompt.

The demo model on a bootstrap and 3 peers on 127.0.0.1 ([0:10) [10:20) [20:30), one compute thread each, as
`swarm demo` starts them); the SDK's `generate()` and transformers' own in this process, runs interleaved,
medians of `--runs` (a first round warms routes and is not counted). Time to first token is from calling
`generate()` to the first new token reaching the streamer: route finding, opening the sessions, the prompt
through every peer and the LM head. Rows:

- `swarm`: the client's defaults (sessions opened at once, the prompt step chained, a long prompt in chunks of
  `prefill_chunk` tokens that the peers work on at the same time, logits of the last position only);
- `swarm, prompt in one step`: `prefill_chunk=0`;
- `swarm, logits of every prompt position`: what `generate` cost before it asked for the last position only.

The swarm's tokens must equal transformers' in every run, or the command fails.

    python benchmarks/first_token.py [--runs 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import demo_model, machine, write_section  # noqa: E402

LONG_TOKENS = 1000


def main() -> int:
    import torch

    from client.cli import TimedStreamer
    from client.commands import DEFAULT_PROMPT
    from client.demo import start_swarm
    from client.model import DistributedModelForCausalLM
    from swarm.local.launch import LocalSwarm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path, model_id, tokenizer, local = demo_model()
    prompts = {
        "demo prompt": tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}],
                                                     add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"],
        f"{LONG_TOKENS}-token prompt": tokenizer((REPO / "tests/data/english.txt").read_text(),
                                                  return_tensors="pt")["input_ids"][:, :LONG_TOKENS],
    }
    ways = ("transformers", "swarm", "swarm, prompt in one step", "swarm, logits of every prompt position")
    ttft: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="swarm-ttft-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", model_id)
        with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as remote:
            config = remote.connection.client.config
            for run in range(args.runs + 1):
                for name, ids in prompts.items():
                    want = None
                    for way in ways:
                        model = local if way == "transformers" else remote
                        remote.connection.client.config = dataclasses.replace(
                            config, prefill_chunk=0 if "one step" in way else config.prefill_chunk)
                        extra = {"logits_to_keep": 0} if "every" in way else {}
                        streamer = TimedStreamer(tokenizer, out=io.StringIO())
                        started = time.perf_counter()
                        with torch.no_grad():
                            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                                 do_sample=False, pad_token_id=0, streamer=streamer, **extra)
                        if want is None:
                            want = out.tolist()
                        elif out.tolist() != want:
                            raise SystemExit(f"{way}, {name}: tokens differ from transformers'")
                        if run:
                            ttft.setdefault((name, way), []).append(streamer.stats(started)["ttft_s"] * 1e3)
                    print(f"[ttft] run {run} {name}: " + ", ".join(
                        f"{w} {ttft[(name, w)][-1]:.0f} ms" for w in ways if run), file=sys.stderr, flush=True)
            remote.connection.client.config = config
    med = {k: statistics.median(v) for k, v in ttft.items()}
    lines = ["### Time to first token", "",
             f"Machine: {machine()}. Demo model on a bootstrap and 3 peers [0:10) [10:20) [20:30) on 127.0.0.1 (one "
             "compute thread each, as `swarm demo` starts them); the SDK's `generate()` and transformers' in one "
             "process (two threads), greedy, runs interleaved, median of "
             f"{args.runs}; from calling `generate()` to the first new token at the streamer (route, sessions, "
             "prompt, LM head); the same tokens as transformers in every run "
             f"(`python benchmarks/first_token.py --runs {args.runs}`). A prompt under twice `prefill_chunk` (256 "
             "tokens) runs in one step in both of the first two swarm columns: their difference there is noise.", "",
             "| prompt | tokens | " + " | ".join(f"{w} (ms)" for w in ways) + " | swarm vs transformers |",
             "|---|---|" + "---|" * len(ways) + "---|"]
    for name, ids in prompts.items():
        lines.append(f"| {name} | {ids.shape[1]} | " + " | ".join(f"{med[(name, w)]:.0f}" for w in ways) +
                     f" | {med[(name, 'swarm')] / med[(name, 'transformers')]:.2f}x |")
    print("\n".join(lines) if args.no_write else write_section("first_token", lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
