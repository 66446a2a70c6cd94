"""Recovery: the only peer of a span is SIGKILLed mid-generation; how long until its blocks are served
again, and how long the running generation stalls.

Demo model (30 blocks) on 127.0.0.1: `[0:15)` pinned on one peer, `[15:30)` pinned on the victim, and a
third peer with room for 15 blocks and no `--blocks` (it starts on `[0:15)`; all peer options at their
defaults). A greedy 48-token generation through the SDK; after 8 tokens the victim is SIGKILLed. The
third peer sees the hole (it pings the only server of each block at every check), claims
`[15:30)`, drops `[0:15)` first (both do not fit), loads `[15:30)` and announces it; the generation
waits for the blocks, replays and goes on. Reported per trial: seconds from the kill to the new peer's
"moved" log line (blocks served again, weights loading included), the generation's longest gap between
two tokens (its stall), and whether the tokens equal the no-fault run's. Medians over `--trials`.

    python benchmarks/recovery.py [--trials 3]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402

from client.model import DistributedModelForCausalLM  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

CACHE_TOKENS = 2048
NEW_TOKENS = 48
KILL_AFTER = 8
MOVED = re.compile(r"moved from blocks \[0:15\) to \[15:30\)")


def budget(path: Path, blocks: int) -> str:
    ckpt = Checkpoint(path)
    per_block = ckpt.block_bytes(0, torch.float32) + CACHE_TOKENS * ckpt.cache_bytes_per_token(torch.float32)
    return str(int((blocks + 0.5) * per_block))


class Killer:
    """A streamer that SIGKILLs the victim after `KILL_AFTER` tokens, records when each token came, and
    watches the free peer's log (every 20 ms, 60 s at most) for its move."""

    def __init__(self, net: LocalSwarm):
        self.net, self.times = net, []
        self.killed_at = self.moved_at = None
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def put(self, value) -> None:
        self.times.append(time.monotonic())
        if len(self.times) == KILL_AFTER + 1:  # the first put is the prompt
            self.killed_at = time.monotonic()
            self.net.stop("victim", signal.SIGKILL)
            self.watcher.start()

    def _watch(self) -> None:
        free = self.net.procs["free"]
        for _ in range(3000):
            if MOVED.search(free.text()):
                self.moved_at = time.monotonic()
                return
            time.sleep(0.02)

    def end(self) -> None:
        pass


def trial(path: Path, model_id: str, prompt: torch.Tensor, root: Path) -> dict:
    common = ("--model-id", model_id, "--cache-tokens", str(CACHE_TOKENS))
    with LocalSwarm(root) as net:
        net.start_bootstrap()
        net.start_peer("pinned", path, "--blocks", "0:15", *common)
        net.start_peer("victim", path, "--blocks", "15:30", *common)
        free = net.start_peer("free", path, "--memory-budget", budget(path, 15), *common)
        if free.span() != (0, 15):
            raise RuntimeError(f"the free peer chose {free.span()}, expected [0:15)")
        with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=model_id) as model:
            expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            killer = Killer(net)
            got = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=killer).tolist()
        killer.watcher.join(70)
        if killer.moved_at is None:
            raise RuntimeError(f"the free peer did not move:\n{free.text()[-3000:]}")
        moved_s = killer.moved_at - killer.killed_at
        gaps = [b - a for a, b in zip(killer.times[1:], killer.times[2:])]
    return {"served_again_s": moved_s, "stall_s": max(gaps), "exact": got == expected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    prompt = AutoTokenizer.from_pretrained(path)("The history of the lighthouse", return_tensors="pt").input_ids
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-recovery-") as tmp:
        for i in range(args.trials):
            row = trial(path, model_id, prompt, Path(tmp) / f"t{i}")
            rows.append(row)
            print(f"trial {i}: served again after {row['served_again_s']:.1f} s, stall {row['stall_s']:.2f} s, "
                  f"tokens {'identical' if row['exact'] else 'DIFFERENT'}", flush=True)
    if not all(r["exact"] for r in rows):
        sys.exit("a generation's tokens differed from the no-fault run")
    lines = [
        "### Recovery: the only peer of a span killed mid-generation",
        "",
        f"Machine: {machine()}. Demo model: `[0:15)` pinned, `[15:30)` on the victim, a third peer with room for "
        "15 blocks on `[0:15)` and no `--blocks` (default options: `--check-interval 3`). The victim is "
        f"SIGKILLed after {KILL_AFTER} of {NEW_TOKENS} greedy tokens; the third peer moves to `[15:30)` (old span "
        "offline first: both do not fit), and the generation waits, replays and goes on.",
        "",
        "| trial | blocks served again after (s, weights loading included) | generation stall (s) | tokens |",
        "|---|---|---|---|",
        *(f"| {i} | {r['served_again_s']:.1f} | {r['stall_s']:.2f} | "
          f"{'identical to the no-fault run' if r['exact'] else 'different'} |" for i, r in enumerate(rows)),
        "",
        f"Medians: served again after {statistics.median(r['served_again_s'] for r in rows):.1f} s, stall "
        f"{statistics.median(r['stall_s'] for r in rows):.2f} s.",
        "",
        f"Command: `.venv/bin/python benchmarks/recovery.py --trials {args.trials}`",
    ]
    print(write_section("recovery", lines))


if __name__ == "__main__":
    main()
