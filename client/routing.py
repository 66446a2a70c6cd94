"""Choosing a route: the cheapest chain of peers that covers a span of blocks. Pure: no network.

A route is a list of hops `(peer, span)` whose spans are consecutive and cover the requested span.
Its cost is the sum over hops of the peer's network delay plus, for each block of the hop, the peer's
compute time per block. Figures the client measured itself win over what peers announce; a peer
with no measurement of its delay gets a pessimistic default, so a measured peer is preferred at
equal speed.

Eligible peers are online, not banned, not excluded by the caller (e.g. slow for this session) and,
when a session needs cache, announce (or were last measured with) room for it. If some block has no
eligible peer there is no route, and `NoRoute` names the blocks; otherwise Dijkstra over block
boundaries finds the cheapest chain (ties: fewer hops, then peer id, so choices are reproducible).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from swarm.errors import NoRoute
from swarm.span import Span

UNMEASURED_DELAY_MS = 50.0  # network delay assumed for a peer never measured
UNKNOWN_BLOCK_MS = 100.0  # compute per block assumed for a peer that announced no throughput


@dataclass(frozen=True)
class Offer:
    """One peer's announced service, as read from the DHT."""

    peer: str
    span: Span
    throughput: float = 0.0  # span decode tokens/s, self-reported
    cache_tokens_left: int = 0  # self-reported at the last announcement


@dataclass(frozen=True)
class Hop:
    peer: str
    span: Span

    def __str__(self) -> str:
        return f"{self.span} at {self.peer[-8:]}"


class Ema:
    """Exponential moving average; `None` until the first sample."""

    def __init__(self, alpha: float = 0.3):
        self.alpha, self.value = alpha, None

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value


@dataclass
class PeerFigures:
    delay_ms: Ema = field(default_factory=Ema)  # round trip minus compute
    block_ms: Ema = field(default_factory=Ema)  # one decode token through one block
    cache_left: int | None = None  # from the peer's last reply, at `cache_seen`
    cache_seen: float = -math.inf


