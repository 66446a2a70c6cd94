"""An honest generation beside strangers flooding the peers with large stateless forwards (demo model).

The demo swarm as `swarm demo` starts it (3 peers [0:10) [10:20) [20:30), float32) on 127.0.0.1. First one
`[rows, tokens]` stateless forward through all 30 blocks, hop by hop, from a stranger alone on the idle swarm
(median of `--runs`). Then an honest client generates `--new-tokens` greedy tokens (median of `--runs`), on
the idle swarm and while `--strangers` clients (each its own identity, in this process) send `[rows, tokens]`
forwards through the three peers in a loop, `--inflight` at once each. The ratio of the two generation times
is what a flood of forwards costs an honest session; the peers' fair compute queue is meant to keep it
bounded however many forwards the strangers send.

    python benchmarks/forward_flood.py [--strangers 4] [--rows 4] [--tokens 2048] [--new-tokens 16]

Writes its table into docs/benchmarks.md between its markers (`--section` names them).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine, write_section  # noqa: E402

from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

PROMPT = "Give three tips for staying healthy."
PEERS = ("peer0", "peer1", "peer2")


def log(message: str) -> None:
    print(f"[forward_flood] {message}", file=sys.stderr, flush=True)


def cpu_flags() -> str:
    """The CPU's model name and the vector extensions torch's kernels pick from (lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "lscpu not available"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{fields.get('Model name', '?').strip()}; {', '.join(wanted) or 'no avx2'}"


async def spans(node, net: LocalSwarm) -> list:
    from swarm.net.calls import info
    from swarm.span import Span

    hops = []
    for name in PEERS:
        about = await info(node, net.procs[name].peer_id)
        hops.append((net.procs[name].peer_id, Span(about.start, about.end), about.hidden_size))
    return hops


async def one_forward(node, hops: list, model_id: str, x: torch.Tensor) -> torch.Tensor:
    """`x` through every hop in turn, as `client.inference.forward` sends it."""
    from client.inference.peer_session import forward

    for peer, span, _ in hops:
        x = await forward(node, peer, model_id, span, x, timeout=600.0)
    return x


async def flood(node, hops: list, model_id: str, x: torch.Tensor, stop: threading.Event, done: list,
                took: list) -> None:
    """Forwards, one after another, until `stop`; each completed one's seconds go to `took`, refusals count in
    `done`."""
    from swarm.errors import SwarmError

    while not stop.is_set():
        started = time.perf_counter()
        try:
            await one_forward(node, hops, model_id, x)
            took.append(time.perf_counter() - started)
        except (SwarmError, asyncio.TimeoutError) as e:  # a refused forward (busy, timeout) is tried again
            done[0] += 1
            log(f"a stranger's forward failed: {e!r}")
            await asyncio.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strangers", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=1, help="forwards each stranger keeps in flight")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--section", default="forward_flood")
    parser.add_argument("--label", default="", help="said in the section's title (e.g. which code ran)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from client.demo import start_swarm
    from client.loop import LoopThread
    from client.model import DistributedModelForCausalLM
    from swarm.net.identity import Identity
    from swarm.net.transport import Node

    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def generation(model) -> float:
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    with tempfile.TemporaryDirectory(prefix="swarm-flood-") as root, LocalSwarm(Path(root)) as net, \
            LoopThread() as loop:
        start_swarm(net, path, len(PEERS), "float32", model_id)
        nodes = [Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True)
                 for _ in range(args.strangers + 1)]  # the last one times a forward alone
        for node in nodes:
            loop.run(node.__aenter__(), timeout=60)
        try:
            hops = loop.run(spans(nodes[-1], net), timeout=60)
            x = torch.randn(args.rows, args.tokens, hops[0][2])
            loop.run(one_forward(nodes[-1], hops, model_id, x[:1, :64]), timeout=600)  # warm
            alone = []
            for _ in range(args.runs):
                started = time.perf_counter()
                loop.run(one_forward(nodes[-1], hops, model_id, x), timeout=600)
                alone.append(time.perf_counter() - started)
            forward_s = statistics.median(alone)
            log(f"one [{args.rows}, {args.tokens}] forward alone: {forward_s:.2f} s")
            with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as model:
                model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm
                idle = generation(model)
                log(f"honest generation of {args.new_tokens} tokens, idle swarm: {idle:.2f} s")
                stop, done, took = threading.Event(), [0], []
                floods = [asyncio.run_coroutine_threadsafe(flood(node, hops, model_id, x, stop, done, took), loop.loop)
                          for node in nodes[:-1] for _ in range(args.inflight)]
                time.sleep(2.0)  # the forwards reach the peers' queues
                busy = generation(model)
                stop.set()
                for f in floods:
                    f.result(600)
            flooded_forward = statistics.median(took) if took else float("nan")
            log(f"honest generation under the flood: {busy:.2f} s ({busy / idle:.2f}x); strangers' forwards: "
                f"{len(took)} done (median {flooded_forward:.2f} s), {done[0]} refused")
        finally:
            for node in nodes:
                loop.run(node.__aexit__(None, None, None), timeout=30)
    title = "### Forward flood: an honest generation beside strangers' stateless forwards"
    lines = [title + (f" ({args.label})" if args.label else ""), "",
             f"Machine: {machine()}; {cpu_flags()}. Demo swarm (3 peers [0:10) [10:20) [20:30), default peer "
             f"options) on 127.0.0.1. `python benchmarks/forward_flood.py --strangers {args.strangers} --inflight "
             f"{args.inflight} --rows {args.rows} --tokens {args.tokens} --new-tokens {args.new_tokens} --runs "
             f"{args.runs}`: one `[{args.rows}, {args.tokens}]` stateless forward through all 30 blocks alone (median "
             f"of {args.runs}); an honest client's greedy generation of {args.new_tokens} tokens (median of "
             f"{args.runs}) on the idle swarm and while {args.strangers} strangers (an identity each) send such "
             f"forwards in a loop, {args.inflight} in flight each (their forwards' time: median of the {len(took)} run "
             f"from the start of the flood until the strangers stop after the generations; {done[0]} refused).", "",
             "| measure | seconds | ratio |", "|---|---|---|",
             f"| one `[{args.rows}, {args.tokens}]` forward, idle swarm | {forward_s:.2f} | 1.00x |",
             f"| a stranger's forward, under the flood (median) | {flooded_forward:.2f} | "
             f"{flooded_forward / forward_s:.2f}x |",
             f"| honest generation, idle swarm | {idle:.2f} | 1.00x |",
             f"| honest generation, under the flood | {busy:.2f} | {busy / idle:.2f}x |"]
    print(write_section(args.section, lines))


if __name__ == "__main__":
    main()
