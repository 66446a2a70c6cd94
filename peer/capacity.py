"""What one block costs this peer: measured on its own device, dtype and weights, cached, then followed
under real load.

- `measure_block` times decode steps and a prefill through one real block for at least `MIN_SECONDS` of
  wall time (several scheduler periods), so a CPU-quota'd machine (a cgroup that runs 10 ms in every
  100) measures what it really sustains, not one unthrottled burst.
- `CapacityCache` keeps the figure per (model, device, dtype, threads) in a small JSON file, so a restart
  chooses its blocks at once; a figure older than `MAX_AGE` is measured again.
- `Capacity` is the live figure: it starts from the measurement and follows an exponential moving average
  of the peer's own one-session decode steps (per block), so a machine that slows down announces it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from swarm.model.blocks import SpanBlocks
from swarm.files import write_json

logger = logging.getLogger(__name__)

MIN_SECONDS = 0.6  # wall time a measurement lasts at least: six periods of a 100 ms CPU quota
MAX_STEPS = 400  # cache positions one measurement uses: past them it rolls the cache back and goes on
STEP_LIMIT = 100 * MAX_STEPS  # decode steps in one measurement at most (a tiny block on a fast CPU)
MAX_AGE = 7 * 86400.0  # seconds a cached figure is trusted
EMA_ALPHA = 0.05  # weight of one observed step: about the last 20 steps count


@dataclass(frozen=True)
class BlockCost:
    decode_ms: float  # one token through one block, batch 1
    prefill_ms: float  # per token of a 32-token prefill through one block
    measured_at: float

    @property
    def speed(self) -> float:
        """Decode tokens/s this peer would pass serving this one block (the placement's speed)."""
        return 1000.0 / max(self.decode_ms, 1e-3)


def measure_block(blocks: SpanBlocks, min_seconds: float = MIN_SECONDS, now: float | None = None) -> BlockCost:
    """Time decode steps and one prefill through `blocks`, per block."""
    n, dtype = len(blocks.span), blocks.dtype
    x = torch.randn(1, 1, blocks.hidden_size, dtype=dtype)
    cache = blocks.new_cache(1, MAX_STEPS + 8)
    for pos in range(3):  # the first calls pay one-time setup
        blocks(x, cache, pos)
    steps, started = 0, time.perf_counter()
    while steps < STEP_LIMIT and (steps < 8 or time.perf_counter() - started < min_seconds):
        if steps and steps % MAX_STEPS == 0 and blocks.recurrent:  # its states return only to recent steps
            cache.release()
            cache = blocks.new_cache(1, MAX_STEPS + 8)
            for pos in range(3):
                blocks(x, cache, pos)
        blocks(x, cache, 3 + steps % MAX_STEPS)  # a lower position rolls back: the wall time is what counts
        steps += 1
    cache.release()
    decode_ms = (time.perf_counter() - started) * 1e3 / steps / n
    prompt = torch.randn(1, 32, blocks.hidden_size, dtype=dtype)
    runs, started = 0, time.perf_counter()
    while runs < 50 and (runs < 1 or time.perf_counter() - started < min_seconds / 3):
        blocks(prompt)
        runs += 1
    prefill_ms = (time.perf_counter() - started) * 1e3 / runs / 32 / n
    return BlockCost(round(decode_ms, 4), round(prefill_ms, 4), time.time() if now is None else now)


class CapacityCache:
    """Block costs per (model, device, dtype, threads), in one JSON file; unreadable files count as empty."""

    def __init__(self, path: Path | None):
        self.path = path

    @staticmethod
    def key(model_id: str, device: str, dtype: str) -> str:
        return f"{model_id}|{device}|{dtype}|threads={torch.get_num_threads()}"

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str, now: float) -> BlockCost | None:
        entry = self._read().get(key)
        try:
            cost = BlockCost(float(entry["decode_ms"]), float(entry["prefill_ms"]), float(entry["measured_at"]))
        except (TypeError, KeyError, ValueError):
            return None
        if not (0 < cost.decode_ms < 1e6 and 0 < cost.prefill_ms < 1e6) or not 0 <= now - cost.measured_at < MAX_AGE:
            return None
        return cost

    def put(self, key: str, cost: BlockCost) -> None:
        if self.path is None:
            return
        data = self._read()
        data[key] = asdict(cost)
        try:
            write_json(self.path, data, indent=1, sort_keys=True)  # peers starting together never read half a file
        except OSError as e:
            logger.warning("could not cache the block cost in %s: %s", self.path, e)


class Capacity:
    """The peer's live per-block decode cost: the measurement, then a moving average of real steps."""

    def __init__(self, cost: BlockCost, alpha: float = EMA_ALPHA):
        self.cost, self.alpha = cost, alpha
        self.decode_ms = cost.decode_ms
        self.observed = 0

    def observe(self, compute_ms: float, blocks: int) -> None:
        """One batch-1, one-token step of one session through `blocks` blocks took `compute_ms`."""
        if blocks > 0 and 0 < compute_ms < 1e6:
            self.decode_ms += self.alpha * (compute_ms / blocks - self.decode_ms)
            self.observed += 1

    @property
    def speed(self) -> float:
        return 1000.0 / max(self.decode_ms, 1e-3)

    def throughput(self, blocks: int) -> float:
        """Decode tokens/s through a span of `blocks` blocks."""
        return round(self.speed / max(blocks, 1), 3)

    def prefill_tps(self, blocks: int) -> float:
        return round(1000.0 / max(self.cost.prefill_ms * max(blocks, 1), 1e-6), 2)
