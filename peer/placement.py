"""Placement: how many blocks a peer serves, and where, from what the swarm announces. Pure: no network,
no clock of its own.

The model (docs/placement.md has a worked example):
- A peer's *speed* `s` is the batch-1 decode tokens/s it would reach serving one block
  (`1000 / block_ms`). Serving a span of `n` blocks it passes `s / n` tokens/s through the span, so it
  adds `s / n` to the *capacity* of each block it serves. Its announced `throughput` is that `s / n`.
- A block's capacity is the sum of what its peers add. The swarm's throughput is bounded by its
  *bottleneck*, the least capacity of any block; a *hole* is a block of capacity 0 (nobody serves it).

Choosing (`best_span`): a peer of speed `s` with room for `memory_blocks` blocks scores every span
`[start, start + n)`, `n <= memory_blocks`, by, in order:
  1. the holes left (fewer);
  2. whether `n` is within its *stage share* (below): a longer span only to fill holes;
  3. the *region's* holes left (fewer): blocks that no peer near this one serves (below);
  4. the bottleneck once it serves the span (higher; equal within `TIE`, so float noise decides nothing);
  5. the gain in the sum over blocks of log capacity (higher): among spans that leave the bottleneck
     where it is, the one that raises weak blocks most; holes count at `HOLE_FLOOR` of the least
     positive capacity so that they weigh most;
  6. more blocks (fewer hops for clients), then the lowest start (reproducible).
Only spans that start at one of the model's starts (`swarm.span.span_starts`; every block for most models) are
scored, and of those, the ones that end at a start or at the model's end, when any fits the lengths asked for: a
client's route cuts between two peers only at a start, so blocks past the last start of a span that ends
elsewhere would serve no route.

Regions: the peers within `swarm.net.distance.REGION_MS` (50 ms) of round trip from this one, as the peer
measures it (no configured label), are its region. When the region, this peer included, has room for the whole model (the memory its
peers announce adds up to the model's blocks), a span that serves a block no near peer serves wins over one
that does not, after the swarm's own holes and within the stage share: so peers joining a region complete a
chain of near peers, and a client there routes without crossing to another region (at 60 ms a round trip,
a crossing costs more than the compute of the whole model on the demo). A region without that room counts
for its holes; its peers still take their stage shares among themselves (so the first peer of a region
takes what it would alone: its chain can be completed by the next ones). Measured in the box (docs/benchmarks.md,
regions-placement): four peers with room for half the model each, joining in turn in two regions, put
both halves in each region; placed by throughput alone, each region held the same half.

The stage share (`stage_blocks`) is `s * T` in whole blocks (`whole_shares`: rounded down, then
the blocks short of whole copies to the peers whose stages stay quickest), where `T` is the swarm's
*stage time* (`stage_time`): the seconds per token one span should take. Spans of equal stage time keep
a pipeline's hops in step: a peer twice as fast serves twice the blocks. `T` is the stage time at which
the shares (each capped by its peer's memory) add up to a whole number `k` of copies of the model, with
`k` the copies they make at the speed-weighted median over peers of `memory_blocks / s` (when the peers
that hold half of the swarm's speed fill their memory), at least 1. With `k` = 1 and no memory in the
way, `T` = `B / S` (total speed `S` over `B` blocks): every peer serving its fair share `s / S * B`
covers the model once at the ideal capacity `S / B`. In a large swarm `k` is large and most spans are
long, for few hops per route, while a slow peer with much memory still takes fewer blocks than a fast
one. Whole copies, because a block's capacity is about its number of copies over `T`: a fraction of a
copy more lengthens every span without adding a copy everywhere. A peer alone takes every block that
fits.

Why the share is a hard limit (except for holes), not a preference the bottleneck may override: the
capacity model above adds a slow peer's `s / n` to blocks a fast peer also serves, but clients route each
session through the quickest hops, so a replica whose hop is much slower than its neighbour's carries
almost nothing until the fast one is swamped, and the sessions it does carry are stragglers. Measured
(docs/benchmarks.md, unequal machines): with the share as a preference, a peer at 10% of a core took
`[20:30)` next to a peer at 20% that served the same blocks (the model's bottleneck rose 25%); clients
sent it 2 of 8 sessions, which finished 24 s after the others. Kept to its share it takes 2 blocks
alone and the pipeline's hops stay in step.

Rebalancing (`rebalance`): a serving peer takes itself out of the swarm's capacities, scores the span
it serves and the best one, and moves only when the best leaves fewer holes, or raises the bottleneck
by more than `margin` (relative), or when the current span is longer than its stage share and the best
(within it) leaves no more holes and either keeps the bottleneck or the current span exceeds the share
by more than `margin` and a block (a peer that took many blocks when it was alone, or to fill a hole
others now fill, gives them up; a wobble of its speed that moves its share by a block moves nothing).
Everything else stays put: no flapping.

Claims (`claims_before`): a peer that decides to move announces the span it will serve as `joining`
(with `since`, when it began to claim). Peers count joining spans as served, so they do not go for the
same hole; when two claims cross on the way, the earlier one (lower `since`, then lower peer id) goes on
and the later one re-decides with the earlier claim counted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from swarm.span import Span
from swarm.net.view import Server

TIE = 1e-6  # relative difference of bottlenecks below which two spans count as equal
HOLE_FLOOR = 0.01  # an empty block weighs like one of this share of the least positive capacity
MARGIN = 0.2  # a move must raise the bottleneck by this share (relative) at least


@dataclass(frozen=True, order=True)
class Score:
    """How good the swarm is with one more peer on some span; compares by `key` (higher is better)."""

    key: tuple
    span: Span
    bottleneck: float
    holes: int
    local: int = 0  # the region's holes left (module docstring); 0 without a region


def capacities(num_blocks: int, served: Iterable[Server]) -> list[float]:
    """Tokens/s each block can pass: the sum over the peers serving it of their throughput."""
    caps = [0.0] * num_blocks
    for server in served:
        for block in server.span:
            if block < num_blocks:
                caps[block] += server.throughput
    return caps


def bottleneck(caps: list[float]) -> float:
    return min(caps) if caps else 0.0


def holes(caps: list[float]) -> list[int]:
    return [b for b, c in enumerate(caps) if c <= 0]


def _level(value: float) -> float:
    """Bottlenecks on a logarithmic grid of relative step `TIE`: equal within TIE compare equal."""
    return -math.inf if value <= 0 else math.floor(math.log(value) / math.log1p(TIE))


def _floors(caps: list[float], speed: float) -> list[float]:
    positive = [c for c in caps if c > 0]
    floor = HOLE_FLOOR * (min(positive) if positive else speed)
    return [c if c > 0 else floor for c in caps]


def score(caps: list[float], span: Span, speed: float, prefer_blocks: int | None = None,
          local: list[float] | None = None) -> Score:
    """The score of serving `span` at `speed` (tokens/s for one block) on top of `caps` (`local`: the region's)."""
    add = speed / len(span)
    new = [c + add if span.start <= b < span.end else c for b, c in enumerate(caps)]
    base = _floors(caps, speed)
    gain = sum(math.log(base[b] + add) - math.log(base[b]) for b in span)
    low = bottleneck(new)
    left = sum(1 for c in new if c <= 0)
    within = prefer_blocks is None or len(span) <= prefer_blocks
    near_left = sum(1 for b, c in enumerate(local) if c <= 0 and b not in span) if local is not None else 0
    return Score((-left, within, -near_left, _level(low), round(gain, 9), len(span), -span.start), span, low, left,
                 near_left)


def best_span(caps: list[float], speed: float, max_blocks: int, prefer_blocks: int | None = None,
              min_blocks: int = 1, local: list[float] | None = None, starts: Collection[int] | None = None) -> Score:
    """The best span for a peer of `speed` with room for `max_blocks` blocks (see the module docstring);
    `local`: the capacities of its region's peers alone, if its region counts; `starts`: the blocks a span may
    start at (None: every block).

    O(blocks x max_blocks): prefix and suffix minima give the bottleneck outside each span, a running
    minimum the one inside, prefix sums per length the log gain."""
    total = len(caps)
    if total < 1 or speed <= 0:
        raise ValueError(f"cannot place a peer of speed {speed} on {total} blocks")
    max_blocks = max(1, min(max_blocks, total))
    prefer = max_blocks if prefer_blocks is None else prefer_blocks
    prefix_min = [math.inf] * (total + 1)
    for b in range(total):
        prefix_min[b + 1] = min(prefix_min[b], caps[b])
    suffix_min = [math.inf] * (total + 1)
    for b in range(total - 1, -1, -1):
        suffix_min[b] = min(suffix_min[b + 1], caps[b])
    hole_prefix, near_prefix = [0] * (total + 1), [0] * (total + 1)
    for b in range(total):
        hole_prefix[b + 1] = hole_prefix[b] + (caps[b] <= 0)
        near_prefix[b + 1] = near_prefix[b] + (local is not None and local[b] <= 0)
    base = _floors(caps, speed)
    logs = [math.log(v) for v in base]
    gains = []  # gains[n - 1][b]: the log gain of blocks [0, b) when a span of n blocks adds speed / n
    for n in range(1, max_blocks + 1):
        add, acc, prefix = speed / n, 0.0, [0.0]
        for b in range(total):
            acc += math.log(base[b] + add) - logs[b]
            prefix.append(acc)
        gains.append(prefix)
    min_blocks = min(max(1, min_blocks), max_blocks)
    allowed = sorted({b for b in starts if 0 <= b < total} | {0}) if starts is not None else range(total)
    best: tuple | None = None
    # spans ending where a span may start, else (none of the lengths asked for does) ending anywhere
    for ends in (None if starts is None else set(allowed) | {total}, None):
        for start in allowed:
            inside = math.inf
            for n in range(1, min(max_blocks, total - start) + 1):
                end = start + n
                inside = min(inside, caps[end - 1])
                if n < min_blocks or (ends is not None and end not in ends):
                    continue
                add = speed / n
                low = min(prefix_min[start], suffix_min[end], inside + add)
                left = hole_prefix[start] + hole_prefix[total] - hole_prefix[end]
                near_left = near_prefix[start] + near_prefix[total] - near_prefix[end]
                key = (-left, n <= prefer, -near_left, _level(low), round(gains[n - 1][end] - gains[n - 1][start], 9),
                       n, -start)
                if best is None or key > best[0]:
                    best = (key, Span(start, end), low, left, near_left)
        if best is not None:
            break
    return Score(*best)


def rebalance(caps: list[float], speed: float, current: Span, max_blocks: int, margin: float = MARGIN,
              prefer_blocks: int | None = None, min_blocks: int = 1, local: list[float] | None = None,
              starts: Collection[int] | None = None) -> Score | None:
    """Where a peer serving `current` should move, or None to stay. `caps` (and `local`, the region's) leave this
    peer out; `starts`: the blocks a span may start at (None: every block)."""
    here = score(caps, current, speed, prefer_blocks, local)
    best = best_span(caps, speed, max_blocks, prefer_blocks, min_blocks, local, starts)
    if best.span == current:
        return None
    if best.holes < here.holes:
        return best
    within = prefer_blocks is None or len(best.span) <= prefer_blocks
    if best.holes == here.holes and best.local < here.local and within:
        return best  # the region lacks blocks this peer can serve: a client there need not cross to another
    if best.local > here.local:
        return None  # no gain in throughput is worth a crossing for the region's clients
    if best.holes == here.holes and best.bottleneck > here.bottleneck * (1 + margin) and best.bottleneck > 0:
        return best
    if prefer_blocks is not None and len(current) > prefer_blocks >= len(best.span) and best.holes <= here.holes \
            and (_level(best.bottleneck) >= _level(here.bottleneck)
                 or len(current) > max(prefer_blocks + 1, prefer_blocks * (1 + margin))):
        return best  # within its stage share, no hole left: a slow peer lets go of blocks it need not hold
    return None


def peers(served: Iterable[Server]) -> dict[str, tuple[float, int | None]]:
    """Each peer's (speed, memory in blocks) from its servers; a peer that announced no memory counts its
    longest span."""
    out: dict[str, tuple[float, int | None]] = {}
    for server in served:
        speed, memory = out.get(server.peer, (0.0, None))
        memory = max(memory or 0, server.max_blocks or len(server.span))
        out[server.peer] = (max(speed, server.speed), memory)
    return out


def stage_time(everyone: Iterable[tuple[float, int]], num_blocks: int) -> float:
    """The swarm's stage time in seconds per token (module docstring), from each peer's (speed, memory in
    blocks)."""
    peers_ = [(s, max(1, min(m, num_blocks))) for s, m in everyone if s > 0]
    if not peers_:
        raise ValueError("no peer with a positive speed")
    total = sum(s for s, _ in peers_)
    full = sorted((m / s, s, m) for s, m in peers_)  # (seconds at which the peer's memory is full, speed, memory)
    held, median = 0.0, full[-1][0]  # the speed-weighted median of memory / speed
    for seconds, s, _ in full:
        held += s
        if held >= total / 2:
            median = seconds
            break
    copies = max(1, math.floor(sum(min(m, s * median) for s, m in peers_) / num_blocks + 1e-9))
    target = copies * num_blocks  # blocks the shares should add up to: whole copies of the model
    capped, growing = 0.0, total  # below the next peer's full point: shares add up to capped + growing * t
    for seconds, s, m in full:
        if capped + growing * seconds >= target:
            return (target - capped) / growing
        capped, growing = capped + m, growing - s
    return full[-1][0]  # even with every memory full the shares fall short: everyone fills its memory


def stage_blocks(speed: float, memory_blocks: int, others: Mapping[str, tuple[float, int | None]],
                 num_blocks: int) -> int:
    """How many blocks a peer of `speed` holding `memory_blocks` serves: its stage share (module docstring)."""
    everyone = [(speed, memory_blocks)] + [(s, m or 1) for s, m in others.values() if s > 0]
    return whole_shares(everyone, num_blocks)[0]


def whole_shares(everyone: list[tuple[float, int]], num_blocks: int) -> list[int]:
    """Each (speed, memory in blocks) peer's share in whole blocks: `s * T` rounded down (at least 1, at
    most its memory), then the blocks those leave short of the whole copies, one at a time to the peer
    whose stage stays quickest with one more. So the slowest stage is as quick as whole blocks allow:
    rounding every share up gave each peer up to a block more, which costs the slowest peer the most
    time (measured: 5 blocks for a share of 4.25 made its hop 18% slower than the stage time)."""
    stage = stage_time(everyone, num_blocks)
    room = [max(1, min(m, num_blocks)) for _, m in everyone]
    counts = [max(1, min(r, math.floor(s * stage + 1e-9))) for (s, _), r in zip(everyone, room)]
    short = round(sum(min(r, s * stage) for (s, _), r in zip(everyone, room))) - sum(counts)
    queue = [((n + 1) / s, -s, i) for i, ((s, _), n, r) in enumerate(zip(everyone, counts, room)) if n < r]
    heapq.heapify(queue)
    while short > 0 and queue:
        _, _, i = heapq.heappop(queue)
        counts[i] += 1
        short -= 1
        s = everyone[i][0]
        if counts[i] < room[i]:
            heapq.heappush(queue, ((counts[i] + 1) / s, -s, i))
    return counts


def region(others: list[Server], near: set[str] | None, memory_blocks: int, num_blocks: int) -> list[float] | None:
    """The capacities of the `near` peers' servers alone, when they and this peer (room for `memory_blocks`)
    have room for the whole model; None otherwise, or with no distances known (`near` None)."""
    return None if near is None else _region_caps([s for s in others if s.peer in near], memory_blocks, num_blocks)


def _region_caps(mine: list[Server], memory_blocks: int, num_blocks: int) -> list[float] | None:
    room = memory_blocks + sum(m or 0 for _, m in peers(mine).values())
    return capacities(num_blocks, mine) if room >= num_blocks else None


def _region_terms(others: list[Server], near: set[str] | None, speed: float, memory_blocks: int,
                  num_blocks: int) -> tuple[int, list[float] | None]:
    """(the stage share, the region's capacities or None). With distances known the share is taken among the
    region's peers (its clients' pipelines are made of them): the first peer of a region takes what it would
    alone, so that the next ones can complete the chain."""
    if near is None:
        return stage_blocks(speed, memory_blocks, peers(others), num_blocks), None
    mine = [s for s in others if s.peer in near]
    return stage_blocks(speed, memory_blocks, peers(mine), num_blocks), _region_caps(mine, memory_blocks, num_blocks)


def plan(served: Iterable[Server], peer: str, speed: float, memory_blocks: int, num_blocks: int,
         near: set[str] | None = None, min_blocks: int = 1, starts: Collection[int] | None = None) -> Score:
    """Where a peer of `speed` that can hold `memory_blocks` blocks should serve, given the other servers
    (its own records are left out) and the peers `near` it. `min_blocks` = `memory_blocks` fixes the length
    (a peer told how many blocks to serve, which has no stage share): `best_span`, so beyond the share only to
    fill holes. `starts`: the blocks a span of the model may start at (None: every block)."""
    others = [s for s in served if s.peer != peer]
    prefer, local = _region_terms(others, near, speed, memory_blocks, num_blocks)
    return best_span(capacities(num_blocks, others), speed, memory_blocks,
                     prefer if min_blocks < memory_blocks else None, min_blocks, local, starts)


def choose(caps: list[float], speed: float, memory_blocks: int, prefer_blocks: int | None,
           starts: Collection[int] | None = None) -> Score:
    """A joining peer's span on top of `caps`: `best_span`, so beyond its stage share only to fill holes."""
    return best_span(caps, speed, memory_blocks, prefer_blocks, starts=starts)


def decide(served: Iterable[Server], peer: str, speed: float, memory_blocks: int, num_blocks: int, current: Span,
           margin: float = MARGIN, min_blocks: int = 1, near: set[str] | None = None,
           starts: Collection[int] | None = None) -> Score | None:
    """Whether a peer serving `current` should move (the span to move to) or stay (None); see `rebalance`.
    `min_blocks` = `memory_blocks` keeps the span's length (a peer told how many blocks to serve); `starts`: the
    blocks a span of the model may start at (None: every block)."""
    others = [s for s in served if s.peer != peer]
    prefer, local = _region_terms(others, near, speed, memory_blocks, num_blocks)
    return rebalance(capacities(num_blocks, others), speed, current, memory_blocks, margin, prefer, min_blocks, local,
                     starts)


def claims_before(served: Iterable[Server], peer: str, since: float) -> list[Server]:
    """The servers to count when `peer` checks its own claim made at `since`: every online one and the
    joining claims made before it (the earlier claim wins; equal times: the lower peer id)."""
    return [s for s in served if s.peer != peer and (s.state != "joining" or (s.since, s.peer) < (since, peer))]


def ideal(num_blocks: int, speeds: Iterable[float]) -> float:
    """The bottleneck if all capacity were spread perfectly evenly: total speed over the blocks."""
    return sum(speeds) / num_blocks
