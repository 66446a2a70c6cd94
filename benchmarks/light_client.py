"""The light client (py-libp2p, no daemon) against the full client (a DHT node on hivemind's p2pd), on the
demo swarm, in one run.

A bootstrap and 3 peers of the demo model on 127.0.0.1; each client runs in a fresh process of its own per
run (the light one must not share a process with hivemind), alternating, greedy, `--tokens` new tokens.
Measured in the client's process:
- time to join: from creating the model object (the head already loaded) to its first route;
- time to first token: from calling `generate()` to the first new token;
- decode tokens/s: tokens after the first over the time from the first to the last;
- per-hop overhead: each one-token step's time in `InferenceSession.step` minus the compute the peers
  report for it, divided by the hops; median over the decode steps.
Medians over `--runs`. Writes its table into docs/benchmarks.md.

    python benchmarks/light_client.py [--runs 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine, write_section  # noqa: E402

PROMPT = "Give three tips for staying healthy."

CLIENT = r'''
import json, statistics, sys, time
import torch
from transformers import AutoTokenizer
from client.model import DistributedModelForCausalLM
from client.inference.session import InferenceSession
path, transport, tokens, addrs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
tokenizer = AutoTokenizer.from_pretrained(path)
ids = tokenizer.apply_chat_template([{"role": "user", "content": %r}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
overheads, original = [], InferenceSession.step

async def timed_step(self, hidden, position=None, attention_mask=None):
    started = time.perf_counter()
    out = await original(self, hidden, position, attention_mask)
    if hidden.shape[1] == 1:
        compute = sum(link.session.last_compute_ms for link in self.links)
        overheads.append(((time.perf_counter() - started) * 1e3 - compute) / len(self.links))
    return out

InferenceSession.step = timed_step  # a measurement wrapper of this benchmark process only
times = []

class Streamer:
    first = True
    def put(self, value):
        if self.first:
            self.first = False
        else:
            times.append(time.perf_counter())
    def end(self):
        pass

t0 = time.perf_counter()
with DistributedModelForCausalLM.from_pretrained(path, addrs, transport=transport, verify_fraction=0) as model:
    model.route()
    joined = time.perf_counter() - t0
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, streamer=Streamer())
print(json.dumps({"tokens": out[0].tolist(), "join_s": joined, "ttft_s": times[0] - started,
                  "decode_tps": (len(times) - 1) / (times[-1] - times[0]),
                  "overhead_ms": statistics.median(overheads), "hivemind": "hivemind" in sys.modules}))
''' % PROMPT


def run_client(path: Path, transport: str, tokens: int, addrs: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT, str(path), transport, str(tokens), *addrs],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"{transport} client failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    from client.demo import start_swarm
    from swarm.cli import cache_home
    from swarm.local.demo_model import default_demo_dir, prepare_demo_model
    from swarm.local.launch import LocalSwarm
    from swarm.weights.models import local_model_id

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    names = {"p2pd": "full client (hivemind's p2pd)", "libp2p": "light client (py-libp2p)"}
    results: dict[str, list[dict]] = {t: [] for t in names}
    with tempfile.TemporaryDirectory(prefix="swarm-light-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", local_model_id(path))
        for run in range(args.runs + 1):  # the first round warms the peers; not counted
            for transport in names:
                got = run_client(path, transport, args.tokens, net.bootstrap_addrs)
                if transport == "libp2p" and got["hivemind"]:
                    raise SystemExit("the light client imported hivemind")
                if run:
                    results[transport].append(got)
                print(f"[light] run {run} {transport}: join {got['join_s']:.2f} s, first token "
                      f"{got['ttft_s'] * 1e3:.0f} ms, {got['decode_tps']:.1f} tokens/s, hop overhead "
                      f"{got['overhead_ms']:.2f} ms", file=sys.stderr, flush=True)
    tokens = {t: {tuple(r["tokens"]) for r in rs} for t, rs in results.items()}
    if len(tokens["p2pd"] | tokens["libp2p"]) != 1:
        raise SystemExit("the two clients' tokens differ")
    med = {t: {k: statistics.median(r[k] for r in rs) for k in ("join_s", "ttft_s", "decode_tps", "overhead_ms")}
           for t, rs in results.items()}
    lines = ["### The light client against the full client", "",
             f"Machine: {machine()}. Demo model on a bootstrap and 3 peers on 127.0.0.1; each client in a fresh "
             f"process per run, alternating, greedy, {args.tokens} new tokens, the same tokens from both; medians "
             f"of {args.runs} (`python benchmarks/light_client.py --runs {args.runs} --tokens {args.tokens}`).", "",
             "| client | time to join (s) | time to first token (ms) | decode tokens/s | per-hop overhead (ms) |",
             "|---|---|---|---|---|"]
    for t, name in names.items():
        m = med[t]
        lines.append(f"| {name} | {m['join_s']:.2f} | {m['ttft_s'] * 1e3:.0f} | {m['decode_tps']:.1f} | "
                     f"{m['overhead_ms']:.2f} |")
    light, full = med["libp2p"], med["p2pd"]
    lines.append(f"| light / full | {light['join_s'] / full['join_s']:.2f}x | {light['ttft_s'] / full['ttft_s']:.2f}x "
                 f"| {light['decode_tps'] / full['decode_tps']:.2f}x | |")
    print("\n".join(lines) if args.no_write else write_section("light_client", lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
