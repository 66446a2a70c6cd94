"""Choosing a route: the cheapest chain of peers that covers a span of blocks. Pure: no network.

A route is a list of hops `(peer, span)` whose spans are consecutive and cover the requested span.
Its cost is the sum over hops of a delay plus, for each block of the hop, the peer's compute time per
block scaled by its load: `block_ms * (1 + LOAD_WEIGHT * load)`, where load counts the sessions open
there (the larger of what it announced and what this client holds there itself: the announcement
includes ours once the peer re-announces) plus the steps it announced waiting for compute. A peer
batches the decode steps of its sessions, so each extra session slows every step by a share of a step,
not a whole one. The delay of a hop is the client's round trip to its peer. When chaining, activations go
client -> first peer -> ... -> last peer -> client, so a route costs one way around that loop: each link
the previous hop's peer announced to the next (`Offer.links`) replaces half of each of the two client round
trips it saves (`chain_correction_ms`); with no links known, a chained route costs what it would relayed.
Peers near each other but far from the client win where their links say so; replicas near the client win
over equal ones elsewhere. Figures the client measured itself win over what peers announce.

What a peer announces is believed only as far as the client checked it, since anyone can sign records
for as many identities as they like (Sybils) and claim any speed:
- A peer that never answered this client (no ping, no step) is *unproven*. A route uses an unproven
  peer for a block only when no proven eligible peer serves that block: the first key of a route's cost
  is the number of its blocks served by unproven peers, before any time in ms. No priced penalty would
  do, since a proven honest peer may be slower than any constant. Among themselves unproven peers cost
  `UNMEASURED_DELAY_MS` plus `UNKNOWN_BLOCK_MS` per block whatever they claim, so an absurd claim wins
  nothing; `SwarmClient.route` pings them before it settles for one.
- A peer that answered a ping but ran no decode step for us is priced by its claim, but at most
  `CLAIM_CAP` times as fast per block as the fastest peer this client measured by its steps: a new peer
  that is really faster still wins, and a reachable liar wins no more than that factor, so load still
  spreads sessions and it gets one chance to fail (then it is banned) or be measured.
- A peer measured by its decode steps is priced by them alone.

Eligible peers are online, not banned, not excluded by the caller (e.g. slow for this session) and,
when a session needs cache, announce (or were last measured with) room for it. If some block has no
eligible peer there is no route, and `NoRoute` names the blocks; otherwise the cheapest path over
(block boundary, last peer), boundary by boundary, is the route (the last peer only matters for peers
announcing links). Ties: fewer hops, then peer id, so choices are reproducible; with an `rng`, a random
order of the peers instead (seeded per session: equal replicas share the load, reproducibly). A route cuts
from one hop to the next only at a block a span of the model may start at (`swarm.span.span_starts`): a
hop is part of its peer's span, and the peer refuses one that starts elsewhere.

Also pure and here: `BlockWait`, how long a session goes on asking for a route while blocks have no
live peer, and the check a session makes once, after its first decode steps, of whether its route is
much slower than assumed (`slower_than_assumed`, `worth_switching`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from swarm.errors import NoRoute
from swarm.formats import PRECISIONS, format_name, precision_rank
from swarm.net.records import LINK_ID_CHARS
from swarm.span import Span

UNMEASURED_DELAY_MS = 50.0  # network delay assumed for a peer never measured
FORMAT_PENALTY_MS = 10_000.0  # a hop in another weight format than the one preferred (failover keeps formats)
UNKNOWN_BLOCK_MS = 100.0  # compute per block assumed for an unproven peer, or one that announced no throughput
CLAIM_CAP = 2.0  # a claim counts at most this many times as fast per block as the fastest peer measured by steps
# Each session (or queued step) at a peer slows its steps by this share of a step: a peer batches the decode
# steps of its sessions, and 8 sessions on one peer ran 3.43x one session's tokens/s (docs/benchmarks.md,
# batching), i.e. each step took 8 / 3.43 = 2.33x, 1 + 0.19 per other session.
LOAD_WEIGHT = 0.2
NO_LOAD: Mapping[str, int] = MappingProxyType({})
REROUTE_AFTER = 4  # one-token steps of a session before its route is checked against what it measured
REROUTE_SLOWER = 2.0  # ... a hop measured this many times slower per block than assumed makes it look again,
REROUTE_GAIN = 0.3  # ... and it switches if the new route costs at least this share less


@dataclass(frozen=True)
class Offer:
    """One peer's announced service, as read from the DHT."""

    peer: str
    span: Span
    throughput: float = 0.0  # span decode tokens/s, self-reported
    cache_tokens_left: int = 0  # self-reported at the last announcement
    sessions: int | None = None  # sessions open there at the last announcement (None: an older peer)
    queued: int | None = None  # steps waiting for its compute, likewise
    # round trips in ms it measured to peers it pushes to, by the last `LINK_ID_CHARS` of their ids
    links: Mapping[str, float] | None = field(default=None, hash=False)
    dtype: str = "float32"  # how it computes: dtype and weight format (swarm.model.precision)
    quant: str = "none"

    @property
    def format(self) -> str:
        return format_name(self.dtype, self.quant)

    @property
    def rank(self) -> int:
        return precision_rank(self.dtype, self.quant)


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

    def delay_or_assumed(self, peer: str) -> float:
        """The measured round trip, else `UNMEASURED_DELAY_MS`."""
        delay = self.delay_ms(peer)
        return UNMEASURED_DELAY_MS if delay is None else delay

    def measured_block_ms(self, peer: str) -> float | None:
        """Compute per block from the peer's own decode steps; None before the first."""
        figures = self.peers.get(peer)
        return None if figures is None else figures.block_ms.value

    def proven(self, peer: str) -> bool:
        """Whether the peer ever answered this client (a ping or a step)."""
        return self.delay_ms(peer) is not None

    def fastest_block_ms(self) -> float | None:
        """The least compute per block measured by any peer's decode steps; None before the first."""
        return min((f.block_ms.value for f in self.peers.values() if f.block_ms.value is not None), default=None)

    def block_ms(self, offer: Offer) -> float:
        """Compute per block: measured, else the claim of a proven peer capped by `CLAIM_CAP`, else
        `UNKNOWN_BLOCK_MS` (see the module docstring)."""
        figures = self.peers.get(offer.peer)
        if figures is not None and figures.block_ms.value is not None:
            return figures.block_ms.value
        if offer.throughput <= 0 or not self.proven(offer.peer):
            return UNKNOWN_BLOCK_MS
        claimed, fastest = 1000.0 / (offer.throughput * len(offer.span)), self.fastest_block_ms()
        return claimed if fastest is None else max(claimed, fastest / CLAIM_CAP)

    def expected_ms(self, offer: Offer, blocks: int, tokens: int) -> float:
        """How long a step of `tokens` through `blocks` of this peer should take, network included."""
        return self.delay_or_assumed(offer.peer) + tokens * blocks * self.block_ms(offer)


