"""What an idle peer spends on keeping its place in the swarm: CPU of three demo-model peers with no client,
pinned (`--blocks`) against movable (no `--blocks`: they read the swarm and re-evaluate their spans).

Three peers of the demo model (30 blocks) on 127.0.0.1, 10 blocks each (`--blocks 0:10` ... pinned,
`--num-blocks 10` movable), one compute thread each, started one after another; once all serve, 10 s
of settling, then each peer process's CPU time (user + system, from /proc) over `--window` seconds, as a
share of one core. Its transport daemon (a child process) is reported apart. Peer options are the
defaults unless given after `--`.

    python benchmarks/idle_cpu.py [--window 30] [-- --rebalance-interval 15]

Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def measure(path: Path, mode: str, window: float, options: list[str]) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory(prefix="swarm-idle-") as tmp, LocalSwarm(Path(tmp)) as net:
        net.start_bootstrap()
        procs = []
        for i, name in enumerate(("a", "b", "c")):
            extra = ["--blocks", f"{10 * i}:{10 * i + 10}"] if mode == "pinned" else ["--num-blocks", "10"]
            proc = net.start_peer(name, path, "--capacity-cache", str(Path(tmp) / f"{name}.json"), *options, *extra,
                                  wait=False, env={"OMP_NUM_THREADS": "1"})
            net.wait_serving(proc, 300)
            procs.append(proc)
        time.sleep(10)

        def sample():
            out = {}
            for p in procs:
                pid = p.popen.pid
                out[p.name] = (cpu_seconds(pid), sum(cpu_seconds(c) for c in children(pid)))
            return out

        before = sample()
        time.sleep(window)
        after = sample()
    return [(n, (after[n][0] - before[n][0]) / window, (after[n][1] - before[n][1]) / window) for n in before]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("options", nargs="*", help="peer options, after --")
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    print(f"Machine: {machine()}. Peer options: {' '.join(args.options) or 'defaults'}; window {args.window:g} s.\n")
    print("| peers | peer | its process, % of a core | its transport daemon, % |")
    print("|---|---|---|---|")
    for mode in ("pinned", "movable"):
        for name, own, kids in measure(path, mode, args.window, args.options):
            print(f"| {mode} | {name} | {own:.1%} | {kids:.1%} |", flush=True)


if __name__ == "__main__":
    main()