class Measurements:
    """What the client measured about each peer; used for costs and deadlines."""

    def __init__(self, cache_ttl: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.peers: dict[str, PeerFigures] = {}
        self.cache_ttl, self.clock = cache_ttl, clock

    def of(self, peer: str) -> PeerFigures:
        return self.peers.setdefault(peer, PeerFigures())

    def ping(self, peer: str, rtt_ms: float) -> None:
        self.of(peer).delay_ms.add(rtt_ms)

    def step(self, peer: str, rtt_ms: float, compute_ms: float, tokens: int, blocks: int) -> None:
        """A step's round trip and the compute time the peer reported (clamped: a peer cannot make itself
        look faster than the round trip we measured, or negative)."""
        compute_ms = min(max(compute_ms, 0.0), rtt_ms) if math.isfinite(compute_ms) else rtt_ms
        figures = self.of(peer)
        figures.delay_ms.add(max(rtt_ms - compute_ms, 0.0))
        if tokens == 1 and blocks > 0:  # decode steps define per-block speed; prefill tokens are cheaper
            figures.block_ms.add(compute_ms / blocks)

    def cache(self, peer: str, tokens_left: int) -> None:
        figures = self.of(peer)
        figures.cache_left, figures.cache_seen = tokens_left, self.clock()

    def forget_cache(self, peer: str) -> None:
        """The figure is stale (our session there closed): use the announcement again."""
        if peer in self.peers:
            self.peers[peer].cache_seen = -math.inf

    def cache_left(self, offer: Offer) -> int:
        figures = self.peers.get(offer.peer)
        if figures is not None and self.clock() - figures.cache_seen <= self.cache_ttl:
            return figures.cache_left
        return offer.cache_tokens_left

    def delay_ms(self, peer: str) -> float | None:
        figures = self.peers.get(peer)
        return None if figures is None else figures.delay_ms.value

    def block_ms(self, offer: Offer) -> float:
        figures = self.peers.get(offer.peer)
        if figures is not None and figures.block_ms.value is not None:
            return figures.block_ms.value
        if offer.throughput > 0:
            return 1000.0 / (offer.throughput * len(offer.span))
        return UNKNOWN_BLOCK_MS

    def expected_ms(self, offer: Offer, blocks: int, tokens: int) -> float:
        """How long a step of `tokens` through `blocks` of this peer should take, network included."""
        delay = self.delay_ms(offer.peer)
        return (UNMEASURED_DELAY_MS if delay is None else delay) + tokens * blocks * self.block_ms(offer)


class Bans:
    """Peers that failed recently, each banned for `base * 2**(failures-1)` seconds (at most `limit`).
    A success resets a peer's failure count."""

    def __init__(self, base: float = 5.0, limit: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.base, self.limit, self.clock = base, limit, clock
        self.failures: dict[str, int] = {}
        self.until: dict[str, float] = {}
        self.reasons: dict[str, str] = {}

    def ban(self, peer: str, reason: str) -> float:
        count = self.failures.get(peer, 0) + 1
        self.failures[peer] = count
        seconds = min(self.base * 2.0 ** min(count - 1, 60), self.limit)
        self.until[peer] = self.clock() + seconds
        self.reasons[peer] = reason
        return seconds

    def banned(self, peer: str) -> bool:
        return self.until.get(peer, -math.inf) > self.clock()

    def lift(self, peer: str) -> None:
        self.until.pop(peer, None)

    def succeeded(self, peer: str) -> None:
        self.failures.pop(peer, None)
        self.until.pop(peer, None)
        self.reasons.pop(peer, None)


def eligible(offers: Iterable[Offer], measurements: Measurements, bans: Bans, exclude: Iterable[str] = (),
             cache_tokens: int = 0) -> list[Offer]:
    excluded = set(exclude)
    return [o for o in offers if o.peer not in excluded and not bans.banned(o.peer)
            and (cache_tokens <= 0 or measurements.cache_left(o) >= cache_tokens)]


def find_route(offers: Iterable[Offer], span: Span, measurements: Measurements, bans: Bans, *,
               exclude: Iterable[str] = (), cache_tokens: int = 0, model: str = "the model") -> list[Hop]:
    """The cheapest chain of hops covering `span` (see the module docstring); `NoRoute` if none."""
    offers, exclude = list(offers), set(exclude)
    usable = eligible(offers, measurements, bans, exclude, cache_tokens)
    missing = [b for b in span if not any(o.span.start <= b < o.span.end for o in usable)]
    if missing:
        raise NoRoute(_missing_message(missing, offers, measurements, bans, exclude, cache_tokens, model),
                      tuple(missing))
    # Dijkstra over boundaries span.start..span.end; state cost = (ms, hops, tie-break key)
    best: dict[int, tuple[float, int, tuple]] = {span.start: (0.0, 0, ())}
    came: dict[int, tuple[int, Offer]] = {}
    queue = [(0.0, 0, (), span.start)]
    while queue:
        cost, hops, key, here = heapq.heappop(queue)
        if best.get(here) != (cost, hops, key) or here == span.end:
            continue
        for offer in usable:
            if not offer.span.start <= here < offer.span.end:
                continue
            delay = measurements.delay_ms(offer.peer)
            hop_ms = UNMEASURED_DELAY_MS if delay is None else delay
            per_block = measurements.block_ms(offer)
            for there in range(here + 1, min(offer.span.end, span.end) + 1):
                entry = (cost + hop_ms + (there - here) * per_block, hops + 1, key + (offer.peer,))
                if there not in best or entry < best[there]:
                    best[there], came[there] = entry, (here, offer)
                    heapq.heappush(queue, (*entry, there))
    route, here = [], span.end
    while here != span.start:
        prev, offer = came[here]
        route.append(Hop(offer.peer, Span(prev, here)))
        here = prev
    return route[::-1]


def _missing_message(missing: list[int], offers: list[Offer], measurements: Measurements, bans: Bans,
                     exclude: set[str], cache_tokens: int, model: str) -> str:
    ranges, start = [], missing[0]
    for a, b in zip(missing, missing[1:] + [None]):
        if b != a + 1:
            ranges.append(str(Span(start, a + 1)))
            start = b
    covering = [o for o in offers if any(o.span.start <= b < o.span.end for b in missing)]
    why = []
    if banned := [o for o in covering if bans.banned(o.peer)]:
        why.append(f"{len(banned)} failed recently ({', '.join(sorted({bans.reasons.get(o.peer, '?') for o in banned}))})")
    if full := [o for o in covering if not bans.banned(o.peer) and o.peer not in exclude
                and cache_tokens > 0 and measurements.cache_left(o) < cache_tokens]:
        why.append(f"{len(full)} without room for {cache_tokens} cache tokens")
    if slow := [o for o in covering if o.peer in exclude and not bans.banned(o.peer)]:
        why.append(f"{len(slow)} avoided for this session")
    detail = f"; peers announcing them: {len(covering)}" + (f", of which {', '.join(why)}" if why else "")
    return f"no live peer serves blocks {', '.join(ranges)} of {model}{detail}"
