"""Peers and a client joining a swarm of a model named by its hub repo id, from a hub held to a home
download's speed: what each role fetches, from the hub and from peers, and how long until each peer serves.

The demo model is re-saved as nine shards and served by a hub on 127.0.0.1 (a real HTTP server speaking
the hub's file API, `tests/hub_server.py`) capped at `--rate` bytes/s for all downloads together. Then, each
peer with a hub cache of its own: a first peer serving every block, two peers serving half of them each
(started one after the other), and a client (config, tokenizer and head). Once with weight sharing (the
default) and once with `--no-share-weights` on every peer.

    python benchmarks/hub_join.py [--rate 20MB] [--runs 3] [--no-write]

Prints a table of medians and writes it to docs/benchmarks.md ("Models by name").
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

from report import machine, write_section  # noqa: E402

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROLES = (("first", "0:30"), ("second", "0:15"), ("third", "15:30"))
PEER_OPTIONS = ("--announce-interval", "2", "--record-ttl", "8", "--cache-tokens", "1024", "--no-rebalance")


def fetched_from_hub(hub, since: int) -> tuple[int, dict[str, int]]:
    """Body bytes the hub sent since log entry `since`, in all and per whole file."""
    entries = hub.log[since:]
    files = {}
    for r in entries:
        if r.kind == "resolve" and r.method == "GET" and r.status == 200 and r.range is None:
            files[r.filename] = files.get(r.filename, 0) + r.bytes_sent
    return sum(r.bytes_sent for r in entries), files


def from_peers(text: str, sizes: dict[str, int]) -> int:
    return sum(sizes.get(name, 0) for name in re.findall(r"fetched (\S+) from peer ", text))


def one_run(source: Path, share: bool, rate: float, root: Path) -> list[dict]:
    from hub_server import HubServer
    from swarm.local.launch import LocalSwarm

    sizes = {p.name: p.stat().st_size for p in source.iterdir()}
    rows = []
    with HubServer({REPO_ID: source}, rate=rate) as hub, LocalSwarm(root / "swarm") as net:
        net.start_bootstrap()
        extra = () if share else ("--no-share-weights",)
        for name, blocks in ROLES:
            mark = len(hub.log)
            started = time.monotonic()
            proc = net.start_peer(name, REPO_ID, "--blocks", blocks, *PEER_OPTIONS, *extra, timeout=900,
                                  env=hub.client_env(root / f"hf-{name}"))
            seconds = time.monotonic() - started
            hub_bytes, _ = fetched_from_hub(hub, mark)
            rows.append({"role": f"peer {name} [{blocks})", "hub": hub_bytes, "peers": from_peers(proc.text(), sizes),
                         "seconds": seconds})
        mark = len(hub.log)
        started = time.monotonic()
        env = hub.client_env(root / "hf-client")
        code = ("from client.model import DistributedModelForCausalLM as M; import sys; "
                f"m = M.from_pretrained({REPO_ID!r}, sys.argv[1:]); print(m.route()); m.close()")
        subprocess.run([sys.executable, "-c", code, *net.bootstrap_addrs], env=env, check=True, timeout=900,
                       capture_output=True, cwd=REPO)
        hub_bytes, _ = fetched_from_hub(hub, mark)
        rows.append({"role": "client", "hub": hub_bytes, "peers": 0, "seconds": time.monotonic() - started})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="20MB", help="the hub's bandwidth for all downloads together")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from hub_repos import reshard
    from peer.config import parse_bytes
    from swarm.cli import cache_home
    from swarm.local.demo_model import default_demo_dir, prepare_demo_model

    rate = parse_bytes(args.rate)
    demo = prepare_demo_model(default_demo_dir(cache_home()))
    with tempfile.TemporaryDirectory(prefix="swarm-hub-join-") as tmp:
        source = reshard(demo, Path(tmp) / "repo", "60MB")
        index = json.loads((source / "model.safetensors.index.json").read_text())
        total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        results: dict[tuple[bool, str], list[dict]] = {}
        for run in range(args.runs):
            for share in (True, False):
                rows = one_run(source, share, rate, Path(tmp) / f"run{run}-{share}")
                for row in rows:
                    results.setdefault((share, row["role"]), []).append(row)
                print(f"run {run + 1}, sharing {'on' if share else 'off'}: " + "; ".join(
                    f"{r['role']}: hub {r['hub'] / 1e6:.0f} MB, peers {r['peers'] / 1e6:.0f} MB, {r['seconds']:.1f} s"
                    for r in rows), flush=True)
    lines = [f"Demo model as {len(set(index['weight_map'].values()))} "
             f"shards ({total / 1e6:.0f} MB), hub at {rate / 1e6:.0f} MB/s on 127.0.0.1; {machine()}; "
             f"medians of {args.runs} runs (`python benchmarks/hub_join.py`).", "",
             "| role | sharing | from the hub | from peers | until serving (peers) or loaded (client) |",
             "|---|---|---:|---:|---:|"]
    for (share, role), rows in results.items():
        hub_mb = statistics.median(r["hub"] for r in rows) / 1e6
        peers_mb = statistics.median(r["peers"] for r in rows) / 1e6
        seconds = statistics.median(r["seconds"] for r in rows)
        lines.append(f"| {role} | {'on' if share else 'off'} | {hub_mb:.1f} MB | {peers_mb:.1f} MB | {seconds:.1f} s |")
    print("\n".join(lines))
    if not args.no_write:
        write_section("hub-join", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
