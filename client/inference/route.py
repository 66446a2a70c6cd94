"""The live route of an inference session: the state its steps share, relayed, chained or pipelined. Async
where it talks to peers.

A `Route` holds the links (each a hop of the route and the session open at its peer, None until opened),
the inputs each hop was sent (`history[boundary]`, positions `[0, length)`, plus the route's output under
`num_blocks` while outputs are checked) with the attention mask of those positions, the hops' claims on
their peers' load, and what each hop's steps measured (the client's figures, the slow-peer detector). It
opens, steps and closes peer sessions and keeps that bookkeeping right while doing so. It decides nothing
about failures: a failed step raises, and the session (`client.inference.session`) decides what follows.
Chained and pipelined steps (`client.inference.chaining`, `client.inference.pipeline`) are functions over
a Route; they call the Route and the client, never the session.

Invariants:
- every link is claimed at its peer (`SwarmClient.claim`) from `adopt` until it is released (`swap`,
  `close`), so concurrent sessions spread over replicas;
- `history` has an entry at the first block of every link that has taken a step, all of the same length
  as the session; a `swap` drops the entries strictly inside the replaced span (rebuilt by replay);
- a link's session is detached (`link.session = None`) before it is closed, so the next attempt opens a
  new one;
- every step through a link has the client's deadline for that hop, and its output passes
  `check_plausible` before it is used or measured.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from client.inference.encodings import REPLAY_ENCODING, Encodings
from client.inference.hops import Inputs, Link, SlowDetector, check_plausible, reclaimed
from client.inference.routing import Hop, slower_than_assumed, worth_switching
from client.inference.swarm_client import SwarmClient
from swarm.errors import NoRoute, SwarmError
from swarm.net.transport import describe_peer
from swarm.span import Span

logger = logging.getLogger(__name__)


class Route:
    """The links of one session's route and what they share (module docstring)."""

    def __init__(self, client: SwarmClient, max_length: int):
        self.client, self.max_length, self.config = client, max_length, client.config
        self.batch: int | None = None  # set by the session's first step
        self.encodings: Encodings | None = None  # chosen with the first route, kept for the session
        self.links: list[Link] = []
        self.history: dict[int, Inputs] = {}
        self.mask: torch.Tensor | None = None  # the attention mask of positions [0, length), when not all ones
        self.closed = False
        self._closing: set[asyncio.Task] = set()  # sessions of replaced links, closed in the background

    @property
    def hops(self) -> list[Hop]:
        return [link.hop for link in self.links]

    @property
    def cache_tokens(self) -> int:
        return self.batch * self.max_length

    # ---- links: claims, swaps, closing ----

    def adopt(self, hops: list[Hop]) -> list[Link]:
        """Links for a newly chosen route (or part of one), with the compute their route assumed; from now on
        they count toward their peers' load."""
        links = [Link(h, assumed_ms=self.client.hop_cost_ms(h), claimed=True) for h in hops]
        self.client.claim(hops)
        return links

    def release(self, link: Link) -> None:
        if link.claimed:
            link.claimed = False
            self.client.release(link.hop)

    def rest(self) -> None:
        """The session is kept for later (idle, `client.api.reuse`): its links stop counting toward their peers'
        load until `resume`."""
        for link in self.links:
            self.release(link)

    def resume(self) -> None:
        resting = [link for link in self.links if not link.claimed]
        for link in resting:
            link.claimed = True
        self.client.claim([link.hop for link in resting])

    def swap(self, i: int, hops: list[Hop]) -> tuple[str, ...]:
        """Links for `hops` in place of link `i`, whose span they cover (its session is left to the caller);
        the new hops, as text."""
        old = self.links[i]
        span = old.hop.span
        self.links[i:i + 1] = self.adopt(hops)
        self.release(old)
        # inputs at boundaries inside the span are rebuilt by replay, hop by hop
        self.history = {b: h for b, h in self.history.items() if not span.start < b < span.end}
        logger.info("blocks %s now at %s", span, ", ".join(str(h) for h in hops))
        return tuple(str(h) for h in hops)

    def close_in_background(self, link: Link) -> None:
        session, link.session = link.session, None  # detached now: the next attempt opens a new one
        if session is None:
            return
        task = asyncio.create_task(self.client.close_session(link.hop.peer, session))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Release every link and close its session (and those closing in the background)."""
        self.closed = True
        links, self.links = self.links, []
        for link in links:
            self.release(link)
        await asyncio.gather(*(self._close_link(link) for link in links), *self._closing)

    async def _close_link(self, link: Link) -> None:
        session, link.session = link.session, None
        if session is not None:
            await self.client.close_session(link.hop.peer, session)

    # ---- the history kept for replay ----

    def truncate(self, position: int) -> None:
        """Forget inputs (and mask) from `position` on: a rollback, or a step that has not succeeded yet."""
        for inputs in self.history.values():
            inputs.truncate(position)
        self.mask = None if self.mask is None else self.mask[:, :position]

    def record(self, i: int, x: torch.Tensor, position: int) -> None:
        """Keep `x`, the input of link `i` at `position`, for a replacement peer's replay."""
        self.keep(self.links[i].hop.span.start, x, position)

    def record_output(self, x: torch.Tensor, position: int) -> None:
        """Keep the route's output at `position` (under key `num_blocks`), for the last hop's checks."""
        self.keep(self.client.num_blocks, x, position)

    def keep(self, boundary: int, x: torch.Tensor, position: int) -> None:
        if position:
            self.history[boundary].append(x)
        else:
            self.history[boundary] = Inputs(x, self.max_length)

    def views(self, span: Span) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A hop's inputs, outputs and the mask so far, for checking it (`client.inference.verify`); None if no
        hop of the route covers `span` or its history is incomplete."""
        if not any(link.hop.span == span for link in self.links):
            return None
        inputs, outputs = self.history.get(span.start), self.history.get(span.end)
        if inputs is None or outputs is None:
            return None
        return inputs.view(), outputs.view(), self.mask

    def formats(self, span: Span) -> tuple[str, ...]:
        """The weight formats of the peers serving `span` and the wire encodings: what a check tolerates."""
        peers = [link.hop.peer for link in self.links if link.hop.span == span]
        return tuple(self.client.offer(p).format for p in peers) + self.encodings.all

    # ---- steps through one link ----

    def deadline(self, link: Link, tokens: int) -> float:
        """Seconds a step of `tokens` (batch times length) through the link may take."""
        return self.client.deadline(link.hop, tokens)

    def observe(self, link: Link, ms: float, tokens: int) -> None:
        """A step of `tokens` through the link took `ms`: the client's figures, and the slow-peer detector."""
        hop = link.hop
        link.answered_at = time.monotonic()
        self.client.observe(hop, ms, link.session.last_compute_ms, tokens)
        if link.detector.observe(ms, tokens):
            logger.warning("peer %s is slow (%.0f ms per step): avoiding it for this session",
                           describe_peer(hop.peer), ms)
            link.slow = True

    def expired(self, link: Link, reason: str, waited_at: float) -> bool:
        """Whether a failure is the peer ending a session we left idle, rather than the peer failing.
        `waited_at`: when the session last began to wait for blocks."""
        if link.reopened or link.session is None:
            return False
        # silent from its last answer until the step that failed was sent; a link left idle while the session
        # waited for blocks may have outlived the peer's idle timeout too
        idle_s = math.inf if link.answered_at <= waited_at else link.used_at - link.answered_at
        return reclaimed(reason, idle_s)

    async def open_fresh(self, position: int) -> dict[int, BaseException]:
        """Open the sessions of every link that has none, all at once (a step at position 0 replays nothing),
        so the first step pays one open, not one per hop, and can be chained. The error of each link whose
        open failed, by the link's id: its step hands it to the failover as a failure of that peer."""
        fresh = [link for link in self.links if link.session is None]
        if len(fresh) < 2:
            return {}
        results = await asyncio.gather(*(self.open(link, position, None) for link in fresh), return_exceptions=True)
        errors = {}
        for link, result in zip(fresh, results):
            if isinstance(result, (asyncio.TimeoutError, SwarmError)):  # what a failed step hands the failover
                errors[id(link)] = result
            elif isinstance(result, BaseException):
                raise result
        return errors

    async def open(self, link: Link, position: int, mask: torch.Tensor | None) -> None:
        """Open a session on the link's peer and replay the hop's history into it."""
        hop = link.hop
        link.detector = SlowDetector(self.config.slow_factor, self.config.slow_steps)
        link.used_at = time.monotonic()
        link.session = await self.client.open_session(hop, max_length=self.max_length, batch=self.batch,
                                                      encodings=self.encodings.all)
        link.answered_at = time.monotonic()
        if position == 0:
            return
        inputs = self.history.get(hop.span.start)
        past = None if inputs is None else inputs.view()
        if past is None or past.shape[1] < position:
            raise RuntimeError(f"no history at block {hop.span.start} to replay")  # a bug, not a peer failure
        # in float32: it carries every value the history holds exactly, whatever encoding it first came in
        out = await self.step(link, past[:, :position], 0, None if mask is None else mask[:, :position],
                              REPLAY_ENCODING)
        if hop.span.end < self.client.num_blocks and hop.span.end not in self.history:
            self.history[hop.span.end] = Inputs(out, self.max_length)  # the next new hop's replay input

    async def step(self, link: Link, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                   encoding: str) -> torch.Tensor:
        """The link's output for `x` at `position`, within the hop's deadline, checked and measured."""
        hop, tokens = link.hop, x.shape[1]
        link.used_at = time.monotonic()
        started = time.perf_counter()
        out = await asyncio.wait_for(link.session.step(x, position, mask, encoding),
                                     self.deadline(link, x.shape[0] * tokens))
        check_plausible(hop, x, out, self.client.floor)
        self.observe(link, (time.perf_counter() - started) * 1e3, tokens)
        return out


