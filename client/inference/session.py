"""An inference session through the swarm: a route of peer sessions, with exact failover. Async.

Each step sends hidden states `[batch, tokens, hidden]` at a position through every hop of the route
in order. For every hop the session keeps the inputs it sent (`history[hop start]`, positions
`[0, length)`): that is all a replacement peer needs to rebuild its cache.

Failover: when a hop fails (the stream breaks, a typed error that another peer may not have, or no
reply within the hop's deadline), its peer is banned, a new chain is found for the hop's span, the new
peers open sessions and are replayed the hop's history (each new peer's replay output is the next
new peer's history), and the failed step is sent again. The hops before and after keep their caches.
Greedy output is the same as without the failure, because every peer computes the same function of
the same inputs.

Chaining (`ClientConfig.chain`, on by default): once every hop has an open session, a step goes to the
first hop naming the later ones, and each peer pushes its output straight to the next
(docs/protocol.md). Every peer still replies its output to the client, so the history is the same as
when relaying. A hop whose push did not leave is sent its input by the client; a hop that fails or
misses its deadline is handled exactly like a relayed failure (above). (`client.inference.chaining`)

Checked outputs (`ClientConfig.verify_fraction`, `client.inference.verify`): hops are compared with other replicas
in the background; `verified_length` says how far all of them agreed, and a hop found lying is replaced
and the session rolled back to its first wrong position (`Rewound` to a caller that wanted to go on).

Deadlines come from the peer's own recent figures (`SwarmClient.deadline`), so a frozen peer costs
about `min_deadline` plus a few expected step times, not minutes. A peer whose decode steps become
several times slower than usual for several steps in a row is avoided for the rest of the session.

Waiting for blocks: when a failed hop's blocks have no live peer left, the session waits up to
`wait_for_blocks` seconds for them to be served again (`SwarmClient.wait_for_route`; `waiting` holds
the message meanwhile and `on_wait` hears it once), then replays onto the new peers as above. Waiting
is not a retry: `max_retries` counts failed peers only.

Load and a second look: the hops of a session count toward their peers' load (`SwarmClient.claim`)
until they are replaced or the session closes, so concurrent sessions spread over replicas. Once,
after its first `REROUTE_AFTER` decode steps, a session compares what each hop measured with what its
route assumed; hops much slower are rerouted, exactly as a slow peer is, if that makes the whole route
clearly cheaper (`reroutes` lists them).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch

from client.inference.encodings import REPLAY_ENCODING, Encodings
from client.inference.chaining import ChainedSteps
from client.inference.failures import Attempts, reason_of
from client.inference.hops import IDLE_REOPEN_S, Failover, Inputs, Link, SlowDetector, check_plausible, step_mask
from client.inference.pipeline import PipelinedSteps
from client.inference.routing import REROUTE_AFTER, Hop, slower_than_assumed, worth_switching
from client.inference.swarm_client import SwarmClient
from client.inference.verify import Verifier
from swarm.net import hidden as wire_hidden
from swarm.errors import BadRequest, ChainMismatch, NoRoute, Rewound, SwarmError
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)



class InferenceSession(ChainedSteps, PipelinedSteps):
    """`async with InferenceSession(client, max_length) as s: out = await s.step(hidden)`.

    `on_wait(message)`: called (on the event loop) when a step begins to wait for blocks to be served
    again; `waiting` is that message while the wait lasts, else None."""

    def __init__(self, client: SwarmClient, max_length: int, on_wait: Callable[[str], None] | None = None):
        if max_length < 1:
            raise BadRequest(f"max_length must be positive, got {max_length}")
        self.client, self.max_length = client, max_length
        self.config = client.config
        self.on_wait = on_wait
        self.waiting: str | None = None
        self.waited_at = -float("inf")  # when the last wait for blocks began
        self.rng = client.session_rng()  # this session's tie-breaking between equal routes
        self.decode_steps = 0  # one-token steps done
        self.reconsidered = False  # the route was checked against its first decode steps
        self.reroutes: list[Failover] = []  # hops moved by that check (not failures)
        self.encodings: Encodings | None = None  # chosen with the first route, kept for the session
        self.batch: int | None = None
        self.length = 0
        self.links: list[Link] = []
        self.history: dict[int, Inputs] = {}
        self.mask: torch.Tensor | None = None  # the attention mask of positions [0, length), when not all ones
        self.avoid: set[str] = set()  # peers too slow for this session
        self.failovers: list[Failover] = []
        self.verifier: Verifier | None = None  # checks the hops' outputs (`verify_fraction` > 0)
        self.relay_next = False  # after a rewind, later hops hold more than the session: the next step is relayed
        self.hop_inputs = {"sent": 0, "pushed": 0}  # hop inputs the client sent, and those a peer pushed on
        self.pipelined = 0  # steps that went through the route in chunks (`client.inference.pipeline`)
        self._chain_began = 0.0  # when the last chained step was sent: a failover's stall counts from there
        self.closed = False
        self._closing: set[asyncio.Task] = set()  # sessions of replaced hops, closed in the background

    @property
    def route(self) -> list[Hop]:
        return [link.hop for link in self.links]

    async def __aenter__(self) -> InferenceSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self.closed = True
        if self.verifier is not None:
            await self.verifier.close()
        links, self.links = self.links, []
        for link in links:
            self._release(link)
        await asyncio.gather(*(self._close_link(link) for link in links), *self._closing)

    async def _close_link(self, link: Link) -> None:
        session, link.session = link.session, None
        if session is not None:
            await self.client.close_session(link.hop.peer, session)

    # ---- steps ----

    async def step(self, hidden: torch.Tensor, position: int | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run `hidden` at `position` (default: the current length; lower: roll back) through all blocks.

        `attention_mask` [batch, position + tokens] marks padding (0) over the whole sequence so far."""
        if self.closed:
            raise BadRequest("the inference session is closed")
        position = self.length if position is None else position
        await self._rewind_if_lied(position)
        if hidden.ndim != 3 or hidden.shape[1] < 1:
            raise BadRequest(f"hidden states must be [batch, tokens, hidden], got {list(hidden.shape)}")
        batch, tokens = hidden.shape[0], hidden.shape[1]
        if self.batch is None:
            self.batch = batch
        if batch != self.batch:
            raise BadRequest(f"this session was opened for batch {self.batch}, got {batch}")
        if not 0 <= position <= self.length:
            raise BadRequest(f"position {position} is beyond the session's length {self.length}")
        if position + tokens > self.max_length:
            raise BadRequest(f"{position + tokens} tokens exceed the session's max_length {self.max_length}")
        mask = step_mask(self.mask, attention_mask, self.batch, position, tokens)
        if not self.links:
            # nothing is lost yet, so no wait here: the caller (an API answering 503) may do better than wait
            hops = await self.client.route(cache_tokens=self.batch * self.max_length, rng=self.rng)
            if self.closed:
                raise BadRequest("the inference session was closed during a step")
            self.links = self._adopt(hops)
            if self.encodings is None:
                self.encodings = self.client.encodings(hops)
            if self.verifier is None and self.config.verify_fraction > 0:
                self.verifier = Verifier(self.client, self.config.verify_fraction, self.rng, self.max_length,
                                         self.batch, self._views, self._formats)
            logger.debug("route: %s (%s on the wire)", " -> ".join(str(h) for h in self.route),
                         "/".join(self.encodings.all))
        elif not self.reconsidered and self.decode_steps >= REROUTE_AFTER:
            self._reconsider()
        for inputs in self.history.values():
            inputs.truncate(position)
        # a rollback is relayed: peers take a pushed step only at the end of what its session has run
        chainable, self.relay_next = position == self.length and not self.relay_next, False
        if self.verifier is not None:
            self.verifier.rollback(position)
        # until this step succeeds, the session holds positions [0, position): a failed step leaves no trace
        self.length, self.mask = position, None if self.mask is None else self.mask[:, :position]
        # what the first peer decodes, kept as sent; every later hop's input is an output as decoded
        encoding = self.encodings.for_tokens(tokens)
        x, i, failed = wire_hidden.round_trip(hidden, encoding), 0, None
        not_opened = await self._open_fresh(position) if position == 0 else {}
        if not not_opened and self._can_pipeline(tokens):
            out = await self._pipeline(x, position, mask, encoding)
            if out is None:  # a hop failed: the peers may hold chunks past `position`, so the step is relayed
                chainable = False
            else:
                x, i = out, len(self.links)
        while i < len(self.links):
            if failed is None and chainable and self._can_chain(i):
                i, x, failed = await self._chain(i, x, position, mask, encoding)
                # after an altered push, later hops hold a step computed on it: relay the rest (a rollback)
                chainable = not isinstance(failed, ChainMismatch)
                continue
            began = self._chain_began if failed else None
            failed = failed or not_opened.pop(id(self.links[i]), None)
            self.hop_inputs["sent"] += failed is None
            out = await self._through(i, x, position, mask, failed, began, encoding)
            failed = None
            self._record(i, x, position)
            x, i = out, i + 1
        self.length = position + tokens
        self.mask = mask
        self.decode_steps += tokens == 1
        if self.verifier is not None:
            self._record_output(x, position)
            self.verifier.after_step([(link.hop.span, link.hop.peer) for link in self.links], self.length)
        return x

    # ---- checked outputs (client.inference.verify) ----

    @property
    def verified_length(self) -> int:
        """Positions `[0, verified_length)` whose outputs every hop's check confirmed (all of them when checks
        are off); a caller shows users only tokens made from those."""
        if self.verifier is None:
            return self.length
        return min((self.verifier.verified(link.hop.span, self.length) for link in self.links), default=self.length)

    async def verify(self) -> None:
        """Check every hop up to the current length now; `Rewound` if a hop was found lying."""
        if self.verifier is not None and self.links:
            await self.verifier.flush([(link.hop.span, link.hop.peer) for link in self.links], self.length)
        await self._rewind_if_lied(self.length)

    async def _rewind_if_lied(self, position: int) -> None:
        """If a check found a lie: replace the lying hop (it is banned), roll back to its first wrong position
        and, if the caller wanted to go on past it, raise `Rewound`."""
        lie = None if self.verifier is None else self.verifier.lie
        if lie is None:
            return
        self.verifier.lie = None
        back = min(lie.position, self.length)
        for i, link in enumerate(self.links):
            if link.hop.span == lie.span and link.hop.peer == lie.peer:
                self._close_in_background(link)
                new_hops = await self._replace(i, exclude=self.avoid)  # opened and replayed at the next step
                self.failovers.append(Failover(str(lie.span), lie.peer, "wrong_output", new_hops, 0.0))
                break
        for inputs in self.history.values():
            inputs.truncate(back)
        self.length, self.mask = back, None if self.mask is None else self.mask[:, :back]
        self.verifier.rollback(back)
        self.relay_next = True
        if position > back:
            raise Rewound(f"peer {describe_peer(lie.peer)} returned wrong outputs for blocks {lie.span} from "
                          f"position {back}: the session went back there", back)

    def _record_output(self, x: torch.Tensor, position: int) -> None:
        """Keep the route's output at `position` (under key `num_blocks`), for the last hop's checks."""
        self._keep(self.client.num_blocks, x, position)

    def _views(self, span):
        if not any(link.hop.span == span for link in self.links):
            return None
        inputs, outputs = self.history.get(span.start), self.history.get(span.end)
        if inputs is None or outputs is None:
            return None
        return inputs.view(), outputs.view(), self.mask

    def _formats(self, span) -> tuple[str, ...]:
        peers = [link.hop.peer for link in self.links if link.hop.span == span]
        return tuple(self.client.offer(p).format for p in peers) + self.encodings.all

    async def _through(self, i: int, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                       failed: SwarmError | None = None, began: float | None = None,
                       encoding: str = "float32") -> torch.Tensor:
        """Output of link `i` for `x`, replacing the link (and replaying) until a peer succeeds. `failed`: the
        link's peer already failed this step (in a chained step that began at `began`), handled as if the
        first attempt here had."""
        began = time.perf_counter() if began is None else began
        failure: tuple[str, str, object] | None = None
        new_hops: tuple[str, ...] = ()
        attempts: Attempts = self.client.failures.attempts(self.client.model_id)
        while True:
            if self.closed:
                raise BadRequest("the inference session was closed during a step")
            link = self.links[i]
            if link.slow and failed is None:
                await self._avoid_slow(i)
                link = self.links[i]
            try:
                if failed is not None:
                    failed, error = None, failed
                    raise error
                if link.session is None:
                    await self._open(link, position, mask)
                out = await self._step(link, x, position, mask, encoding)
            except (asyncio.TimeoutError, SwarmError) as e:
                reason = reason_of(e)
                if self._expired(link, reason):
                    # the peer reclaimed our idle session (or dropped its stream): reopen there once, no ban
                    logger.info("session at peer %s for blocks %s expired (%s): reopening it there",
                                describe_peer(link.hop.peer), link.hop.span, reason)
                    link.reopened = True
                    self._close_in_background(link)
                    continue
                attempts.failed(link.hop.peer, link.hop.span, e, opening=link.session is None)  # raises: give up
                self._close_in_background(link)
                failure = failure or (link.hop.peer, reason, link.hop.span)
                new_hops = await self._replace(i, exclude=self.avoid)
                continue
            link.reopened = False  # a later idle pause may reopen it again
            if failure is not None:
                self.failovers.append(Failover(str(failure[2]), failure[0], failure[1], new_hops,
                                               time.perf_counter() - began))
            return out

    def _expired(self, link: Link, reason: str) -> bool:
        """Whether a failure is the peer ending a session we left idle, rather than the peer failing."""
        if link.reopened or link.session is None:
            return False
        # idle until the step that failed was sent; a link left idle while the session waited for blocks may
        # have outlived the peer's idle timeout too
        long_idle = link.used_at - link.used_before > IDLE_REOPEN_S or link.used_before <= self.waited_at
        return reason == "unknown_session" or (reason == "connection_lost" and long_idle)

    async def _replace(self, i: int, exclude: set[str], wait: bool = True) -> tuple[str, ...]:
        """Put a new chain in place of link `i` (its sessions open at first use); the new hops, as text. With
        `wait`, blocks that have no live peer are waited for (`wait_for_blocks`)."""
        span = self.links[i].hop.span
        cache_tokens, avoid = self.batch * self.max_length, frozenset(exclude)
        prefer = self.client.offer(self.links[i].hop.peer).format  # keep the span's weight format if it can
        if wait:
            try:
                hops = await self.client.wait_for_route(span, cache_tokens=cache_tokens, exclude=avoid, rng=self.rng,
                                                        on_wait=self._waiting_for, prefer=prefer)
            finally:
                self.waiting = None
        else:
            hops = await self.client.route(span, cache_tokens=cache_tokens, exclude=avoid, rng=self.rng,
                                           prefer=prefer)
        if self.closed:
            raise BadRequest("the inference session was closed during a step")
        return self._swap(i, hops)

    def _swap(self, i: int, hops: list[Hop]) -> tuple[str, ...]:
        """Links for `hops` in place of link `i`, whose span they cover; the new hops, as text."""
        old = self.links[i]
        span = old.hop.span
        self.links[i:i + 1] = self._adopt(hops)
        self._release(old)
        if self.verifier is not None:
            self.verifier.drop(span)  # the new hops are checked afresh
        # inputs at boundaries inside the span are rebuilt by replay, hop by hop
        self.history = {b: h for b, h in self.history.items() if not span.start < b < span.end}
        logger.info("blocks %s now at %s", span, ", ".join(str(h) for h in hops))
        return tuple(str(h) for h in hops)

    def _adopt(self, hops: list[Hop]) -> list[Link]:
        """Links for a newly chosen route (or part of one), with the compute their route assumed; from now on
        they count toward their peers' load."""
        links = [Link(h, assumed_ms=self.client.hop_cost_ms(h), claimed=True) for h in hops]
        self.client.claim(hops)
        return links

    def _release(self, link: Link) -> None:
        if link.claimed:
            link.claimed = False
            self.client.release(link.hop)

    def _waiting_for(self, message: str) -> None:
        self.waiting, self.waited_at = message, time.monotonic()
        if self.on_wait is not None:
            try:
                self.on_wait(message)
            except Exception:  # boundary: a caller's notice must not end the generation
                logger.exception("the on_wait hook failed")

    def _reconsider(self) -> None:
        """Once per session, after its first decode steps: hops whose decode steps took much longer than
        their route assumed (a fresh client trusts announced speeds; a peer's compute figure leaves out
        what its network side and queue cost) are rerouted if the route as a whole becomes clearly cheaper.
        A hop's measured time is the median of its decode steps so far, network and queue included. The
        same replace-and-replay as for a slow peer, so the output stays exact."""
        self.reconsidered = True
        measured = [statistics.median(link.detector.normal) if len(link.detector.normal) >= 2 else None
                    for link in self.links]
        slow = slower_than_assumed([link.assumed_ms for link in self.links], measured)
        if not slow:
            return
        ours = Counter(link.hop.peer for link in self.links)  # weigh both routes without this session's load
        plan: list[list[Hop]] = []
        for i, link in enumerate(self.links):
            hops = [link.hop]
            if i in slow:
                try:
                    # its own estimate is what turned out wrong: the alternatives, against what it measured
                    hops = self.client.find(link.hop.span, self.batch * self.max_length,
                                            frozenset(self.avoid | {link.hop.peer}), self.rng, discount=ours)
                except NoRoute:
                    pass
            plan.append(hops)
        # the current route as measured; the new one as estimated, with the measured hops it keeps
        current = sum(m if m is not None else link.assumed_ms for m, link in zip(measured, self.links))
        new = sum(self.client.route_cost_ms(hops, discount=ours) if i in slow else
                  (measured[i] if measured[i] is not None else self.links[i].assumed_ms)
                  for i, hops in enumerate(plan))
        if not worth_switching(current, new):
            return
        logger.info("route after %d decode steps: %.1f ms per token, %.1f ms by another: rerouting",
                    self.decode_steps, current, new)
        for i in reversed(range(len(plan))):  # the last first, so that earlier indices stay valid
            old = self.links[i]
            if plan[i] != [old.hop]:
                new_hops = self._swap(i, plan[i])
                self._close_in_background(old)
                self.reroutes.append(Failover(str(old.hop.span), old.hop.peer, "rerouted", new_hops, 0.0))

    async def _avoid_slow(self, i: int) -> None:
        link = self.links[i]
        link.slow = False
        self.avoid.add(link.hop.peer)
        try:
            new_hops = await self._replace(i, exclude=self.avoid, wait=False)
        except NoRoute:
            self.avoid.discard(link.hop.peer)  # no alternative: keep the slow peer
            link.detector = SlowDetector(self.config.slow_factor, self.config.slow_steps)
            return
        self.failovers.append(Failover(str(link.hop.span), link.hop.peer, "slow", new_hops, 0.0))
        self._close_in_background(link)

    def _close_in_background(self, link: Link) -> None:
        session, link.session = link.session, None  # detached now: the next attempt opens a new one
        if session is None:
            return
        task = asyncio.create_task(self.client.close_session(link.hop.peer, session))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _open_fresh(self, position: int) -> dict[int, BaseException]:
        """Open the sessions of every link that has none, all at once (a step at position 0 replays nothing),
        so the first step pays one open, not one per hop, and can be chained. The error of each link whose
        open failed, by the link's id: its step hands it to the failover as a failure of that peer."""
        fresh = [link for link in self.links if link.session is None]
        if len(fresh) < 2:
            return {}
        results = await asyncio.gather(*(self._open(link, position, None) for link in fresh), return_exceptions=True)
        errors = {}
        for link, result in zip(fresh, results):
            if isinstance(result, (asyncio.TimeoutError, SwarmError)):  # what a failed step hands the failover
                errors[id(link)] = result
            elif isinstance(result, BaseException):
                raise result
        return errors

    async def _open(self, link: Link, position: int, mask: torch.Tensor | None) -> None:
        """Open a session on the link's peer and replay the hop's history into it."""
        hop = link.hop
        link.detector = SlowDetector(self.config.slow_factor, self.config.slow_steps)
        link.used_at = time.monotonic()
        link.session = await self.client.open_session(hop, max_length=self.max_length, batch=self.batch,
                                                      encodings=self.encodings.all)
        if position == 0:
            return
        inputs = self.history.get(hop.span.start)
        past = None if inputs is None else inputs.view()
        if past is None or past.shape[1] < position:
            raise RuntimeError(f"no history at block {hop.span.start} to replay")  # a bug, not a peer failure
        # in float32: it carries every value the history holds exactly, whatever encoding it first came in
        out = await self._step(link, past[:, :position], 0, None if mask is None else mask[:, :position],
                               REPLAY_ENCODING)
        if hop.span.end < self.client.num_blocks and hop.span.end not in self.history:
            self.history[hop.span.end] = Inputs(out, self.max_length)  # the next new hop's replay input

    async def _step(self, link: Link, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                    encoding: str) -> torch.Tensor:
        hop, tokens = link.hop, x.shape[1]
        link.used_before, link.used_at = link.used_at, time.monotonic()
        started = time.perf_counter()
        out = await asyncio.wait_for(link.session.step(x, position, mask, encoding),
                                     self.client.deadline(hop, x.shape[0] * tokens))
        check_plausible(hop, x, out)
        self._observe(link, (time.perf_counter() - started) * 1e3, tokens)
        return out

    def _observe(self, link: Link, ms: float, tokens: int) -> None:
        hop = link.hop
        self.client.observe(hop, ms, link.session.last_compute_ms, tokens)
        if link.detector.observe(ms, tokens):
            logger.warning("peer %s is slow (%.0f ms per step): avoiding it for this session",
                           describe_peer(hop.peer), ms)
            link.slow = True

    def _record(self, i: int, x: torch.Tensor, position: int) -> None:
        """Keep `x`, the input of link `i` at `position`, for a replacement peer's replay."""
        self._keep(self.links[i].hop.span.start, x, position)

    def _keep(self, boundary: int, x: torch.Tensor, position: int) -> None:
        if position:
            self.history[boundary].append(x)
        else:
            self.history[boundary] = Inputs(x, self.max_length)
