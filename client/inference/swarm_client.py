"""The client's view of one model in the swarm: who serves what, how fast, who failed. Async.

`SwarmClient` reads announcements from the DHT (at most every `refresh_interval`, or sooner after a
failure), pings the peers it has not measured, keeps the measured figures, the bans and the hops its
own sessions hold at each peer (their load), and answers `route(span)` with the cheapest chain
(`client.inference.routing`); `wait_for_route` also waits, bounded, for blocks with no live peer to be served
again. Sessions (`client.inference.session`) and stateless forwards (`client.inference.forward`) use it; neither
talks to the DHT itself.

Records cost nothing to forge in numbers (each identity signs its own), so a route is made of peers
that answered this client wherever one serves the block (`client.inference.routing`), and `route` pings the
unproven candidates of the blocks it lacks before it settles: in random order (their claims and sequence
numbers are theirs to choose), `MAX_PINGS` at a time, at most `PING_ROUNDS` times, each round at most
`ping_timeout`. A record with nothing behind it is banned by its failed ping and never used while a
peer that answered serves its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from client.inference import hops, peer_session
from client.config import ClientConfig
from client.inference.encodings import Encodings, choose_encodings
from client.inference.failures import FailurePolicy, caught_lying, reason_of
from client.inference.stalls import STALL_S, StallMemory
from client.inference.routing import (Bans, BlockWait, Hop, Measurements, Offer, block_cost_ms, eligible, find_route,
                            hop_cost_ms, ranges_text, route_cost_ms)
from swarm.net import discovery, view
from swarm.errors import NoRoute, SwarmError
from swarm.formats import PRECISIONS, format_name
from swarm.span import Span
from swarm.net.transport import Node, describe_peer

logger = logging.getLogger(__name__)

MAX_PINGS = 32  # peers pinged at once at most: per refresh, per round of `route`, per second chance
PING_ROUNDS = 3  # rounds of pings a route may take to replace unproven peers by peers that answered
SECOND_CHANCE = ("timeout", "connection_lost", "stalled")  # bans a successful ping lifts when there is no other route


@dataclass(frozen=True)
class PeerState:
    """One peer as `swarm status` shows it."""

    peer: str
    span: Span
    state: str
    throughput: float
    cache_tokens_left: int
    version: str
    latency_ms: float | None
    sessions: int | None = None  # announced load (None: a peer that does not announce it)
    queued: int | None = None
    since: float | None = None
    links: dict | None = None
    device: str = "cpu"  # how it computes, as announced
    dtype: str = "float32"
    quant: str = "none"
    digest: str | None = None  # which weights (None: a peer that does not say)
    reach: str | None = None  # "direct" or "relay" (None: on one machine, or a peer that does not say)

    @property
    def format(self) -> str:
        return format_name(self.dtype, self.quant)


class SwarmClient:
    def __init__(self, node: Node, model_id: str, num_blocks: int, config: ClientConfig, digest: str | None = None,
                 floor: float | None = None, referee=None, stalls: StallMemory | None = None,
                 starts: Sequence[int] | None = None):
        self.node, self.model_id, self.num_blocks, self.config = node, model_id, num_blocks, config
        # the blocks a hop may start at (`swarm.span.span_starts`); None: every block (a client without the config)
        self.starts = starts
        # the client's own computation of single blocks (`client.inference.referee.Referee`), settling disputes
        # between two peers; None: a client with no checkpoint at hand (disputes then stay open)
        self.referee = referee
        # peers that stalled a client of this machine (`client.inference.stalls`); None: remembered in this client only
        self.stalls = stalls
        # the spread under which a hidden vector is degenerate (`hops.implausible`; None: without the model's config)
        self.floor = hops.output_floor() if floor is None else floor
        self.digest = digest  # the weights of this client's head: routes only through peers with the same
        self.measurements = Measurements()
        self.bans = Bans(base=config.ban_seconds)
        self.failures = FailurePolicy(self.ban, config.max_retries)
        for peer, left in (self.stalls.load() if self.stalls is not None else {}).items():
            self.bans.ban(peer, "stalled", left, fixed=False)
        self.offers: dict[str, Offer] = {}
        self.relayed_out: dict[str, Span] = {}  # peers behind NATs that this transport cannot dial (left out)
        self.states: dict[str, PeerState] = {}
        self.own_load: Counter[str] = Counter()  # hops of this client's sessions at each peer
        self._sessions_made = 0
        self._refreshed = -float("inf")
        self._lock = asyncio.Lock()

    @property
    def span(self) -> Span:
        return Span(0, self.num_blocks)

    # ---- the view ----

    async def refresh(self, force: bool = False) -> None:
        """Re-read the DHT if the view is older than `refresh_interval` (or, when forced, than 0.5 s)."""
        async with self._lock:
            age = time.monotonic() - self._refreshed
            if age < (0.5 if force else self.config.refresh_interval):
                return
            anns = await discovery.announcements(self.node, self.model_id, self.num_blocks)
            latest: dict[str, object] = {}
            for block_anns in anns.values():
                for ann in block_anns:
                    if ann.peer not in latest or ann.seq > latest[ann.peer].seq:
                        latest[ann.peer] = ann
            # a moving peer has its old span online while the new one loads: route by its newest online span
            allowed = set(self.config.allow_peers)
            # a transport that cannot dial relayed peers leaves them out: never tried, so never banned for it
            relayed_ok = getattr(self.node, "dials_relays", True)
            online = {p: a for p, a in view.online(discovery.same_weights(anns, self.digest)).items()
                      if not allowed or p in allowed}
            self.relayed_out = {p: a.span for p, a in online.items() if not relayed_ok and a.reach == "relay"}
            self.offers = {p: Offer(p, a.span, a.throughput, a.cache_tokens_left, a.sessions, a.queued, a.links,
                                    *a.weights)
                           for p, a in online.items() if a.span.end <= self.num_blocks and p not in self.relayed_out}
            self.states = {p: PeerState(p, a.span, a.state, a.throughput, a.cache_tokens_left, a.version, None,
                                        a.sessions, a.queued, a.since, a.links, a.device or "cpu", *a.weights,
                                        a.digest, a.reach)
                           for p, a in latest.items()}
            self._refreshed = time.monotonic()
            unproven = [p for p in self.offers if not self.measurements.proven(p) and not self.bans.banned(p)]
            await self.ping_all(random.sample(unproven, min(MAX_PINGS, len(unproven))))

    async def ping(self, peer: str) -> float | None:
        """Round trip of an info call in ms, recorded; on failure the peer is banned and None returned."""
        started = time.perf_counter()
        try:
            await asyncio.wait_for(peer_session.info(self.node, peer, timeout=self.config.ping_timeout),
                                   self.config.ping_timeout)
        except (asyncio.TimeoutError, SwarmError) as e:
            self.bans.ban(peer, reason_of(e))  # the usual backoff: a ping is no work refused
            return None
        rtt = (time.perf_counter() - started) * 1e3
        self.measurements.ping(peer, rtt)
        return rtt

    async def ping_all(self, peers: list[str]) -> list[float | None]:
        return list(await asyncio.gather(*(self.ping(p) for p in peers)))

    def ban(self, peer: str, reason: str, seconds: float | None = None) -> None:
        """Avoid `peer` for the usual backoff, or for `seconds`. A peer that missed a deadline before it ever
        completed a step for this client has *stalled*: avoided for `stalls.STALL_S`, by this machine's later
        clients too (`client.inference.stalls`)."""
        again = self.bans.banned(peer)  # e.g. a second-chance ping failing each second of a wait: said once
        stalled = reason == "timeout" and seconds is None and peer not in self.failures.proven
        if stalled:
            reason, seconds = "stalled", STALL_S
            if self.stalls is not None:
                self.stalls.remember(peer, seconds)
        seconds = self.bans.ban(peer, reason, seconds, fixed=not stalled)
        logger.log(logging.DEBUG if again else logging.INFO, "peer %s failed (%s): avoided for %.0f s",
                   describe_peer(peer), reason, seconds)

    # ---- load: the hops our own sessions hold ----

    def claim(self, hops: Iterable[Hop]) -> None:
        """A session now uses these hops: they count toward their peers' load in later routes."""
        self.own_load.update(h.peer for h in hops)

    def release(self, hop: Hop) -> None:
        self.own_load.subtract((hop.peer,))
        if self.own_load[hop.peer] <= 0:
            del self.own_load[hop.peer]

    def session_rng(self) -> random.Random:
        """A new session's tie-breaking: from `route_seed` and the session's number if seeded, else random."""
        self._sessions_made += 1
        seed = self.config.route_seed
        return random.Random() if seed is None else random.Random(f"{seed}/{self._sessions_made}")

    def block_cost_ms(self, hop: Hop, discount: Counter[str] | None = None) -> float:
        """What a decode token through one block of the hop's peer costs now, its load included."""
        return block_cost_ms(self.offer(hop.peer), self.measurements, self._load(discount))

    def hop_cost_ms(self, hop: Hop, discount: Counter[str] | None = None) -> float:
        """What a decode step through the hop should take: the client's delay to its peer plus its blocks'
        compute under load."""
        return hop_cost_ms(self.offer(hop.peer), len(hop.span), self.measurements, self._load(discount))

    def route_cost_ms(self, hops: list[Hop], discount: Counter[str] | None = None) -> float:
        return route_cost_ms(hops, self.offers, self.measurements, self._load(discount), self.config.chain)

    def _load(self, discount: Counter[str] | None) -> Counter[str]:
        return self.own_load - discount if discount else self.own_load

    # ---- routes ----

    async def route(self, span: Span | None = None, *, cache_tokens: int = 0, exclude: frozenset[str] = frozenset(),
                    rng: random.Random | None = None, prefer: str | None = None) -> list[Hop]:
        """The cheapest chain covering `span` (default: every block), refreshing the view if it has none, of
        peers that answered this client wherever one serves the block (`_proven_route`).

        If no chain exists, the view is re-read once; then peers banned for timing out or for a lost
        connection get one ping each (a peer that answers is forgiven), since a slow moment or a transient
        dial failure must not end a generation that has no alternative: peers that answered before first,
        then those that timed out or stalled, then those that could not be reached, `MAX_PINGS` at most.
        Still nothing: `NoRoute` naming the missing blocks.
        """
        span = span or self.span
        await self.refresh()
        try:
            return await self._proven_route(span, cache_tokens, exclude, rng, prefer)
        except NoRoute:
            await self.refresh(force=True)
        try:
            return await self._proven_route(span, cache_tokens, exclude, rng, prefer)
        except NoRoute:
            # peers that answered before first, then those that were slow (alive, likely) before those that could
            # not be reached (a record with nothing behind it fails so), in random order within each: with more
            # of them than one round pings, a fixed order could leave a live one out every time
            timed_out = sorted((p for p, o in self.offers.items() if self.bans.banned(p) and p not in exclude
                                and self.bans.reasons.get(p) in SECOND_CHANCE and o.span.start < span.end
                                and span.start < o.span.end),
                               key=lambda p: (not self.measurements.proven(p),
                                              self.bans.reasons.get(p) == "connection_lost", random.random()))
            if not timed_out:
                raise
            timed_out = timed_out[:MAX_PINGS]
            for peer, rtt in zip(timed_out, await self.ping_all(timed_out)):
                if rtt is not None:
                    self.bans.lift(peer)
            return await self._proven_route(span, cache_tokens, exclude, rng, prefer)

    async def _proven_route(self, span: Span, cache_tokens: int, exclude: frozenset[str],
                            rng: random.Random | None, prefer: str | None) -> list[Hop]:
        """`find`; while its route has blocks at peers that never answered this client, ping the unproven
        candidates of those blocks (random order, `MAX_PINGS` a round, `PING_ROUNDS` rounds) and find again.
        Each pinged candidate is then proven or banned, so the unproven candidates shrink every round."""
        for _ in range(PING_ROUNDS):
            hops = self.find(span, cache_tokens, exclude, rng, prefer=prefer)
            doubtful = [h.span for h in hops if not self.measurements.proven(h.peer)]
            if not doubtful:
                return hops
            usable = eligible(self.offers.values(), self.measurements, self.bans, exclude, cache_tokens,
                              PRECISIONS.index(self.config.min_precision))
            candidates = [o.peer for o in usable if not self.measurements.proven(o.peer)
                          and any(o.span.start < d.end and d.start < o.span.end for d in doubtful)]
            await self.ping_all(random.sample(candidates, min(MAX_PINGS, len(candidates))))
        return self.find(span, cache_tokens, exclude, rng, prefer=prefer)

    async def wait_for_route(self, span: Span, *, cache_tokens: int = 0, exclude: frozenset[str] = frozenset(),
                             rng: random.Random | None = None, on_wait: Callable[[str], None] | None = None,
                             prefer: str | None = None, clock: Callable[[], float] = time.monotonic,
                             sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                             seconds: float | None = None) -> list[Hop]:
        """`route`, but while some blocks have no live peer, ask again about once a second (each time
        re-reading the view and giving banned peers their second chance), for up to `seconds` (default:
        `wait_for_blocks`; what is left of it for a step that waited already); `on_wait(message)` is called
        once when the wait begins. Then `NoRoute`, saying how long it waited. No wait where the blocks' only
        peers were caught lying (`failures.caught_lying`): `NoRoute` at once, naming them."""
        try:
            return await self.route(span, cache_tokens=cache_tokens, exclude=exclude, rng=rng, prefer=prefer)
        except NoRoute as e:
            if liars := caught_lying(e.missing, self.offers.values(), self.bans):
                raise NoRoute(f"no honest peer serves blocks {ranges_text(e.missing)} of {self.model_id}: "
                              + "; ".join(f"peer {describe_peer(p)} {what}" for p, what in sorted(liars.items())),
                              e.missing) from None
            seconds = self.config.wait_for_blocks if seconds is None else seconds
            if seconds <= 0:
                raise
            last = e
        wait = BlockWait(seconds, clock=clock)
        message = (f"waiting up to {seconds:.3g} s for blocks {ranges_text(last.missing)} of "
                   f"{self.model_id} to be served again...")
        logger.info("%s", message)
        if on_wait is not None:
            on_wait(message)
        while (delay := wait.next_delay()) is not None:
            await sleep(delay)
            try:
                hops = await self.route(span, cache_tokens=cache_tokens, exclude=exclude, rng=rng, prefer=prefer)
            except NoRoute as e:
                last = e
                continue
            logger.info("blocks %s of %s are served again, after %.1f s", span, self.model_id, wait.waited)
            return hops
        raise NoRoute(f"{last}; waited {round(wait.waited, 1):g} s for them to be served again", last.missing) from None

    def find(self, span: Span, cache_tokens: int = 0, exclude: frozenset[str] = frozenset(),
             rng: random.Random | None = None, discount: Counter[str] | None = None,
             prefer: str | None = None) -> list[Hop]:
        """The cheapest chain in the current view, without reading the DHT. `discount`: hops of our own not to
        count as load (a session weighing its own route against another). `prefer`: a weight format to keep
        where a route in it exists. Peers below `--min-precision` are never chosen."""
        try:
            return find_route(self.offers.values(), span, self.measurements, self.bans, exclude=exclude,
                              cache_tokens=cache_tokens, model=self.model_id, load=self._load(discount),
                              chain=self.config.chain, rng=rng, min_rank=PRECISIONS.index(self.config.min_precision),
                              prefer=prefer, starts=self.starts)
        except NoRoute as e:
            behind = [p for p, s in self.relayed_out.items() if any(s.start <= b < s.end for b in e.missing)]
            if not behind:
                raise
            raise NoRoute(f"{e}; {len(behind)} more peers serve them behind NATs, which this transport cannot reach "
                          "through their relays (the default transport can)", e.missing) from None

    def encodings(self, hops: list[Hop]) -> Encodings:
        """How a session over `hops` encodes hidden states on the wire (`choose_encodings`)."""
        return choose_encodings(self.config, [(self.offer(h.peer).dtype, self.offer(h.peer).quant) for h in hops])

    def checkers(self, span: Span, *, exclude: set[str], fmt: str, cache_tokens: int = 0,
                 rng: random.Random | None = None) -> list[Hop] | None:
        """The cheapest chain of other peers covering `span` in weight format `fmt`, to check a hop against (one
        peer serving all of it, or several whose spans together cover it; peers of other formats compute other
        numbers); None if there is none."""
        offers = [o for o in self.offers.values() if o.format == fmt]
        try:
            return find_route(offers, span, self.measurements, self.bans, exclude=exclude, cache_tokens=cache_tokens,
                              model=self.model_id, load=self.own_load, rng=rng, starts=self.starts)
        except NoRoute:
            return None

    def offer(self, peer: str) -> Offer:
        return self.offers.get(peer) or Offer(peer, self.span)

    def deadline(self, hop: Hop, tokens: int) -> float:
        """Seconds a step of `tokens` through `hop` may take before it counts as a failure."""
        expected_s = self.measurements.expected_ms(self.offer(hop.peer), len(hop.span), tokens) / 1e3
        return min(self.config.step_timeout, self.config.min_deadline + self.config.deadline_factor * expected_s)

    # ---- what sessions ask of the client: peers' sessions, figures, failures ----

    def succeeded(self, peer: str) -> None:
        self.bans.succeeded(peer)
        self.failures.succeeded(peer)

    def observe(self, hop: Hop, ms: float, compute_ms: float, tokens: int) -> None:
        """A step of `tokens` through `hop` took `ms` (its peer computed `compute_ms` of it)."""
        self.measurements.step(hop.peer, ms, compute_ms, tokens, len(hop.span))
        self.succeeded(hop.peer)

    def open_deadline(self, peer: str) -> float:
        """Seconds opening a session at `peer` may take: a round trip and an allocation, so a measured peer gets
        about `min_deadline` (a black hole that answers pings and never opens costs that, not `open_timeout`)."""
        delay = self.measurements.delay_ms(peer)
        if delay is None:
            return self.config.open_timeout
        return min(self.config.open_timeout, self.config.min_deadline + 1.0 + self.config.deadline_factor * delay / 1e3)

    async def open_session(self, hop: Hop, *, max_length: int, batch: int, encodings: tuple[str, ...],
                           fork: tuple[str, int] | None = None) -> peer_session.PeerSession:
        """A session at the hop's peer; what it says of its free cache is remembered. With `fork` (a session id of
        this client at that peer, a length): a copy of that session's cache up to the length
        (`PeerSession.open`)."""
        # the session's own timeout bounds its steps; each step's real deadline is the caller's
        session = await asyncio.wait_for(
            peer_session.PeerSession.open(self.node, hop.peer, self.model_id, hop.span, max_length=max_length,
                                         batch=batch, encodings=encodings, timeout=self.config.step_timeout,
                                         digest=self.digest, fork=fork),
            self.open_deadline(hop.peer))
        self.measurements.cache(hop.peer, session.opened.cache_tokens_left)
        return session

    async def close_session(self, peer: str, session: peer_session.PeerSession) -> None:
        self.measurements.forget_cache(peer)  # our reservation there ends
        try:
            await asyncio.wait_for(session.close(), 2.0)
        except (asyncio.TimeoutError, SwarmError, OSError):
            pass  # a dead or frozen peer: its cache is reclaimed when it notices the stream is gone

    async def answers(self, peer: str, timeout: float) -> bool:
        """Whether `peer` answers an info call within `timeout` seconds."""
        try:
            await asyncio.wait_for(peer_session.info(self.node, peer), timeout)
            return True
        except (asyncio.TimeoutError, SwarmError):
            return False

    # ---- status ----

    async def status(self) -> tuple[list[PeerState], list[int]]:
        """Every peer that announced blocks of the model (pinged if online) and the blocks no online peer serves."""
        await self.refresh(force=True)
        online = [p for p, s in self.states.items() if s.state == "online"]
        rtts = dict(zip(online, await self.ping_all(online)))
        peers = sorted((PeerState(**{**s.__dict__, "latency_ms": rtts.get(p)}) for p, s in self.states.items()),
                       key=lambda s: (s.span.start, s.span.end, s.peer))
        covered = {b for s in peers if s.state == "online" and s.latency_ms is not None for b in s.span}
        return peers, [b for b in range(self.num_blocks) if b not in covered]
