"""Placement at internet scale: a discrete-event simulation of a churning swarm, our rule against Petals'.

Role: a benchmark. It drives `peer/placement.py`'s pure functions (`best_span`, `rebalance`, `stage_blocks`,
`ideal`) through hours of simulated churn and measures what clients would see; it reimplements none
of our rule. Petals' rule is written here from its published source (bigscience-workshop/petals,
`src/petals/server/block_selection.py`, `server.py`, `throughput.py`), read for facts, not copied.
No network, no GPU; a run is deterministic given its seed.

    python benchmarks/placement_sim.py                      # 1,000 peers, 80 blocks, 4 h, seeds 0..2
    python benchmarks/placement_sim.py --peers 200 --hours 1 --seeds 1 --markdown /tmp/placement.md

Every number below is an assumption, and each has its option.

The model: a 70B-class decoder (Llama-2/3-70B shape: hidden 8192, MLP 28672, 8 KV heads), `--blocks`
80. One block is ~0.86 B parameters. Every peer holds NF4 (4-bit) weights, ~0.48 GB a block, plus a
share of attention cache (32k tokens of GQA cache in fp16, ~0.13 GB): 0.61 GB of memory per block.

Peers draw a device from this mix. Speed (tokens/s through one block at batch 1: what `placement.py`
calls `speed`) is memory-bound decode, efficiency x bandwidth / 0.48 GB. Room (`max_blocks`) is
usable memory / 0.61 GB, at most `--blocks`. Each peer's speed and usable memory are scaled by
independent uniform factors in [0.8, 1.2] (`--spread` 0.2; usable memory at most 95% of the device):
other work on the machine, clocks, drivers.

| device                       | share | memory | usable | bandwidth | efficiency | speed (tok/s/block) | max blocks |
|------------------------------|-------|--------|--------|-----------|------------|---------------------|------------|
| RTX 4090                     |  8%   | 24 GB  |  80%   | 1008 GB/s |   0.50     |        1050         |     31     |
| RTX 3090                     | 12%   | 24 GB  |  80%   |  936 GB/s |   0.50     |         975         |     31     |
| RTX 3080                     | 12%   | 10 GB  |  80%   |  760 GB/s |   0.50     |         792         |     13     |
| RTX 3060                     | 20%   | 12 GB  |  80%   |  360 GB/s |   0.50     |         375         |     15     |
| RTX 2080 Ti                  |  8%   | 11 GB  |  80%   |  616 GB/s |   0.50     |         642         |     14     |
| T4-class (cloud notebooks)   | 15%   | 16 GB  |  80%   |  320 GB/s |   0.50     |         333         |     20     |
| Apple M-series laptop        | 15%   | 16 GB  |  60%   |  100 GB/s |   0.35     |          73         |     15     |
| CPU-only desktop (DDR4 x2)   | 10%   | 32 GB  |  60%   |   50 GB/s |   0.30     |          31         |     31     |

(Before the spread. GPUs keep 20% for the CUDA context and activations; unified-memory and CPU
machines keep 40% for the OS and the owner's programs. The mean speed is ~490 tok/s/block, so 1,000
peers make an ideal bottleneck of ~6,100 tok/s on 80 blocks; the mean room is ~20 blocks, enough for
~250 copies of every block.)

Churn: lifetimes are exponential with median `--median-life` (1 h; mean = median / ln 2). The swarm
starts empty and is filled by `--peers` peers arriving one after another, evenly over `--fill`
(600 s), while a Poisson stream of arrivals at rate peers / mean life runs from t = 0; together they
keep the expected population at `--peers` (a few % above it in the first hour, as the fill peers
arrived up to 600 s late; the per-seed table gives the mean live population). Statistics start after
`--warmup` (1,800 s: the fill, then 20 min to settle) and cover `--hours`. Both rules see the same
peers (arrival times, devices, speeds, rooms, lifetimes, drawn from the seed before either runs) and
the same seed for the rest (jitter, delays), whose draws then diverge with the rules' events.
Departures are graceful and seen by every peer at once (an offline announcement; a crash would stay
visible until its record expires, up to `swarm.net.records.MAX_TTL` = 300 s, which this model charges to
neither rule).

Loading: a peer that takes a span announces it at once as `joining` (counted by everyone's placement,
not by the measurements) and serves it `--load-fixed` (10 s) + `--load-per-block` (4 s) x its length
later: weights are on local disk (a returning volunteer), 4 s reads and quantizes 0.48 GB, and the
whole span loads again on a move (as `peer/server.py` does). A peer neither re-evaluates nor moves
while loading. Moves, as each side does them:
- ours (`peer/server.py`): the claim waits `CLAIM_SETTLE_S` (1 s) for crossing claims, then the new
  span loads; when the old and new spans fit in memory at once, the old one keeps serving (and stays in
  everyone's view) until the new one is online (make-before-break), otherwise it stops at once;
- Petals: the server goes offline at once, then re-chooses and loads (break-before-make).

Our rule (`ours`): what a peer runs, `placement.plan` at join and `placement.decide` on checks,
composed here from the same functions on the simulator's incremental capacities (`plan`/`decide`
would rebuild them from every server record, ~10 ms a call): a joining peer takes
`choose(capacities, speed, memory, stage_blocks(speed, memory, others, blocks))`; a serving peer calls
`rebalance(capacities without itself, speed, span, memory, --margin, stage_blocks(...))` every
`--period` (60 s, `rebalance_interval`) x a uniform factor in [0.75, 1.25] (`--jitter`), and once more
when a departure leaves a block that nobody serves or claims, at its next read of the swarm, uniform in
[0, `--detect` = 3 s] later (`check_interval`). Throughput is speed / n and claims count, as in
`placement.py`; others' memory is announced (`max_blocks`). `ours-nostage` (not run by default) is the
same without the stage share (`prefer_blocks` None), the rule before it was added. Decisions run one at
a time in event order and a move's claim counts at once: when many peers see one hole, the first
claimant takes it and the others re-decide with its claim counted (a hole check that finds the hole
claimed does nothing; periodic checks go on). There is no minimum dwell between moves: `rebalance`'s
margin is the only damping, and the 'quick re-moves' diagnostic (a peer's second move within 10 min)
shows whether that is enough.
Timing: `best_span` takes ~4 ms on 80 blocks and `stage_blocks` ~0.6 ms at 1,000 peers, too slow for
~270k checks a run, so a check first computes the current bottleneck (the sums `score` makes, in
numpy) and skips `rebalance` only when it provably returns None (`may_move`): the current span leaves
no hole, no span can beat the current bottleneck by the margin (such a span would have to cover every
block now at or below that target, and could lift them by at most speed / the width from the first
such block to the last), and the span is within the peer's stage share (else `rebalance` may give up
blocks). For that last test only, a peer's stage share may be up to `--stage-refresh` (600 s) old; it
is recomputed before every `rebalance` call and at every join. The unit tests check the bound against
`rebalance`, and that with `--stage-refresh 0` a run without the pre-filter decides the same. No check
is sampled away.

Petals' rule (`petals`), from its source, in its own units:
- span length: fixed for life, as many blocks as fit (`_choose_num_blocks`);
- announced throughput: its per-block speed / ((n + 1) / 2), the mean number of its blocks a request
  uses (`get_server_throughput`; Petals measures prefill `forward_rps`, taken here as proportional to
  decode speed; its network cap, 100 Mbit/s ~ 760 tok/s at hidden 8192, would rarely bind and is left
  out). Joining servers count, offline ones do not (`compute_spans`);
- start: the window whose sorted throughputs are lexicographically least, the lowest start on ties,
  i.e. where the swarm is weakest (`_choose_best_start`), chosen after a random delay uniform in
  [0, 10 s] (`mean_block_selection_delay` 5 s, `--petals-selection-delay`) at join and after a move;
- rebalancing (`should_choose_other_blocks`), on the same schedule as ours (Petals' own default waits
  uniform [0, 240 s]): take itself out (x (1 + 1e-3)); stay if that empties a block of a whole swarm,
  or if its own start is still the weakest; otherwise let every server in random order move to its
  weakest start until none moves, and move if bottleneck now / bottleneck after < 0.75 - 1e-3
  (`balance_quality`). A moving server goes offline at once and re-chooses its start. Petals reacts to
  holes only through that periodic check.
Two liberties, for runtime: the relaxation stops after `--petals-passes` (5) passes (Petals' loop has
no bound; on a 1,000-peer snapshot it converged after ~20 passes, to a bottleneck within 0.1% of the
one after 5), and its outcome is computed once per `--petals-whatif-ttl` (60 s) of simulated time, from
the swarm as it is then, and shared by every check in that interval (Petals runs it per check, starting
with the checking server's own move; `--petals-whatif-ttl 0` does that here too, affordable up to ~100
peers). At 1,000 peers neither can change a decision: the relaxation finds only 1-4% to gain (quality
~0.98 against the 0.75 threshold). In sparse swarms (tens of peers) Petals does move, and its hole time
there shifts with both settings.

Everything is measured with OUR capacity model for both rules (a loaded peer adds speed / n to each of
its n blocks), so Petals is judged by the throughput its placement yields, not by its own estimate.

Metrics, over the measured window, per rule and seed:
- bottleneck / ideal: the time average of (least block capacity over loaded peers) / `ideal(blocks,
  speeds of the loaded peers)` at the same instant (0 while there is a hole);
- hole s per hour, holes % of time: time during which some block has no loaded peer;
- moves per peer per hour: rebalancing moves (joins excluded) / live-peer-hours (peers present, in any
  state).
Diagnostics: moves, quick re-moves, ours' moves by the `rebalance` condition that made them (a hole
filled / the bottleneck raised past the margin / blocks beyond the stage share given up), mean blocks
per loaded peer (a client's chain needs ~blocks / that many hops), mean live peers, checks, `rebalance`
calls past the pre-filter, and Petals relaxations (times the pass bound stopped one). The table gives
medians over `--seeds` seeds (from `--seed`), then every seed. Runs are independent processes (`--jobs`).
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peer.placement import MARGIN, Score, choose, ideal, rebalance, score, stage_blocks  # noqa: E402
from swarm.span import Span  # noqa: E402

WEIGHT_GB = 0.48  # NF4 weights of one 70B block (0.86 B params at ~4.5 bits with scales)
CACHE_GB = 0.13  # attention cache share per block: 32k tokens x 2 x 1024 (8 KV heads) x fp16
BLOCK_GB = WEIGHT_GB + CACHE_GB
PETALS_QUALITY = 0.75  # Petals' balance_quality default
PETALS_EPS = 1e-3  # Petals' stickiness epsilon in should_choose_other_blocks
CLAIM_SETTLE_S = 1.0  # peer/server.py: a claim waits this long for crossing claims before loading
QUICK_REMOVE_S = 600.0  # a second move of one peer within this time counts as a quick re-move
MAX_EVENTS = 50_000_000  # a safety bound on the event loop; a default run has well under 1M


@dataclass(frozen=True)
class Device:
    name: str
    share: float
    memory_gb: float
    usable: float  # share of memory left for blocks
    bandwidth_gbs: float
    efficiency: float  # achieved share of bandwidth at batch-1 decode with NF4 kernels

    @property
    def speed(self) -> float:
        return self.efficiency * self.bandwidth_gbs / WEIGHT_GB

    @property
    def room(self) -> float:
        return self.memory_gb * self.usable / BLOCK_GB


DEVICES = (
    Device("RTX 4090", 0.08, 24, 0.8, 1008, 0.5),
    Device("RTX 3090", 0.12, 24, 0.8, 936, 0.5),
    Device("RTX 3080", 0.12, 10, 0.8, 760, 0.5),
    Device("RTX 3060", 0.20, 12, 0.8, 360, 0.5),
    Device("RTX 2080 Ti", 0.08, 11, 0.8, 616, 0.5),
    Device("T4-class", 0.15, 16, 0.8, 320, 0.5),
    Device("Apple M-series", 0.15, 16, 0.6, 100, 0.35),
    Device("CPU desktop", 0.10, 32, 0.6, 50, 0.3),
)


@dataclass(frozen=True)
class Config:
    peers: int = 1000
    blocks: int = 80
    hours: float = 4.0
    seed: int = 0
    median_life_s: float = 3600.0
    fill_s: float = 600.0
    warmup_s: float = 1800.0
    spread: float = 0.2
    period_s: float = 60.0  # peer/config.py rebalance_interval
    jitter: float = 0.25  # peer/balancer.py jittered
    detect_s: float = 3.0  # peer/config.py check_interval: the swarm is read this often for holes
    stage_refresh_s: float = 600.0
    load_fixed_s: float = 10.0
    load_per_block_s: float = 4.0
    margin: float = MARGIN
    petals_selection_delay_s: float = 5.0
    petals_passes: int = 5
    petals_whatif_ttl_s: float = 60.0

    @property
    def mean_life_s(self) -> float:
        return self.median_life_s / math.log(2)

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.hours * 3600.0


@dataclass(frozen=True)
class PeerSpec:
    """Everything about a peer that both rules share: drawn once per seed."""

    pid: int
    arrive: float
    life: float
    device: str
    speed: float
    max_blocks: int


def draw_peer(pid: int, arrive: float, cfg: Config, rng: random.Random) -> PeerSpec:
    device = rng.choices(DEVICES, weights=[d.share for d in DEVICES])[0]
    speed = device.speed * rng.uniform(1 - cfg.spread, 1 + cfg.spread)
    usable = min(0.95, device.usable * rng.uniform(1 - cfg.spread, 1 + cfg.spread))
    room = int(device.memory_gb * usable / BLOCK_GB)
    life = rng.expovariate(1 / cfg.mean_life_s)
    return PeerSpec(pid, arrive, life, device.name, speed, max(1, min(cfg.blocks, room)))


def make_peers(cfg: Config) -> list[PeerSpec]:
    """The fill (evenly over `fill_s`) plus a Poisson stream at peers / mean life, in arrival order."""
    rng = random.Random(f"peers-{cfg.seed}")
    times = [i * cfg.fill_s / cfg.peers for i in range(cfg.peers)]
    rate, t = cfg.peers / cfg.mean_life_s, 0.0
    for _ in range(100 * cfg.peers + 1000):  # bounded: the expected count is peers x end / mean life
        t += rng.expovariate(rate)
        if t >= cfg.end_s:
            break
        times.append(t)
    times.sort()
    return [draw_peer(pid, at, cfg, rng) for pid, at in enumerate(times)]


class Layer:
    """Per-block capacity and server count under one accounting; a block with no server is exactly 0,
    so float residue of adds and removes never hides a hole."""

    def __init__(self, blocks: int) -> None:
        self.caps = np.zeros(blocks)
        self.count = np.zeros(blocks, dtype=np.int64)

    def add(self, span: Span, throughput: float) -> None:
        self.caps[span.start:span.end] += throughput
        self.count[span.start:span.end] += 1

    def remove(self, span: Span, throughput: float) -> None:
        caps, count = self.caps[span.start:span.end], self.count[span.start:span.end]
        caps -= throughput
        count -= 1
        np.maximum(caps, 0.0, out=caps)
        caps[count == 0] = 0.0

    def without(self, span: Span, throughput: float) -> np.ndarray:
        """The capacities with one server of `span` taken out."""
        caps = self.caps.copy()
        inside = caps[span.start:span.end]
        inside -= throughput
        np.maximum(inside, 0.0, out=inside)
        inside[self.count[span.start:span.end] <= 1] = 0.0
        return caps

    def has_hole(self) -> bool:
        return bool((self.count == 0).any())

    def holes(self) -> int:
        return int((self.count == 0).sum())

    def bottleneck(self) -> float:
        return float(self.caps.min())


@dataclass
class Peer:
    spec: PeerSpec
    state: str = "selecting"  # selecting -> joining -> online; moving goes back; gone at departure
    span: Span | None = None  # the span it serves, or claims while loading
    old: Span | None = None  # while moving make-before-break: the span it still serves
    prefer: int | None = None  # our rule: its stage share, as last computed
    prefer_at: float = -math.inf
    gen: int = 0  # bumps on every move and departure: stale scheduled events see a different gen
    last_move: float = -math.inf


@dataclass
class Counters:
    checks: int = 0
    rebalance_calls: int = 0
    prefiltered: int = 0
    hole_checks: int = 0
    relaxations: int = 0
    relaxation_bound_hits: int = 0
    relaxation_passes: int = 0
    # ours, measured window: moves by the `rebalance` condition that made them
    reasons: dict[str, int] = field(default_factory=lambda: {"hole": 0, "margin": 0, "stage": 0})


@dataclass
class Result:
    rule: str
    seed: int
    ratio: float
    hole_s_per_h: float
    hole_pct: float
    moves_per_peer_h: float
    mean_blocks: float
    mean_live: float
    moves: int
    quick_removes: int
    wall_s: float
    counters: Counters = field(default_factory=Counters)


class Rule:
    """How one placement rule announces, chooses and re-decides; the simulator does the rest."""

    name = "rule"
    hole_trigger = False
    make_before_break = False  # whether a move keeps serving the old span while the new one loads

    def throughput(self, peer: Peer, span: Span) -> float:
        raise NotImplementedError

    def selection_delay(self, sim: Simulator) -> float:
        return 0.0

    def choose(self, sim: Simulator, peer: Peer) -> Span:
        raise NotImplementedError

    def check(self, sim: Simulator, peer: Peer) -> Span | bool | None:
        """A span to move to, True to move and re-choose, or None/False to stay."""
        raise NotImplementedError


class Ours(Rule):
    """`peer.placement` as `plan` and `decide` compose it, on the simulator's incremental capacities:
    `choose(capacities, speed, memory, stage_blocks(...))` at join and
    `rebalance(capacities without itself, speed, span, memory, margin, stage_blocks(...))` on checks.
    `stage=False` leaves the stage share out (`prefer_blocks` None): the rule before it was added."""

    hole_trigger = True
    make_before_break = True  # peer/server.py, when both spans fit in memory at once

    def __init__(self, stage: bool = True) -> None:
        self.stage = stage
        self.name = "ours" if stage else "ours-nostage"

    def throughput(self, peer: Peer, span: Span) -> float:
        return peer.spec.speed / len(span)

    def prefer(self, sim: Simulator, peer: Peer, fresh: bool) -> int | None:
        """Its stage share; `stage_blocks` sorts every peer, so between decisions that can move the peer
        it is recomputed only every `stage_refresh_s` (see `check`)."""
        if not self.stage:
            return None
        if fresh or sim.now - peer.prefer_at >= sim.cfg.stage_refresh_s:
            others = {pid: v for pid, v in sim.serving.items() if pid != peer.spec.pid}
            peer.prefer = stage_blocks(peer.spec.speed, peer.spec.max_blocks, others, sim.cfg.blocks)
            peer.prefer_at = sim.now
        return peer.prefer

    def choose(self, sim: Simulator, peer: Peer) -> Span:
        prefer = self.prefer(sim, peer, fresh=True)
        return choose(sim.view.caps.tolist(), peer.spec.speed, peer.spec.max_blocks, prefer).span

    def check(self, sim: Simulator, peer: Peer) -> Span | None:
        speed, span, memory = peer.spec.speed, peer.span, peer.spec.max_blocks
        caps = sim.view.without(span, self.throughput(peer, span))
        sim.counters.checks += 1
        prefer = self.prefer(sim, peer, fresh=False)
        within = prefer is None or len(span) <= prefer
        if within and not may_move(caps, span, speed, memory, sim.cfg.margin):
            sim.counters.prefiltered += 1
            return None
        sim.counters.rebalance_calls += 1
        prefer = self.prefer(sim, peer, fresh=True)
        best = rebalance(caps.tolist(), speed, span, memory, sim.cfg.margin, prefer)
        if best is not None and sim.measured():
            sim.counters.reasons[move_reason(caps, span, speed, prefer, best, sim.cfg.margin)] += 1
        return best.span if best else None


def move_reason(caps: np.ndarray, span: Span, speed: float, prefer: int | None, best: Score,
                margin: float) -> str:
    """Which of `rebalance`'s three conditions made it move, in its order: a hole filled, the bottleneck
    raised past the margin, or blocks beyond the stage share given up."""
    here = score(caps.tolist(), span, speed, prefer)
    if best.holes < here.holes:
        return "hole"
    if best.bottleneck > here.bottleneck * (1 + margin):
        return "margin"
    return "stage"


def may_move(caps: np.ndarray, span: Span, speed: float, max_blocks: int, margin: float) -> bool:
    """False only when `rebalance(caps, speed, span, max_blocks, margin, prefer)` surely returns None for
    any `prefer` >= len(span) (the caller checks that), which saves its O(blocks x max_blocks)
    `best_span` (and `score`'s logs: the same sums in numpy give the same floats). That holds when the
    current span leaves no hole (so no span leaves fewer) and no span can reach a bottleneck above
    `target` = current x (1 + margin): one that does must cover every block now at or below `target`,
    so it is at least `width` long (from the first such block to the last) and lifts them by at most
    speed / width. (The third way to move, giving up blocks beyond the stage share, needs
    len(span) > prefer.)"""
    here = caps.copy()  # the capacities with the peer where it is: `score(caps, span, speed)`'s `new`
    here[span.start:span.end] += speed / len(span)
    if (here <= 0).any():
        return True
    target = float(here.min()) * (1 + margin)
    weak = np.flatnonzero(caps <= target * (1 - 1e-9))  # a subset of the blocks to cover: stays sound
    if len(weak) == 0:
        return True
    width = int(weak[-1] - weak[0] + 1)
    if width > max_blocks:
        return False
    return (float(caps[weak].min()) + speed / width) * (1 + 1e-9) > target


_WINDOWS: dict[tuple[int, int], np.ndarray] = {}  # (blocks, length) -> the block indices of each window


def weakest_start(throughputs: np.ndarray, length: int) -> int:
    """Petals' start: the window whose sorted throughputs are lexicographically least, lowest on ties."""
    key = (len(throughputs), length)
    if key not in _WINDOWS:
        _WINDOWS[key] = np.arange(len(throughputs) - length + 1)[:, None] + np.arange(length)
    ordered = throughputs[_WINDOWS[key]]
    ordered.sort(axis=1)
    first = ordered[:, 0]
    candidates = (first == first.min()).nonzero()[0]
    if candidates.size == 1:
        return int(candidates[0])
    tied = ordered[candidates]
    return int(candidates[np.lexsort(tied.T[::-1])[0]])  # lexsort is stable: lowest start among equals


def relax(throughputs: np.ndarray, spans: Sequence[tuple[int, int, float]], rng: random.Random,
          passes: int) -> tuple[float, int, bool]:
    """Petals' what-if: servers in random order each move to their weakest start, until none moves or
    `passes` passes are done. Returns (bottleneck after, passes run, whether the bound stopped it)."""
    tp = throughputs.copy()
    starts = [s for s, _, _ in spans]
    order = list(range(len(spans)))
    for done in range(1, passes + 1):
        rng.shuffle(order)
        moved = False
        for i in order:
            start, (_, length, t) = starts[i], spans[i]
            tp[start:start + length] -= t * (1 + PETALS_EPS)
            new = weakest_start(tp, length)
            tp[start:start + length] += t * PETALS_EPS  # the eps left behind favours staying on ties
            if new != start:
                starts[i], moved = new, True
            tp[new:new + length] += t
        if not moved:
            return float(tp.min()), done, False
    return float(tp.min()), passes, True


class Petals(Rule):
    name = "petals"

    def __init__(self) -> None:
        self.whatif: tuple[float, float] | None = None  # (computed at, bottleneck after relaxation)

    def throughput(self, peer: Peer, span: Span) -> float:
        return peer.spec.speed / ((len(span) + 1) / 2)

    def selection_delay(self, sim: Simulator) -> float:
        return sim.rng.uniform(0.0, 2.0 * sim.cfg.petals_selection_delay_s)

    def choose(self, sim: Simulator, peer: Peer) -> Span:
        start = weakest_start(sim.view.caps, peer.spec.max_blocks)
        return Span(start, start + peer.spec.max_blocks)

    def check(self, sim: Simulator, peer: Peer) -> bool:
        sim.counters.checks += 1
        view, span = sim.view, peer.span
        initial = view.bottleneck()
        tp = view.caps.copy()
        tp[span.start:span.end] -= self.throughput(peer, span) * (1 + PETALS_EPS)
        if initial > PETALS_EPS and tp.min() <= 0:
            return False  # leaving would disconnect the swarm
        if weakest_start(tp, len(span)) == span.start:
            return False  # already where the swarm is weakest
        after = self.relaxed(sim)
        if after < initial or after < PETALS_EPS:
            return False
        return initial / after < PETALS_QUALITY - PETALS_EPS

    def relaxed(self, sim: Simulator) -> float:
        ttl = sim.cfg.petals_whatif_ttl_s
        if self.whatif is not None and sim.now - self.whatif[0] < ttl:
            return self.whatif[1]
        spans = [(p.span.start, len(p.span), self.throughput(p, p.span))
                 for p in sim.peers.values() if p.state in ("joining", "online")]
        after, passes, bound = relax(sim.view.caps, spans, sim.rng, sim.cfg.petals_passes)
        sim.counters.relaxations += 1
        sim.counters.relaxation_passes += passes
        sim.counters.relaxation_bound_hits += bound
        self.whatif = (sim.now, after)
        return after


RULES = {"ours": Ours, "ours-nostage": lambda: Ours(stage=False), "petals": Petals}


class Simulator:
    """One rule on one seed's peers. State between events is constant, so metrics integrate exactly."""

    def __init__(self, cfg: Config, rule: Rule, specs: Sequence[PeerSpec]) -> None:
        self.cfg, self.rule, self.specs = cfg, rule, specs
        self.rng = random.Random(f"events-{cfg.seed}")  # the same stream for both rules
        self.view = Layer(cfg.blocks)  # what placement sees: joining and online, in the rule's units
        self.live = Layer(cfg.blocks)  # what clients get: loaded peers, speed / n each (our model)
        self.peers: dict[int, Peer] = {}
        self.serving: dict[int, tuple[float, int]] = {}  # peers with a span in the view: (speed, memory)
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.counters = Counters()
        self.loaded_speed = 0.0  # sum of the loaded peers' speeds, for `ideal`
        self.loaded_blocks = 0  # sum of the loaded peers' span lengths
        self.loaded = 0
        self.acc = {"ratio": 0.0, "hole": 0.0, "peer_s": 0.0, "blocks": 0.0, "time": 0.0}
        self.moves = 0
        self.quick_removes = 0

    def push(self, at: float, kind: str, pid: int, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, pid, gen))

    def run(self) -> None:
        for spec in self.specs:
            self.push(spec.arrive, "arrive", spec.pid)
        for _ in range(MAX_EVENTS):
            if not self.events or self.events[0][0] > self.cfg.end_s:
                break
            at, _, kind, pid, gen = heapq.heappop(self.events)
            self.advance(at)
            self.handle(kind, pid, gen)
        self.advance(self.cfg.end_s)

    def advance(self, at: float) -> None:
        """Integrate the metrics over [now, at), clipped to the measured window."""
        lo, hi = max(self.now, self.cfg.warmup_s), min(at, self.cfg.end_s)
        if hi > lo:
            dt = hi - lo
            best = ideal(self.cfg.blocks, [self.loaded_speed]) if self.loaded else 0.0
            hole = self.live.has_hole()
            self.acc["ratio"] += dt * (0.0 if hole or best <= 0 else self.live.bottleneck() / best)
            self.acc["hole"] += dt * hole
            self.acc["peer_s"] += dt * len(self.peers)
            self.acc["blocks"] += dt * (self.loaded_blocks / self.loaded if self.loaded else 0.0)
            self.acc["time"] += dt
        self.now = max(self.now, at)

    def measured(self) -> bool:
        return self.cfg.warmup_s <= self.now <= self.cfg.end_s

    def handle(self, kind: str, pid: int, gen: int) -> None:
        if kind == "arrive":
            self.arrive(self.specs[pid])
            return
        peer = self.peers.get(pid)
        if peer is None:
            return
        if kind == "depart":
            self.depart(peer)
        elif gen != peer.gen:
            return  # scheduled before a move: that plan no longer holds
        elif kind == "select" and peer.state == "selecting":
            self.claim(peer, self.rule.choose(self, peer))
        elif kind == "loaded" and peer.state == "joining":
            self.load(peer)
        elif kind == "check" and peer.state == "online":
            if not self.decide(peer):
                self.push(self.now + self.period(), "check", pid, peer.gen)
        elif kind == "hole" and peer.state == "online" and self.view.has_hole():
            self.counters.hole_checks += 1
            self.decide(peer)

    def period(self) -> float:
        return self.cfg.period_s * self.rng.uniform(1 - self.cfg.jitter, 1 + self.cfg.jitter)

    def arrive(self, spec: PeerSpec) -> None:
        peer = Peer(spec)
        self.peers[spec.pid] = peer
        self.push(spec.arrive + spec.life, "depart", spec.pid)
        self.select_later(peer)

    def select_later(self, peer: Peer) -> None:
        delay = self.rule.selection_delay(self)
        if delay <= 0:
            self.claim(peer, self.rule.choose(self, peer))  # claims at once: the next decision sees it
        else:
            self.push(self.now + delay, "select", peer.spec.pid, peer.gen)

    def claim(self, peer: Peer, span: Span, settle: float = 0.0) -> None:
        """Announce `span` as joining now; it serves once loaded (the whole span loads from disk)."""
        peer.span, peer.state = span, "joining"
        self.view.add(span, self.rule.throughput(peer, span))
        self.serving[peer.spec.pid] = (peer.spec.speed, peer.spec.max_blocks)
        load = settle + self.cfg.load_fixed_s + self.cfg.load_per_block_s * len(span)
        self.push(self.now + load, "loaded", peer.spec.pid, peer.gen)

    def load(self, peer: Peer) -> None:
        if peer.old is not None:  # make-before-break: the old span stops once the new one serves
            self.view.remove(peer.old, self.rule.throughput(peer, peer.old))
            self.dark(peer, peer.old)
            peer.old = None
        peer.state = "online"
        self.lit(peer, peer.span)
        self.push(self.now + self.period(), "check", peer.spec.pid, peer.gen)

    def lit(self, peer: Peer, span: Span) -> None:
        self.live.add(span, peer.spec.speed / len(span))
        self.loaded += 1
        self.loaded_speed += peer.spec.speed
        self.loaded_blocks += len(span)

    def dark(self, peer: Peer, span: Span) -> None:
        self.live.remove(span, peer.spec.speed / len(span))
        self.loaded -= 1
        self.loaded_speed -= peer.spec.speed
        self.loaded_blocks -= len(span)

    def unserve(self, peer: Peer) -> None:
        """Stop serving and claiming whatever the peer serves or claims."""
        if peer.old is not None:
            self.view.remove(peer.old, self.rule.throughput(peer, peer.old))
            self.dark(peer, peer.old)
            peer.old = None
        if peer.state in ("joining", "online"):
            self.view.remove(peer.span, self.rule.throughput(peer, peer.span))
        if peer.state == "online":
            self.dark(peer, peer.span)
        self.serving.pop(peer.spec.pid, None)
        peer.gen += 1

    def depart(self, peer: Peer) -> None:
        holes = self.view.holes()
        self.unserve(peer)
        peer.state = "gone"
        del self.peers[peer.spec.pid]
        if self.rule.hole_trigger and self.view.holes() > holes:
            self.alert()
        if not self.peers:
            self.loaded_speed = 0.0  # drop float residue when the swarm empties

    def alert(self) -> None:
        """Every serving peer notices a new hole at its next read of the swarm (every `detect_s`); a
        check that finds every hole claimed by then does nothing."""
        for peer in self.peers.values():
            if peer.state == "online":
                delay = self.rng.uniform(0.0, self.cfg.detect_s)
                self.push(self.now + delay, "hole", peer.spec.pid, peer.gen)

    def decide(self, peer: Peer) -> bool:
        """Re-evaluate; move if the rule says so. True when the peer moved."""
        verdict = self.rule.check(self, peer)
        if verdict is None or verdict is False:
            return False
        if self.measured():
            self.moves += 1
            self.quick_removes += self.now - peer.last_move < QUICK_REMOVE_S
        peer.last_move = self.now
        if isinstance(verdict, Span) and self.rule.make_before_break and fits_both(peer, verdict):
            old = peer.span
            peer.gen += 1  # its pending check belongs to the old span
            self.claim(peer, verdict, CLAIM_SETTLE_S)
            peer.old = old  # still online (view and live) until the new span is
            return True
        self.unserve(peer)
        peer.state, peer.span = "selecting", None
        if isinstance(verdict, Span):
            self.claim(peer, verdict, CLAIM_SETTLE_S)
        else:
            self.select_later(peer)
        return True

    def result(self, wall_s: float) -> Result:
        acc, hours = self.acc, max(self.acc["time"], 1e-9) / 3600.0
        peer_h = acc["peer_s"] / 3600.0
        return Result(self.rule.name, self.cfg.seed, acc["ratio"] / max(acc["time"], 1e-9),
                      acc["hole"] / hours, 100.0 * acc["hole"] / max(acc["time"], 1e-9),
                      self.moves / peer_h if peer_h else 0.0, acc["blocks"] / max(acc["time"], 1e-9),
                      peer_h / hours, self.moves, self.quick_removes, wall_s, self.counters)


