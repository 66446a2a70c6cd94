"""Step round-trip time through one peer on loopback, against the same step run in-process.

For each hidden size, builds a one-block random llama checkpoint, starts a bootstrap and one peer
(real processes, real transport daemons on 127.0.0.1), opens a session and sends single-token
decode steps. Reports medians: the client-side round trip, the peer's own compute time for the
step (it reports it in every reply), their difference (the per-hop overhead: framing, streams,
scheduling), and the same step run locally in this process.

    python benchmarks/step_rtt.py [--hidden 576 4096] [--steps 200]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from client.inference import peer_session  # noqa: E402
from client.loop import LoopThread  # noqa: E402
from swarm.model.blocks import SpanBlocks  # noqa: E402
from swarm.net.identity import Identity  # noqa: E402
from swarm.span import Span  # noqa: E402
from swarm.net.transport import Node  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402

SHAPES = {  # hidden -> (heads, kv heads, intermediate): SmolLM2-135M's and Llama-2-7B's layer shapes
    576: (9, 3, 1536),
    4096: (32, 32, 11008),
}


def build(hidden: int, path: Path) -> Path:
    heads, kv, inter = SHAPES[hidden]
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                               num_attention_heads=heads, num_key_value_heads=kv, vocab_size=256,
                               max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def measure(hidden: int, steps: int, root: Path) -> dict[str, float]:
    ckpt = build(hidden, root / f"bench-h{hidden}")
    net = LocalSwarm(root / f"swarm-h{hidden}")
    try:
        net.start_bootstrap()
        peer = net.start_peer("peer", ckpt, "--blocks", "0:1", "--model-id", "bench", "--cache-tokens", "4096")
        with LoopThread() as lt:
            async def run():
                async with Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True) as node:
                    session = await peer_session.PeerSession.open(node, peer.peer_id, "bench", Span(0, 1),
                                                                 max_length=steps + 16)
                    rtts, computes = [], []
                    x = torch.randn(1, 1, hidden)
                    for pos in range(steps):
                        started = time.perf_counter()
                        await session.step(x, pos)
                        rtts.append((time.perf_counter() - started) * 1e3)
                        computes.append(session.last_compute_ms)
                    await session.close()
                    return rtts[10:], computes[10:]  # the first steps pay one-time setup

            rtts, computes = lt.run(run(), timeout=600)
    finally:
        net.stop_all()
    blocks = SpanBlocks(ckpt, Span(0, 1))
    cache = blocks.new_cache(1, steps + 16)
    x = torch.randn(1, 1, hidden)
    local = []
    for pos in range(steps):
        started = time.perf_counter()
        blocks(x, cache, pos)
        local.append((time.perf_counter() - started) * 1e3)
    return {"rtt": statistics.median(rtts), "peer_compute": statistics.median(computes),
            "overhead": statistics.median(r - c for r, c in zip(rtts, computes)),
            "local": statistics.median(local[10:]), "steps": len(rtts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as tmp:
        results = {h: measure(h, args.steps, Path(tmp)) for h in args.hidden}
    lines = ["## Step round trip through one peer (loopback)", "",
             f"`python benchmarks/step_rtt.py --steps {args.steps}` on {machine()}. One decode step of one token "
             "through a one-block peer; medians over the steps after the first 10.", "",
             "| hidden | round trip (ms) | peer compute (ms) | overhead per hop (ms) | same step in-process (ms) |",
             "|---|---|---|---|---|"]
    for h, r in results.items():
        lines.append(f"| {h} | {r['rtt']:.2f} | {r['peer_compute']:.2f} | {r['overhead']:.2f} | {r['local']:.2f} |")
    if args.no_write:
        print("\n".join(lines))
    else:
        print(write_section("step_rtt", lines))

if __name__ == "__main__":
    main()
