"""`swarm demo`: a real local swarm on the demo model, and an answer generated through it.

A bootstrap node and N peers start as separate processes on 127.0.0.1 (each peer serves an equal
share of the blocks, so they can start at the same time), the SDK generates a streamed answer through
them, and every process is stopped by PID at the end, whatever happened. Logs of the swarm's
processes stay in a temporary directory, shown if something fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from client.cli import describe_route, model_path, stream_answer
from swarm.model.checkpoint import Checkpoint
from swarm.errors import ConfigError
from swarm.local.launch import LocalSwarm
from swarm.span import split_evenly

DEMO_CACHE_TOKENS = 4096


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def threads_per_peer(peers: int) -> int:
    """Compute threads for each of `peers` peers sharing this machine: a share of its cores. (Measured on
    the demo model, 2 cores, 3 peers: one thread each decodes faster than two, whose waking costs more
    than it saves on layers this small, and bfloat16 and int8 gain only then.)"""
    return max(1, (os.cpu_count() or 1) // peers)


def start_swarm(net: LocalSwarm, path: Path, peers: int, dtype: str, model_id: str, quant: str = "none") -> None:
    started = time.monotonic()
    net.start_bootstrap()
    spans = split_evenly(Checkpoint(path).num_blocks, peers)
    for i, span in enumerate(spans):
        net.start_peer(f"peer{i}", path, "--blocks", f"{span.start}:{span.end}", "--model-id", model_id,
                       "--dtype", dtype, "--quant", quant, "--threads", str(threads_per_peer(len(spans))),
                       "--cache-tokens", str(DEMO_CACHE_TOKENS), wait=False)
    for i in range(len(spans)):
        net.wait_serving(net.procs[f"peer{i}"], timeout=300)
    log(f"swarm up in {time.monotonic() - started:.1f} s: a bootstrap and {peers} peers serving "
        f"{', '.join(str(s) for s in spans)}")


def run_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from client.model import DistributedModelForCausalLM
    from swarm.net.records import default_model_id

    path = model_path(args)
    if args.peers < 1:
        raise ConfigError("--peers must be positive")
    model_id = default_model_id(path)
    with tempfile.TemporaryDirectory(prefix="swarm-demo-") as root, LocalSwarm(Path(root)) as net:
        try:
            start_swarm(net, path, args.peers, args.dtype, model_id, args.quant)
            tokenizer = AutoTokenizer.from_pretrained(path)
            with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as model:
                log(f"route: {describe_route(model.route())}")
                print(f"> {args.prompt}", flush=True)
                stats = stream_answer(model, tokenizer, args.prompt, args, chat=not args.raw)
            print(flush=True)
            ttft = "-" if stats["ttft_s"] is None else f"{stats['ttft_s'] * 1000:.0f} ms"
            log(f"{stats['tokens']} tokens through {args.peers} peers; first token after {ttft}; "
                f"decode {stats['tokens_per_s']:.1f} tokens/s")
        except BaseException:
            for proc in net.procs.values():
                log(f"--- last lines of {proc.name}'s log ---\n" + "\n".join(proc.text().splitlines()[-15:]))
            raise
        finally:
            log("stopping the swarm")
    return 0
