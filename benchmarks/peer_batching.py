"""Aggregate decode throughput of one peer as the number of concurrent sessions grows (cross-session batching).

Starts a bootstrap and one peer serving all 30 blocks of the demo model (real processes on 127.0.0.1),
then, for each session count, opens that many sessions from this one client process, prefills each
with a different number of tokens, and lets every session decode one token per step, all at once
(one asyncio task per session, each sending its next step as soon as its last one returned). A round
is `--steps` steps of every session; the aggregate tokens/s of a round is sessions x steps / its wall
time. Reports the median over `--rounds` rounds and the ratio to one session. The peer shares one
forward among the one-token steps it has pending, so the ratio should grow with the sessions.

    python benchmarks/peer_batching.py [--sessions 1 4 8] [--steps 16] [--rounds 5] [--no-write | --out FILE]

Writes its table into docs/benchmarks.md (or FILE) between its markers; `main(argv)` is the same for
another harness.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from client.inference import peer_session  # noqa: E402
from client.loop import LoopThread  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.net.identity import Identity  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.span import Span  # noqa: E402
from swarm.net.transport import Node  # noqa: E402

MODEL_ID = "bench-batching"
WARMUP_STEPS = 3


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of the peer's `/metrics`."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def prompt_length(i: int) -> int:
    return 8 + 5 * i  # every session at a different position


async def measure(node: Node, peer: str, span: Span, hidden_size: int, sessions: int, steps: int,
                  rounds: int) -> list[float]:
    """Aggregate decode tokens/s of each round with `sessions` sessions decoding at once."""
    max_length = prompt_length(sessions) + WARMUP_STEPS + steps * rounds + 1
    opened = [await peer_session.PeerSession.open(node, peer, MODEL_ID, span, max_length=max_length)
              for _ in range(sessions)]
    try:
        x = torch.randn(1, 1, hidden_size)
        positions = []
        for i, s in enumerate(opened):
            await s.step(torch.randn(1, prompt_length(i), hidden_size), 0)
            positions.append(prompt_length(i))

        async def decode(i: int, n: int) -> None:
            for _ in range(n):
                await opened[i].step(x, positions[i])
                positions[i] += 1

        await asyncio.gather(*(decode(i, WARMUP_STEPS) for i in range(sessions)))
        rates = []
        for _ in range(rounds):
            started = time.perf_counter()
            await asyncio.gather(*(decode(i, steps) for i in range(sessions)))
            rates.append(sessions * steps / (time.perf_counter() - started))
        return rates
    finally:
        for s in opened:
            await s.close()


def run(counts: list[int], steps: int, rounds: int) -> dict[int, tuple[float, float]]:
    """Per session count: the median aggregate decode tokens/s, and the mean steps per forward."""
    path = prepare_demo_model(default_demo_dir(cache_home()))
    ckpt = Checkpoint(path)
    span = Span(0, ckpt.num_blocks)
    cache_tokens = max(counts) * (prompt_length(max(counts)) + WARMUP_STEPS + steps * rounds + 1)
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as root, LocalSwarm(Path(root)) as net:
        net.start_bootstrap()
        peer = net.start_peer("peer", path, "--blocks", f"0:{ckpt.num_blocks}", "--model-id", MODEL_ID,
                              "--cache-tokens", str(cache_tokens), "--max-sessions", str(max(counts) + 1),
                              "--metrics-port", "0", timeout=300)
        url = net.metrics_url(peer)
        with LoopThread() as lt:
            async def main() -> dict[int, tuple[float, float]]:
                async with Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True) as node:
                    hidden_size = (await peer_session.info(node, peer.peer_id)).hidden_size
                    results = {}
                    for n in counts:
                        before = scrape(url)
                        rates = await measure(node, peer.peer_id, span, hidden_size, n, steps, rounds)
                        after = scrape(url)
                        delta = {k: after[k] - before.get(k, 0.0) for k in after}
                        forwards = (delta["swarm_peer_steps_total"] - delta["swarm_peer_batch_size_sum"]
                                    + delta["swarm_peer_batch_size_count"])
                        results[n] = statistics.median(rates), delta["swarm_peer_steps_total"] / forwards
                        print(f"{n} sessions: {results[n][0]:.1f} tokens/s, {results[n][1]:.2f} steps per forward "
                              f"(rounds: {', '.join(f'{r:.1f}' for r in rates)})", flush=True)
                    return results

            return lt.run(main(), timeout=3600)


def main(argv: list[str] | None = None) -> dict[int, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8], help="concurrent session counts")
    ap.add_argument("--steps", type=int, default=16, help="decode steps of every session per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--out", type=Path, help="write the section into this file instead of docs/benchmarks.md")
    args = ap.parse_args(argv)
    counts = sorted(set(args.sessions))
    if counts[0] < 1:
        ap.error("--sessions must be positive")
    results = run(counts, args.steps, args.rounds)
    base = results[counts[0]][0] / counts[0]
    lines = ["## Cross-session batching on one peer (demo model)", "",
             f"`python benchmarks/peer_batching.py --sessions {' '.join(map(str, counts))} --steps {args.steps} "
             f"--rounds {args.rounds}` on {machine()}. One peer process serves all 30 blocks of SmolLM2-135M; "
             "one client process runs the sessions at once, each prefilled to a different length, then decoding "
             f"one token per step; aggregate tokens/s of a round of {args.steps} steps per session, median of "
             f"{args.rounds} rounds. Client, peer and their transport daemons share the machine's cores. *Steps "
             "per forward*: the peer's session steps over its forwards (prefills included).", "",
             "| sessions | aggregate decode tokens/s | per session | vs one session | steps per forward |",
             "|---|---|---|---|---|"]
    for n, (rate, per_forward) in results.items():
        lines.append(f"| {n} | {rate:.1f} | {rate / n:.1f} | {rate / base:.2f}x | {per_forward:.2f} |")
    print("\n".join(lines) if args.no_write else write_section("peer_batching", lines, args.out))
    return results


if __name__ == "__main__":
    main()