class Bans:
    """Peers that failed recently, each banned for `base * 2**(failures-1)` seconds (at most `limit`), or
    for a set time (`ban(..., seconds)`: caught lying). A success resets a peer's failure count."""

    def __init__(self, base: float = 5.0, limit: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.base, self.limit, self.clock = base, limit, clock
        self.failures: dict[str, int] = {}
        self.until: dict[str, float] = {}
        self.reasons: dict[str, str] = {}
        self.fixed: set[str] = set()  # banned for a set time that neither a success nor a ping lifts

    def ban(self, peer: str, reason: str, seconds: float | None = None, fixed: bool = True) -> float:
        """Ban `peer` for the usual backoff, or for `seconds`: then, if `fixed`, as a peer caught lying (no success
        lifts it), else as a failure (a success, or a ping when nothing else serves its blocks, lifts it)."""
        count = self.failures.get(peer, 0) + 1
        self.failures[peer] = count
        if seconds is None:
            seconds = min(self.base * 2.0 ** min(count - 1, 60), self.limit)
        elif fixed:
            self.fixed.add(peer)
        self.until[peer] = max(self.until.get(peer, -math.inf), self.clock() + seconds)
        self.reasons[peer] = reason
        return seconds

    def banned(self, peer: str) -> bool:
        return self.until.get(peer, -math.inf) > self.clock()

    def _fixed(self, peer: str) -> bool:
        if peer in self.fixed and not self.banned(peer):
            self.fixed.discard(peer)  # served its time
        return peer in self.fixed

    def lift(self, peer: str) -> None:
        if not self._fixed(peer):
            self.until.pop(peer, None)

    def succeeded(self, peer: str) -> None:
        if self._fixed(peer):
            return
        self.failures.pop(peer, None)
        self.until.pop(peer, None)
        self.reasons.pop(peer, None)


def eligible(offers: Iterable[Offer], measurements: Measurements, bans: Bans, exclude: Iterable[str] = (),
             cache_tokens: int = 0, min_rank: int = 0) -> list[Offer]:
    excluded = set(exclude)
    return [o for o in offers if o.peer not in excluded and not bans.banned(o.peer) and o.rank >= min_rank
            and (cache_tokens <= 0 or measurements.cache_left(o) >= cache_tokens)]


def load_of(offer: Offer, own: Mapping[str, int]) -> int:
    """Sessions and steps competing for the peer's compute (see the module docstring)."""
    return max(offer.sessions or 0, own.get(offer.peer, 0)) + (offer.queued or 0)


def block_cost_ms(offer: Offer, measurements: Measurements, own: Mapping[str, int] = NO_LOAD) -> float:
    """What one decode token through one block of this peer costs now, its load included."""
    return measurements.block_ms(offer) * (1 + LOAD_WEIGHT * load_of(offer, own))


def link_ms(before: Offer | None, peer: str) -> float | None:
    """The round trip `before`'s peer announced to `peer`, if it did."""
    if before is None or not before.links:
        return None
    ms = before.links.get(peer[-LINK_ID_CHARS:])
    return ms if isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0 else None


def chain_correction_ms(before: Offer | None, offer: Offer, measurements: Measurements) -> float:
    """What a chained hop from `before`'s peer to `offer`'s saves on the client's relaying, priced as half
    of each round trip (one way): the activations take the link `before` announced (L / 2) instead of going
    back to the client (d(before) / 2) and out again (d(offer) / 2). So a chained route costs one way around
    its loop, client to first peer, peer to peer, last peer back; with no link known, as relayed. 0 when
    `before` announced no link to this peer."""
    linked = link_ms(before, offer.peer)
    if linked is None:
        return 0.0
    return (linked - measurements.delay_or_assumed(before.peer) - measurements.delay_or_assumed(offer.peer)) / 2


def hop_cost_ms(offer: Offer, blocks: int, measurements: Measurements, own: Mapping[str, int] = NO_LOAD,
                before: Offer | None = None, chain: bool = False) -> float:
    """A hop's cost: the client's round trip to its peer (less what a link from the previous hop's peer saves,
    when chaining) plus its blocks' compute under load."""
    delay = measurements.delay_or_assumed(offer.peer)
    if chain:
        delay += chain_correction_ms(before, offer, measurements)
    return delay + blocks * block_cost_ms(offer, measurements, own)


def route_cost_ms(hops: Sequence[Hop], offers: Mapping[str, Offer], measurements: Measurements,
                  own: Mapping[str, int] = NO_LOAD, chain: bool = False) -> float:
    """The cost `find_route` gives a route: the sum of its hops' costs, the predicted time of one decode
    token through it (network and compute)."""
    total, before = 0.0, None
    for hop in hops:
        offer = offers.get(hop.peer) or Offer(hop.peer, hop.span)
        total += hop_cost_ms(offer, len(hop.span), measurements, own, before, chain)
        before = offer
    return total


def find_route(offers: Iterable[Offer], span: Span, measurements: Measurements, bans: Bans, *,
               exclude: Iterable[str] = (), cache_tokens: int = 0, model: str = "the model",
               load: Mapping[str, int] | None = None, chain: bool = False,
               rng: random.Random | None = None, min_rank: int = 0, prefer: str | None = None,
               starts: Collection[int] | None = None) -> list[Hop]:
    """The cheapest chain of hops covering `span` (see the module docstring); `NoRoute` if none.

    `load`: sessions this client holds at each peer. `chain`: price later hops by the links peers
    announced. `rng`: break ties by a random order of peers drawn from it (default: by peer id).
    `min_rank`: only peers whose weights are at least that precise (`swarm.formats.PRECISIONS`).
    `prefer`: a weight format; a hop in another format costs `FORMAT_PENALTY_MS` more, so it is chosen
    only when no route in that format exists (failover keeps a span's format). `starts`: the blocks a hop may
    start at (`swarm.span.span_starts`; None: every block)."""
    offers, exclude, own = list(offers), set(exclude), load or NO_LOAD
    cuts = None if starts is None else set(starts)
    usable = eligible(offers, measurements, bans, exclude, cache_tokens, min_rank)
    missing = [b for b in span if not any(o.span.start <= b < o.span.end for o in usable)]
    if missing:
        raise NoRoute(_missing_message(missing, offers, measurements, bans, exclude, cache_tokens, model, min_rank),
                      tuple(missing))
    names = sorted({o.peer for o in usable})  # sorted, so that a seeded rng gives the same order every time
    rank = dict(zip(names, (rng.random() for _ in names))) if rng is not None else {p: p for p in names}
    by_peer = {o.peer: o for o in usable}
    priced = []  # per offer: compute per block under load, the client's delay, unproven (0/1), next state
    for offer in usable:
        priced.append((offer, block_cost_ms(offer, measurements, own), measurements.delay_or_assumed(offer.peer),
                       int(not measurements.proven(offer.peer)), offer.peer if chain and offer.links else ""))
    # The cheapest path over states (boundary, last peer), boundary by boundary (every hop moves forward, so
    # this order is topological, and a hop may cost less than nothing: see `chain_correction_ms`); the last
    # peer is kept only when its links can price the next hop ('' otherwise). Cost: (blocks at unproven
    # peers, ms, hops, ranks).
    start = (span.start, "")
    best: dict[tuple[int, str], tuple[int, float, int, tuple]] = {start: (0, 0.0, 0, ())}
    came: dict[tuple[int, str], tuple[tuple[int, str], Offer]] = {}
    at: dict[int, set[str]] = {span.start: {""}}  # boundary -> last peers of the states reached there
    for here in range(span.start, span.end):
        for last in sorted(at.pop(here, ())):
            state = (here, last)
            unproven, cost, hops, key = best[state]
            before = by_peer.get(last) if last else None
            for offer, per_block, delay, doubt, after in priced:
                if not offer.span.start <= here < offer.span.end:
                    continue
                hop_ms = delay + chain_correction_ms(before, offer, measurements)
                if prefer is not None and offer.format != prefer:
                    hop_ms += FORMAT_PENALTY_MS
                ranks = key + (rank[offer.peer],)
                for there in range(here + 1, min(offer.span.end, span.end) + 1):
                    if cuts is not None and there < span.end and there not in cuts:
                        continue  # the next hop could not start there
                    blocks = there - here
                    entry = (unproven + doubt * blocks, cost + hop_ms + blocks * per_block, hops + 1, ranks)
                    target = (there, after)
                    if target not in best or entry < best[target]:
                        best[target], came[target] = entry, (state, offer)
                        at.setdefault(there, set()).add(after)
    ends = [s for s in best if s[0] == span.end]
    if not ends:  # every block is served, but no chain of the peers' spans cuts only where a hop may start
        reached = max(s[0] for s in best)
        missing = tuple(range(reached, span.end))
        raise NoRoute(f"no chain of live peers serves blocks {ranges_text(missing)} of {model} cutting between "
                      f"peers only where a span may start (blocks {ranges_text(sorted(cuts or ()))})", missing)
    state = min(ends, key=best.__getitem__)
    route = []
    while state != start:
        prev, offer = came[state]
        route.append(Hop(offer.peer, Span(prev[0], state[0])))
        state = prev
    return route[::-1]


def ranges_text(blocks: Sequence[int]) -> str:
    """Blocks as half-open ranges: [3, 4, 5, 8] -> '[3:6), [8:9)'."""
    blocks = sorted(blocks)
    if not blocks:
        return "none"
    ranges, start = [], blocks[0]
    for a, b in zip(blocks, blocks[1:] + [None]):
        if b != a + 1:
            ranges.append(str(Span(start, a + 1)))
            start = b
    return ", ".join(ranges)


class BlockWait:
    """A bounded wait for blocks to be served again: a try about every `interval` seconds (none sooner
    than `interval` after the previous one began, the last one at the deadline) until `seconds` have
    passed since it began, and at most `seconds / interval + 1` tries whatever the clock does."""

    def __init__(self, seconds: float, interval: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.interval, self.clock = seconds, interval, clock
        self.started = self.last = clock()
        self.tries = 0
        self.max_tries = math.ceil(seconds / interval) + 1 if seconds > 0 else 0

    @property
    def waited(self) -> float:
        return self.clock() - self.started

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next try; None once the wait is over."""
        now = self.clock()
        left = self.started + self.seconds - now
        if left <= 0 or self.tries >= self.max_tries:
            return None
        self.tries += 1
        delay = min(max(self.last + self.interval - now, 0.0), left)
        self.last = now + delay
        return delay


def slower_than_assumed(assumed: Sequence[float], measured: Sequence[float | None],
                        factor: float = REROUTE_SLOWER) -> list[int]:
    """The hops whose measured decode step time is above `factor` times what their route assumed when it
    was chosen (hops not measured yet never count)."""
    return [i for i, (a, m) in enumerate(zip(assumed, measured)) if m is not None and m > factor * a]


def worth_switching(current_ms: float, new_ms: float, gain: float = REROUTE_GAIN) -> bool:
    """Whether a new route is cheaper than the current one by a clear margin (`gain` of its cost)."""
    return new_ms < (1 - gain) * current_ms


def _missing_message(missing: list[int], offers: list[Offer], measurements: Measurements, bans: Bans,
                     exclude: set[str], cache_tokens: int, model: str, min_rank: int = 0) -> str:
    covering = [o for o in offers if any(o.span.start <= b < o.span.end for b in missing)]
    why = []
    if banned := [o for o in covering if bans.banned(o.peer)]:
        why.append(f"{len(banned)} failed recently ({', '.join(sorted({bans.reasons.get(o.peer, '?') for o in banned}))})")
    if full := [o for o in covering if not bans.banned(o.peer) and o.peer not in exclude
                and cache_tokens > 0 and measurements.cache_left(o) < cache_tokens]:
        why.append(f"{len(full)} without room for {cache_tokens} cache tokens")
    if slow := [o for o in covering if o.peer in exclude and not bans.banned(o.peer)]:
        why.append(f"{len(slow)} avoided for this session")
    if coarse := [o for o in covering if o.rank < min_rank]:
        why.append(f"{len(coarse)} in a format below {PRECISIONS[min_rank]} ({', '.join(sorted({o.format for o in coarse}))})")
    detail = f"; peers announcing them: {len(covering)}" + (f", of which {', '.join(why)}" if why else "")
    return f"no live peer serves blocks {ranges_text(missing)} of {model}{detail}"
