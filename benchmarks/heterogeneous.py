"""Unequal machines on one box: aggregate tokens/s of 8 concurrent sessions with the new placement, against
equal spans and against the placement peers used before (by count of peers per block), for every start
order of the three peers.

Three peers of the demo model (30 blocks), each held to a CPU quota (cgroup v1, root; by default 40%, 20%
and 10% of one core, the ratio 4:2:1; `--quotas`), so that the peers and not the client are the
bottleneck on a 2-core machine. (At 20/10/5% one round of the equal spans took 280 s here: 8 x 32
tokens at 0.9 tokens/s.)
Each peer's memory budget holds 20 blocks. Placements:
- `equal`: `--blocks 0:10`, `10:20`, `20:30` (independent of start order: measured once);
- `count` (before this work): each peer, in start order, took as many blocks as fit (20) in the window
  whose least-served block had the fewest peers, then the fewest in total, then the lowest start (the
  rule is re-done here to pin the spans with `--blocks`);
- `ideal`: capacity-proportional spans `[0:17) [17:26) [26:30)` (4:2:1), pinned, measured once;
- `new`: no `--blocks`; the peers measure their speed under their quota, choose and rebalance by
  themselves (`swarm/placement.py`); the run starts once no peer has moved for 12 s.
Then `swarm api` in front, and 8 streaming clients (threads, the `openai` package) each send one
greedy 32-token request at once, twice (`--rounds`); aggregate tokens/s = tokens generated / wall time
of the round, and one session's tokens/s = its tokens / its own time; medians over the rounds. The ideal
is each placement-independent capacity figure: the total speed spread perfectly (`placement.ideal`),
from the peers' own measured block costs, as tokens/s of one pipeline (not counting batching).

    sudo python benchmarks/heterogeneous.py [--orders rotations|all|N] [--rounds 1] [--quotas 0.4 0.2 0.1]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from api_load import round_of  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.checkpoint import Checkpoint  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.launch import LocalSwarm, cpu_quota_supported, wait_until  # noqa: E402
from swarm.records import default_model_id  # noqa: E402

import torch  # noqa: E402

QUOTAS = {"fast": 0.40, "mid": 0.20, "slow": 0.10}
MEMORY_BLOCKS = 20
CACHE_TOKENS = 2048
CLIENTS = 8
TOKENS = 32
OPTIONS = ("--cache-tokens", str(CACHE_TOKENS), "--announce-interval", "2", "--record-ttl", "10", "--check-interval",
           "2", "--rebalance-interval", "4", "--max-sessions", "32")


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


def budget(path: Path, blocks: int) -> str:
    ckpt = Checkpoint(path)
    per_block = ckpt.block_bytes(0, torch.float32) + CACHE_TOKENS * ckpt.cache_bytes_per_token(torch.float32)
    return str(int((blocks + 0.5) * per_block))


def run(path: Path, model_id: str, order: tuple[str, ...], placement: str, rounds: int, root: Path) -> dict:
    num_blocks = Checkpoint(path).num_blocks
    pinned = {"equal": {"fast": (0, 10), "mid": (10, 20), "slow": (20, 30)},
              "ideal": {"fast": (0, 17), "mid": (17, 26), "slow": (26, 30)},  # 4:2:1 of 30 blocks
              "count": count_rule(order, num_blocks, MEMORY_BLOCKS)}.get(placement)
    with LocalSwarm(root) as net:
        net.start_bootstrap()
        for name in order:
            extra = ["--blocks", "%d:%d" % pinned[name]] if pinned else ["--memory-budget", budget(path, MEMORY_BLOCKS)]
            proc = net.start_peer(name, path, "--model-id", model_id, "--capacity-cache",
                                  str(root / f"{name}-capacity.json"), *OPTIONS, *extra, wait=False)
            wait_until(lambda: "measuring what a block" in proc.text() or not proc.alive(), 120, f"{name} to join",
                       diagnostics=proc.text)
            net.throttle(proc, QUOTAS[name])
            net.wait_serving(proc, timeout=600)
        if placement == "new":  # settled: no claim or move logged for 12 s
            seen = {"events": -1, "at": time.monotonic()}

            def quiet():
                events = sum(net.procs[n].text().count("claiming them") for n in order)
                if events != seen["events"]:
                    seen.update(events=events, at=time.monotonic())
                return time.monotonic() - seen["at"] > 12

            wait_until(quiet, 600, "the peers to settle", interval=1.0)
        spans = {n: net.procs[n].span() for n in order}
        moves = sum(net.procs[n].text().count(" moved from ") for n in order)
        url = net.start_api("api", path, "--max-generations", str(CLIENTS)).extra["url"]
        round_of(url, model_id, 2, 1, 4)  # warm-up: routes measured
        results = [round_of(url, model_id, CLIENTS, 1, TOKENS) for _ in range(rounds)]
        costs = {}
        for n in order:
            try:
                costs[n] = next(iter(json.loads((root / f"{n}-capacity.json").read_text()).values()))["decode_ms"]
            except (OSError, ValueError, StopIteration, KeyError):
                costs[n] = None
    return {"order": order, "placement": placement, "spans": spans, "moves": moves, "costs": costs,
            "aggregate": statistics.median(r["tokens_per_s"] for r in results),
            "session": statistics.median(TOKENS / r["total_median"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", default="rotations", help="'rotations' (each peer started first once), "
                        "'all' six start orders, or how many of them")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quotas", type=float, nargs=3, default=list(QUOTAS.values()),
                        help="CPU shares of one core of the fast, mid and slow peers")
    args = parser.parse_args()
    QUOTAS.update(zip(("fast", "mid", "slow"), args.quotas))
    if not cpu_quota_supported():
        sys.exit("needs root and the cgroup v1 cpu controller (/sys/fs/cgroup/cpu)")
    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = default_model_id(path)
    orders = list(itertools.permutations(("fast", "mid", "slow")))
    if args.orders == "rotations":
        orders = [("fast", "mid", "slow"), ("mid", "slow", "fast"), ("slow", "fast", "mid")]
    elif args.orders != "all":
        orders = orders[:int(args.orders)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-hetero-") as tmp:
        def go(order, placement):
            row = run(path, model_id, order, placement, args.rounds, Path(tmp) / f"{placement}-{'-'.join(order)}")
            rows.append(row)
            print(f"{placement:6} {'/'.join(order):15} {row['aggregate']:.2f} tokens/s aggregate, "
                  f"{row['session']:.2f} one session; spans {row['spans']}, moves {row['moves']}", flush=True)
            return row

        equal = go(orders[0], "equal")
        ideal = go(orders[0], "ideal")
        table = []
        for order in orders:
            count, new = go(order, "count"), go(order, "new")
            table.append((order, count, new))
    costs = [c for r in rows if r["placement"] == "new" for c in r["costs"].values() if c]
    lines = [
        "### Unequal machines: placement by measured speed",
        "",
        f"Machine: {machine()}. Demo model (30 blocks), three peers held to "
        f"{', '.join(f'{q:.0%}' for q in QUOTAS.values())} of one core (fast, mid, slow: cgroup CPU quotas, "
        f"4:2:1), memory for {MEMORY_BLOCKS} blocks each; `swarm api` in front; {CLIENTS} "
        f"concurrent greedy {TOKENS}-token streaming requests, median of {args.rounds} rounds. `equal`: "
        f"`[0:10) [10:20) [20:30)` (fast, mid, slow): {equal['aggregate']:.2f} tokens/s aggregate, "
        f"{equal['session']:.2f} per session. `ideal`: capacity-proportional spans `[0:17) [17:26) [26:30)`: "
        f"{ideal['aggregate']:.2f} tokens/s aggregate ({ideal['aggregate'] / equal['aggregate']:.2f}x equal), "
        f"{ideal['session']:.2f} per session. `count`: the placement before this work (peers per block, by "
        "start order), pinned. `new`: the peers placed and rebalanced themselves.",
        "",
        "| start order | count: spans | count tok/s | new: spans (moves) | new tok/s | new / equal | new / count | "
        "one session, new |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {'/'.join(o)} | {fmt(c['spans'])} | {c['aggregate']:.2f} | {fmt(n['spans'])} ({n['moves']}) | "
          f"{n['aggregate']:.2f} | {n['aggregate'] / equal['aggregate']:.2f}x | {n['aggregate'] / c['aggregate']:.2f}x | "
          f"{n['session']:.2f} |" for o, c, n in table),
        "",
        f"Median new / equal: {statistics.median(n['aggregate'] for _, _, n in table) / equal['aggregate']:.2f}x; "
        f"median new / count: {statistics.median(n['aggregate'] / c['aggregate'] for _, c, n in table):.2f}x. "
        f"Measured block costs under the quotas (ms per decode step per block): "
        f"{', '.join(f'{c:.1f}' for c in sorted(costs))}.",
        "",
        f"Command: `.venv/bin/python benchmarks/heterogeneous.py --orders {args.orders} --rounds {args.rounds} "
        f"--quotas {' '.join(map(str, args.quotas))}`",
    ]
    print(write_section("heterogeneous", lines))


def fmt(spans: dict) -> str:
    return " ".join(f"{n[0]}[{s[0]}:{s[1]})" if s else f"{n[0]}?" for n, s in spans.items())


if __name__ == "__main__":
    main()