@dataclass(frozen=True)
class Reroute:
    """A cheaper route found by `second_look`: the hops to put in place of each link (the link's own hop
    where it stays), and the route's decode step as measured against the new one as estimated."""

    plan: tuple[tuple[Hop, ...], ...]
    current_ms: float
    new_ms: float


def second_look(route: Route, avoid: set[str], rng) -> Reroute | None:
    """Hops whose decode steps took much longer than their route assumed (a fresh client trusts announced
    speeds; a peer's compute figure leaves out what its network side and queue cost), replaced if the route
    as a whole becomes clearly cheaper; None if it would not. A hop's measured time is the median of its
    decode steps so far, network and queue included."""
    client, links = route.client, route.links
    measured = [statistics.median(link.detector.normal) if len(link.detector.normal) >= 2 else None
                for link in links]
    slow = slower_than_assumed([link.assumed_ms for link in links], measured)
    if not slow:
        return None
    ours = Counter(link.hop.peer for link in links)  # weigh both routes without this session's load
    plan: list[tuple[Hop, ...]] = []
    for i, link in enumerate(links):
        hops = (link.hop,)
        if i in slow:
            try:
                # its own estimate is what turned out wrong: the alternatives, against what it measured
                hops = tuple(client.find(link.hop.span, route.cache_tokens, frozenset(avoid | {link.hop.peer}), rng,
                                         discount=ours))
            except NoRoute:
                pass
        plan.append(hops)
    # the current route as measured; the new one as estimated, with the measured hops it keeps
    current = sum(m if m is not None else link.assumed_ms for m, link in zip(measured, links))
    new = sum(client.route_cost_ms(list(hops), discount=ours) if i in slow else
              (measured[i] if measured[i] is not None else links[i].assumed_ms)
              for i, hops in enumerate(plan))
    if not worth_switching(current, new):
        return None
    return Reroute(tuple(plan), current, new)
