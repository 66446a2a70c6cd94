"""Unequal machines on one box: aggregate tokens/s of 8 concurrent sessions with the new placement, against
equal spans and against the placement peers used before (by count of peers per block), for every start
order of the three peers.

Three peers of the demo model (30 blocks), each held to a CPU quota (cgroup v1, root; by default 40%, 20%
and 10% of one core, the ratio 4:2:1; `--quotas`), so that the peers and not the client are the
bottleneck on a 2-core machine. (At 20/10/5% one round of the equal spans took 280 s here: 8 x 32
tokens at 0.9 tokens/s.)
Each peer runs one compute thread (`OMP_NUM_THREADS=1`): a peer held to a share of one core is a one-core
machine, and two threads under a quota spin and burn it (one block's decode step of the demo model at
10% of a core: 27 ms with one thread, 65 ms with two). Each peer's memory budget holds 20 blocks.
Placements:
- `equal`: `--blocks 0:10`, `10:20`, `20:30` (independent of start order: measured once);
- `ideal`: capacity-proportional spans from the block costs the peers measured in the `equal` run (each
  peer's share of the 30 blocks in proportion to its speed, at most 20, rounded so that the slowest
  stage is as quick as it can be), pinned, measured once;
- `count` (before this work): each peer, in start order, took as many blocks as fit (20) in the window
  whose least-served block had the fewest peers, then the fewest in total, then the lowest start (the
  rule is re-done here to pin the spans with `--blocks`);
- `new`: no `--blocks`; the peers measure their speed under their quota, choose and rebalance by
  themselves (`peer/placement.py`); the run starts once no peer has claimed blocks for two
  re-evaluation periods.
Every peer runs with the default options but `--rebalance-interval 15` (60 by default), so that each start
order settles in a minute or two.
Then `swarm api` in front, and 8 streaming clients (threads, the `openai` package) each send one
greedy 32-token request at once (`--rounds` times); aggregate tokens/s = tokens generated / wall time
of the round, and one session's tokens/s = its tokens / its own time (median session); medians over the
rounds. Each row also gives how many tokens of the rounds each peer ran through its blocks (its
`swarm_peer_tokens` counter): where the work went.

    sudo python benchmarks/heterogeneous.py [--orders rotations|all|N] [--rounds 1] [--quotas 0.4 0.2 0.1]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from api_load import round_of  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm, cpu_quota_supported, wait_until  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

import torch  # noqa: E402

QUOTAS = {"fast": 0.40, "mid": 0.20, "slow": 0.10}
MEMORY_BLOCKS = 20
CACHE_TOKENS = 2048
CLIENTS = 8
TOKENS = 32
# The peers' options are the defaults but for a re-evaluation every 15 s instead of 60, so that a start order
# settles within a minute or two (what a peer spends on reading the swarm is what it spends by default).
REBALANCE_S = 15
OPTIONS = ("--cache-tokens", str(CACHE_TOKENS), "--rebalance-interval", str(REBALANCE_S), "--max-sessions", "32",
           "--metrics-port", "0")
PEER_ENV = {"OMP_NUM_THREADS": "1"}
TOKENS_LINE = re.compile(r"^swarm_peer_tokens_total\s+(\S+)", re.M)


def count_rule(order: tuple[str, ...], num_blocks: int, n: int) -> dict[str, tuple[int, int]]:
    """The placement peers used before: per start order, the window of `n` blocks whose least-served block
    has the fewest peers, then the fewest in total, then the lowest start."""
    counts, spans = [0] * num_blocks, {}
    for name in order:
        start = min(range(num_blocks - n + 1), key=lambda s: (min(counts[s:s + n]), sum(counts[s:s + n]), s))
        spans[name] = (start, start + n)
        for b in range(start, start + n):
            counts[b] += 1
    return spans


def proportional(costs: dict[str, float], num_blocks: int, memory: int) -> dict[str, tuple[int, int]]:
    """Spans in proportion to speed (1 / cost), at most `memory` blocks each: blocks are handed out one at a
    time to the peer whose stage would stay quickest, so the slowest stage is as quick as it can be."""
    counts = dict.fromkeys(costs, 1)
    for _ in range(num_blocks - len(costs)):
        name = min((n for n in costs if counts[n] < memory), key=lambda n: ((counts[n] + 1) * costs[n], n))
        counts[name] += 1
    spans, start = {}, 0
    for name in costs:
        spans[name] = (start, start + counts[name])
        start += counts[name]
    return spans


def peer_tokens(url: str) -> float:
    found = TOKENS_LINE.search(urllib.request.urlopen(url, timeout=10).read().decode())
    return float(found.group(1)) if found else 0.0


def budget(path: Path, blocks: int) -> str:
    ckpt = Checkpoint(path)
    per_block = ckpt.block_bytes(0, torch.float32) + CACHE_TOKENS * ckpt.cache_bytes_per_token(torch.float32)
    return str(int((blocks + 0.5) * per_block))


def run(path: Path, model_id: str, order: tuple[str, ...], placement: str, rounds: int, root: Path,
        pinned: dict[str, tuple[int, int]] | None = None) -> dict:
    num_blocks = Checkpoint(path).num_blocks
    pinned = pinned or {"equal": {"fast": (0, 10), "mid": (10, 20), "slow": (20, 30)},
                        "count": count_rule(order, num_blocks, MEMORY_BLOCKS)}.get(placement)
    with LocalSwarm(root) as net:
        net.start_bootstrap()
        for name in order:
            extra = ["--blocks", "%d:%d" % pinned[name]] if pinned else ["--memory-budget", budget(path, MEMORY_BLOCKS)]
            proc = net.start_peer(name, path, "--model-id", model_id, "--capacity-cache",
                                  str(root / f"{name}-capacity.json"), *OPTIONS, *extra, wait=False, env=PEER_ENV)
            wait_until(lambda: "measuring what a block" in proc.text() or not proc.alive(), 120, f"{name} to join",
                       diagnostics=proc.text)
            net.throttle(proc, QUOTAS[name])
            net.wait_serving(proc, timeout=600)
        if placement == "new":  # settled: no claim or move logged for two re-evaluation periods
            seen = {"events": -1, "at": time.monotonic()}

            def quiet():
                events = sum(net.procs[n].text().count("claiming them") for n in order)
                if events != seen["events"]:
                    seen.update(events=events, at=time.monotonic())
                return time.monotonic() - seen["at"] > 2 * REBALANCE_S

            wait_until(quiet, 600, "the peers to settle", interval=1.0)
        spans = {n: net.procs[n].span() for n in order}
        moves = sum(net.procs[n].text().count(" moved from ") for n in order)
        url = net.start_api("api", path, "--max-generations", str(CLIENTS)).extra["url"]
        metrics = {n: net.metrics_url(net.procs[n]) for n in order}
        round_of(url, model_id, 2, 1, 4)  # warm-up: routes measured
        before = {n: peer_tokens(u) for n, u in metrics.items()}
        results, failed = [], None
        for _ in range(rounds):
            try:
                results.append(round_of(url, model_id, CLIENTS, 1, TOKENS))
            except RuntimeError as e:  # requests failed: the row says so, and counts as 0 tokens/s
                failed = str(e)
                results.append({"tokens_per_s": 0.0, "total_median": math.inf})
        work = {n: peer_tokens(u) - before[n] for n, u in metrics.items()}
        spans_after = {n: net.procs[n].span() for n in order}
        costs = {}
        for n in order:
            try:
                costs[n] = next(iter(json.loads((root / f"{n}-capacity.json").read_text()).values()))["decode_ms"]
            except (OSError, ValueError, StopIteration, KeyError):
                costs[n] = None
    return {"order": order, "placement": placement, "spans": spans, "moves": moves, "costs": costs,
            "aggregate": statistics.median(r["tokens_per_s"] for r in results),
            "session": statistics.median(TOKENS / r["total_median"] for r in results),
            "failed": failed, "spans_after": spans_after,
            "work": work}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", default="rotations", help="'rotations' (each peer started first once), "
                        "'all' six start orders, or how many of them")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quotas", type=float, nargs=3, default=list(QUOTAS.values()),
                        help="CPU shares of one core of the fast, mid and slow peers")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))  # leave no peer running, no cgroup behind
    QUOTAS.update(zip(("fast", "mid", "slow"), args.quotas))
    if not cpu_quota_supported():
        sys.exit("needs root and the cgroup v1 cpu controller (/sys/fs/cgroup/cpu)")
    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    orders = list(itertools.permutations(("fast", "mid", "slow")))
    if args.orders == "rotations":
        orders = [("fast", "mid", "slow"), ("mid", "slow", "fast"), ("slow", "fast", "mid")]
    elif args.orders != "all":
        orders = orders[:int(args.orders)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-hetero-") as tmp:
        def go(order, placement, pinned=None):
            row = run(path, model_id, order, placement, args.rounds, Path(tmp) / f"{placement}-{'-'.join(order)}",
                      pinned)
            rows.append(row)
            print(f"{placement:6} {'/'.join(order):15} {row['aggregate']:.2f} tokens/s aggregate, "
                  f"{row['session']:.2f} one session; spans {row['spans']}, moves {row['moves']}, "
                  f"tokens per peer {work(row)}, block ms {row['costs']}"
                  + (f"; spans after the round {row['spans_after']}" if row["spans_after"] != row["spans"] else "")
                  + (f"; FAILED: {row['failed']}" if row["failed"] else ""), flush=True)
            return row

        equal = go(orders[0], "equal")
        if not all(equal["costs"].get(n) for n in QUOTAS):
            sys.exit(f"the peers of the equal run left no measured block cost: {equal['costs']}")
        ideal = go(orders[0], "ideal", proportional({n: equal["costs"][n] for n in QUOTAS}, 30, MEMORY_BLOCKS))
        table = []
        for order in orders:
            count, new = go(order, "count"), go(order, "new")
            table.append((order, count, new))
    costs = equal["costs"]
    lines = [
        "### Unequal machines: placement by measured speed",
        "",
        f"Machine: {machine()}. Demo model (30 blocks), three peers held to "
        f"{', '.join(f'{q:.0%}' for q in QUOTAS.values())} of one core (fast, mid, slow: cgroup CPU quotas, "
        f"4:2:1), one compute thread each, memory for {MEMORY_BLOCKS} blocks each; `swarm api` in front; {CLIENTS} "
        f"concurrent greedy {TOKENS}-token streaming requests, median of {args.rounds} round(s). The peers "
        f"measured {', '.join(f'{costs[n]:.1f}' for n in QUOTAS)} ms per decode step per block "
        f"(1 : {costs['mid'] / costs['fast']:.1f} : {costs['slow'] / costs['fast']:.1f}). `ideal`: spans in "
        "proportion to those speeds, pinned. `count`: the placement before this work (peers per block, by "
        "start order), pinned. `new`: the peers placed and rebalanced themselves. Tokens per peer: what each "
        "peer ran through its blocks in the round(s) (fast/mid/slow).",
        "",
        "| placement | spans | aggregate tokens/s | vs equal | one session tokens/s | tokens per peer |",
        "|---|---|---|---|---|---|",
        *(f"| {r['placement']} | {fmt(r['spans'])} | {r['aggregate']:.2f} | {r['aggregate'] / equal['aggregate']:.2f}x "
          f"| {r['session']:.2f} | {work(r)} |" for r in (equal, ideal)),
        "",
        "| start order | count: spans | count tok/s | new: spans (moves) | new tok/s | new / equal | new / count | "
        "one session, new | tokens per peer, new |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {'/'.join(o)} | {fmt(c['spans'])}{note(c)} | {c['aggregate']:.2f} | {fmt(n['spans'])} ({n['moves']}){note(n)} | "
          f"{n['aggregate']:.2f} | {n['aggregate'] / equal['aggregate']:.2f}x | {n['aggregate'] / c['aggregate']:.2f}x | "
          f"{n['session']:.2f} | {work(n)} |" for o, c, n in table),
        "",
        f"Median new / equal: {statistics.median(n['aggregate'] for _, _, n in table) / equal['aggregate']:.2f}x; "
        f"median new / count: {statistics.median(n['aggregate'] / c['aggregate'] for _, c, n in table):.2f}x.",
        "",
        f"Command: `.venv/bin/python benchmarks/heterogeneous.py --orders {args.orders} --rounds {args.rounds} "
        f"--quotas {' '.join(map(str, args.quotas))}`",
    ]
    print(write_section("heterogeneous", lines))


def note(row: dict) -> str:
    """What changed or went wrong during the row's rounds."""
    text = f"; after the round: {fmt(row['spans_after'])}" if row["spans_after"] != row["spans"] else ""
    return text + (f"; **failed**: {row['failed'][:160]}" if row["failed"] else "")


def work(row: dict) -> str:
    return "/".join(f"{row['work'].get(n, 0):.0f}" for n in QUOTAS)


def fmt(spans: dict) -> str:
    return " ".join(f"{n} `[{s[0]}:{s[1]})`" if s else f"{n} ?" for n, s in spans.items())


if __name__ == "__main__":
    main()