def fits_both(peer: Peer, target: Span) -> bool:
    """Whether the old and the new span fit in the peer's memory at once (peer/server.py's test)."""
    old = peer.span
    overlap = max(0, min(old.end, target.end) - max(old.start, target.start))
    return len(old) + len(target) - overlap <= peer.spec.max_blocks


def simulate(cfg: Config, rule: str) -> Result:
    """One rule, one seed: deterministic given `cfg`."""
    started = time.perf_counter()
    sim = Simulator(cfg, RULES[rule](), make_peers(cfg))
    sim.run()
    return sim.result(time.perf_counter() - started)


def _job(args: tuple[Config, str]) -> Result:
    return simulate(*args)


def run_all(cfg: Config, rules: Sequence[str], seeds: int, jobs: int) -> list[Result]:
    tasks = [(replace(cfg, seed=cfg.seed + i), rule) for i in range(seeds) for rule in rules]
    tasks.sort(key=lambda t: t[1] != "petals")  # the slower rule first, so the pool ends together
    if jobs <= 1 or len(tasks) == 1:
        results = [_job(t) for t in tasks]
    else:
        with get_context("fork").Pool(min(jobs, len(tasks))) as pool:
            results = pool.map(_job, tasks, chunksize=1)
    return sorted(results, key=lambda r: (rules.index(r.rule), r.seed))


