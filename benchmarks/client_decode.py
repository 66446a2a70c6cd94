"""Generation through a local swarm against transformers locally, and failover stalls, on the demo model.

Starts a bootstrap and three peers (real processes on 127.0.0.1) serving the demo model's blocks
[0:10), [10:20), [20:30), loads the SDK and transformers' own model in this process, and alternates
runs of the same greedy generation (`--tokens` new tokens, no early stop) between them. Reports the
medians of time to first token and decode tokens per second.

Then adds replicas of [10:20) and, for each trial, faults the peer the running generation uses for
block 10 after 16 tokens: SIGKILL, or SIGSTOP (resumed afterwards). Reports the stall (from sending the
step that failed to its output from the new peers), the longest gap between two tokens, and whether the
tokens equal the no-fault run.

    python benchmarks/client_decode.py [--tokens 64] [--runs 5] [--trials 3]

Writes its tables into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from client.cli import TimedStreamer  # noqa: E402
from client.demo import DEMO_CACHE_TOKENS, start_swarm  # noqa: E402
from client.model import DistributedModelForCausalLM  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

PROMPT = "Give three tips for staying healthy."
FAULT_AFTER = 16


def timed(model, tokenizer, ids, tokens: int, streamer=None) -> tuple[list[int], dict]:
    streamer = streamer or TimedStreamer(tokenizer, out=io.StringIO())
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, streamer=streamer)
    return out[0].tolist(), streamer.stats(started)


class FaultStreamer(TimedStreamer):
    def __init__(self, tokenizer, net: LocalSwarm, model, sig: int):
        super().__init__(tokenizer, out=io.StringIO())
        self.net, self.model, self.sig, self.victim, self.session = net, model, sig, None, None

    def put(self, value) -> None:
        super().put(value)
        if len(self.times) == FAULT_AFTER and self.victim is None:
            self.session = self.model.active_session
            peer = next(h.peer for h in self.session.route if h.span.start <= 10 < h.span.end)
            self.victim = next(n for n, p in self.net.procs.items() if p.peer_id == peer and p.alive())
            os.kill(self.net.procs[self.victim].popen.pid, self.sig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3, help="faults of each kind")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", model_id)
        with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs) as remote:
            timed(remote, tokenizer, ids, 8), timed(local, tokenizer, ids, 8)  # warm-up: routes, pings, first-call setup
            results: dict[str, list[dict]] = {"swarm": [], "local": []}
            reference = None
            for _ in range(args.runs):
                tokens, stats = timed(remote, tokenizer, ids, args.tokens)
                results["swarm"].append(stats)
                local_tokens, stats = timed(local, tokenizer, ids, args.tokens)
                results["local"].append(stats)
                reference = reference or local_tokens
                assert tokens == local_tokens, "the swarm's greedy tokens differ from local transformers"

            stalls = {"SIGKILL": [], "SIGSTOP": []}
            for k in range(2):
                net.start_peer(f"replica{k}", path, "--blocks", "10:20", "--model-id", model_id,
                               "--cache-tokens", str(DEMO_CACHE_TOKENS))
            for trial in range(args.trials):
                for name, sig in (("SIGSTOP", signal.SIGSTOP), ("SIGKILL", signal.SIGKILL)):
                    streamer = FaultStreamer(tokenizer, net, remote, sig)
                    tokens, _ = timed(remote, tokenizer, ids, args.tokens, streamer)
                    victim = net.procs[streamer.victim]
                    if sig == signal.SIGSTOP:
                        os.kill(victim.popen.pid, signal.SIGCONT)
                    else:
                        victim.popen.wait(10)
                        net.start_peer(f"replica-new{trial}", path, "--blocks", "10:20", "--model-id", model_id,
                                       "--cache-tokens", str(DEMO_CACHE_TOKENS))
                    gaps = [b - a for a, b in zip(streamer.times, streamer.times[1:])]
                    stalls[name].append({"stall": sum(f.stall_s for f in streamer.session.failovers),
                                         "gap": max(gaps), "same": tokens == reference,
                                         "failovers": len(streamer.session.failovers)})
                    print(name, stalls[name][-1], flush=True)

    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ttft_s", "tokens_per_s")} for k, v in results.items()}
    lines = ["## Generation through three local peers vs transformers locally (demo model)", "",
             f"`python benchmarks/client_decode.py --tokens {args.tokens} --runs {args.runs} --trials {args.trials}` "
             f"on {machine()}. SmolLM2-135M-Instruct (30 blocks); peers serve [0:10), [10:20), [20:30) as "
             f"separate processes on 127.0.0.1; greedy, {args.tokens} new tokens, runs alternated in one process; "
             "medians. The swarm's tokens equal local transformers' in every run.", "",
             "| | time to first token (ms) | decode tokens/s |", "|---|---|---|",
             f"| swarm, 3 peers | {med['swarm']['ttft_s'] * 1e3:.0f} | {med['swarm']['tokens_per_s']:.1f} |",
             f"| transformers, local | {med['local']['ttft_s'] * 1e3:.0f} | {med['local']['tokens_per_s']:.1f} |",
             f"| ratio | | {med['swarm']['tokens_per_s'] / med['local']['tokens_per_s']:.2f}x |", "",
             f"Failover: with two replicas of [10:20), the peer in use for block 10 is faulted after {FAULT_AFTER} "
             f"tokens; {args.trials} trials each. Steps are chained (the client's default): a frozen peer costs its "
             "deadline, then a 0.5 s info probe, then the failover.", "",
             "| fault | stall, median (s) | stall, max (s) | longest gap between tokens (s) | tokens same as no fault |",
             "|---|---|---|---|---|"]
    for name, rows in stalls.items():
        lines.append(f"| {name} | {statistics.median(r['stall'] for r in rows):.2f} | "
                     f"{max(r['stall'] for r in rows):.2f} | {max(r['gap'] for r in rows):.2f} | "
                     f"{sum(r['same'] for r in rows)}/{len(rows)} |")
    print("\n".join(lines) if args.no_write else write_section("client_decode", lines))


if __name__ == "__main__":
    main()
