"""`swarm demo`: a real local swarm on the demo model, and an answer generated through it.

A bootstrap node and N peers start as separate processes on 127.0.0.1 (each peer serves an equal
share of the blocks, so they can start at the same time), the SDK generates a streamed answer through
them, and every process is stopped by PID at the end, whatever happened. Logs of the swarm's
processes stay in a temporary directory, shown if something fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from client.cli import describe_route, model_path, stream_answer, unchecked_note
from swarm.errors import ConfigError
from swarm.local.launch import LocalSwarm
from swarm.span import Span, split_evenly

DEMO_CACHE_TOKENS = 4096


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def threads_per_peer(peers: int) -> int:
    """Compute threads for each of `peers` peers sharing this machine: a share of its cores. (Measured on
    the demo model, 2 cores, 3 peers: one thread each decodes faster than two, whose waking costs more
    than it saves on layers this small, and bfloat16 and int8 gain only then.)"""
    return max(1, (os.cpu_count() or 1) // peers)


def num_blocks(path: Path) -> int:
    """The checkpoint's number of blocks, from its config.json as is, so that the peers start while this
    process still imports torch and transformers; transformers reads the configs that keep it elsewhere."""
    try:
        config = json.loads((path / "config.json").read_text())
        for part in (config, config.get("text_config") or {}):
            if isinstance(part.get("num_hidden_layers"), int):
                return part["num_hidden_layers"]
    except (OSError, ValueError, AttributeError):
        pass  # Checkpoint says what is wrong
    from swarm.model.checkpoint import Checkpoint

    return Checkpoint(path).num_blocks


def launch_swarm(net: LocalSwarm, path: Path, peers: int, dtype: str, model_id: str, quant: str = "none",
                 capacity_cache: Path | None = None) -> list[Span]:
    """Start a bootstrap (waiting for its address) and `peers` peers (not waiting for them); their spans.
    `capacity_cache`: where the peers keep the block cost they measure, so later runs measure it no more."""
    net.start_bootstrap()
    spans = split_evenly(num_blocks(path), peers)
    cache = ("--capacity-cache", str(capacity_cache)) if capacity_cache is not None else ()
    for i, span in enumerate(spans):
        net.start_peer(f"peer{i}", path, "--blocks", f"{span.start}:{span.end}", "--model-id", model_id,
                       "--dtype", dtype, "--quant", quant, "--threads", str(threads_per_peer(len(spans))),
                       "--cache-tokens", str(DEMO_CACHE_TOKENS), *cache, wait=False)
    return spans


def wait_swarm(net: LocalSwarm, spans: list[Span], started: float) -> None:
    for i in range(len(spans)):
        net.wait_serving(net.procs[f"peer{i}"], timeout=300)
    log(f"swarm up in {time.monotonic() - started:.1f} s: a bootstrap and {len(spans)} peers serving "
        f"{', '.join(str(s) for s in spans)}")


def start_swarm(net: LocalSwarm, path: Path, peers: int, dtype: str, model_id: str, quant: str = "none",
                capacity_cache: Path | None = None) -> None:
    started = time.monotonic()
    wait_swarm(net, launch_swarm(net, path, peers, dtype, model_id, quant, capacity_cache), started)


def run_demo(args: argparse.Namespace) -> int:
    from swarm.weights.models import local_model_id

    path = model_path(args)
    if args.peers < 1:
        raise ConfigError("--peers must be positive")
    model_id = local_model_id(path)
    with tempfile.TemporaryDirectory(prefix="swarm-demo-") as root, \
            LocalSwarm(Path(root), verbose=args.verbose) as net:
        try:
            started = time.monotonic()
            spans = launch_swarm(net, path, args.peers, args.dtype, model_id, args.quant,
                                 capacity_cache=Path(args.cache_home) / "capacity.json")
            # while the peers start: the client's own imports and tokenizer
            from transformers import AutoTokenizer

            from client.model import DistributedModelForCausalLM

            tokenizer = AutoTokenizer.from_pretrained(path)
            wait_swarm(net, spans, started)
            with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as model:
                log(f"route: {describe_route(model.route())}")
                print(f"> {args.prompt}", flush=True)
                stats = stream_answer(model, tokenizer, args.prompt, args, chat=not args.raw)
            print(flush=True)
            ttft = "-" if stats["ttft_s"] is None else f"{stats['ttft_s'] * 1000:.0f} ms"
            log(f"{stats['tokens']} tokens through {args.peers} peers; first token after {ttft}; "
                f"decode {stats['tokens_per_s']:.1f} tokens/s")
            if note := unchecked_note(stats):
                log(note)
        except BaseException:
            for proc in net.procs.values():
                log(f"--- last lines of {proc.name}'s log ---\n" + "\n".join(proc.text().splitlines()[-15:]))
            raise
        finally:
            if args.verbose:
                log("stopping the swarm")
    return 0