COLUMNS = ("rule", "bottleneck / ideal", "hole s per hour", "holes % of time", "moves per peer per hour")


def row(rule: str, items: Sequence[Result]) -> list[str]:
    med = lambda attr: statistics.median(getattr(r, attr) for r in items)  # noqa: E731
    return [rule, f"{med('ratio'):.3f}", f"{med('hole_s_per_h'):.1f}", f"{med('hole_pct'):.2f}",
            f"{med('moves_per_peer_h'):.3f}"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(cfg: Config, rules: Sequence[str], results: Sequence[Result], seeds: int, wall_s: float) -> str:
    head = (f"placement_sim: {cfg.peers} peers, {cfg.blocks} blocks, {cfg.hours:g} h measured after "
            f"{cfg.warmup_s:g} s warm-up, median life {cfg.median_life_s / 3600:g} h, check every "
            f"{cfg.period_s:g} s +-{cfg.jitter:.0%}, margin {cfg.margin:g}, "
            f"seeds {cfg.seed}..{cfg.seed + seeds - 1}, wall {wall_s:.0f} s")
    main = markdown_table(COLUMNS, [row(rule, [r for r in results if r.rule == rule]) for rule in rules])
    per_seed = markdown_table(
        ("rule", "seed", "bottleneck / ideal", "hole s/h", "holes %", "moves/peer/h", "moves",
         "quick re-moves", "moves hole/margin/stage", "blocks per peer", "live peers", "checks",
         "rebalance calls",
         "relaxations (bound hit)", "wall s"),
        [[r.rule, str(r.seed), f"{r.ratio:.3f}", f"{r.hole_s_per_h:.1f}", f"{r.hole_pct:.2f}",
          f"{r.moves_per_peer_h:.3f}", str(r.moves), str(r.quick_removes),
          "/".join(str(n) for n in r.counters.reasons.values()) if r.rule.startswith("ours") else "-",
          f"{r.mean_blocks:.1f}",
          f"{r.mean_live:.0f}", str(r.counters.checks), str(r.counters.rebalance_calls),
          f"{r.counters.relaxations} ({r.counters.relaxation_bound_hits})", f"{r.wall_s:.0f}"]
         for r in results])
    return f"{head}\n\n{main}\n\nPer seed:\n\n{per_seed}\n"


EXPLANATION = """\
A discrete-event simulation (`benchmarks/placement_sim.py`; its docstring lists every assumption) of a
churning swarm of consumer GPUs, Apple laptops and CPU desktops serving a 70B-class model in NF4. Both
rules see the same peers, arrivals and lifetimes; both are measured with our capacity model (a loaded
peer adds speed / n to each of its n blocks). `ours` is `peer/placement.py` as a peer runs it
(`plan` at join, `decide` on a jittered period and on a new hole, stage share included); `petals` is
Petals' published rule (fixed span length from memory, start at the weakest window, periodic
`balance_quality` 0.75 check). Medians over the seeds; the per-seed table follows.
"""


def parse(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    d = Config()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=d.peers)
    ap.add_argument("--blocks", type=int, default=d.blocks)
    ap.add_argument("--hours", type=float, default=d.hours, help="measured hours after the warm-up")
    ap.add_argument("--seed", type=int, default=d.seed, help="first seed")
    ap.add_argument("--seeds", type=int, default=3, help="seeds seed, seed+1, ...")
    ap.add_argument("--median-life", type=float, default=d.median_life_s, help="seconds")
    ap.add_argument("--fill", type=float, default=d.fill_s, help="seconds over which the first peers arrive")
    ap.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds excluded from the statistics")
    ap.add_argument("--spread", type=float, default=d.spread)
    ap.add_argument("--period", type=float, default=d.period_s, help="seconds between re-evaluations")
    ap.add_argument("--jitter", type=float, default=d.jitter)
    ap.add_argument("--detect", type=float, default=d.detect_s, help="most seconds to notice a hole")
    ap.add_argument("--stage-refresh", type=float, default=d.stage_refresh_s,
                    help="seconds a skipped check may reuse a peer's stage share")
    ap.add_argument("--load-fixed", type=float, default=d.load_fixed_s)
    ap.add_argument("--load-per-block", type=float, default=d.load_per_block_s)
    ap.add_argument("--margin", type=float, default=d.margin, help="our rebalance margin")
    ap.add_argument("--petals-passes", type=int, default=d.petals_passes)
    ap.add_argument("--petals-whatif-ttl", type=float, default=d.petals_whatif_ttl_s)
    ap.add_argument("--petals-selection-delay", type=float, default=d.petals_selection_delay_s)
    ap.add_argument("--rules", default="ours,petals", help=f"comma-separated, of {', '.join(RULES)}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--markdown", type=Path, help="also write the tables with a short explanation here")
    args = ap.parse_args(argv)
    cfg = Config(peers=args.peers, blocks=args.blocks, hours=args.hours, seed=args.seed,
                 median_life_s=args.median_life, fill_s=args.fill, warmup_s=args.warmup, spread=args.spread,
                 period_s=args.period, jitter=args.jitter, detect_s=args.detect,
                 stage_refresh_s=args.stage_refresh,
                 load_fixed_s=args.load_fixed, load_per_block_s=args.load_per_block, margin=args.margin,
                 petals_selection_delay_s=args.petals_selection_delay, petals_passes=args.petals_passes,
                 petals_whatif_ttl_s=args.petals_whatif_ttl)
    return cfg, args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse(argv)
    rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise SystemExit(f"unknown rules {unknown}; known: {sorted(RULES)}")
    started = time.perf_counter()
    results = run_all(cfg, rules, args.seeds, args.jobs)
    text = report(cfg, rules, results, args.seeds, time.perf_counter() - started)
    print(text)
    if args.markdown:
        args.markdown.write_text(f"{EXPLANATION}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
