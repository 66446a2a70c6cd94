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

The route's state (links, history, claims, measurements) is a `Route` (`client.inference.route`) that the
session owns; relayed, chained and pipelined steps run over it and the session reads what they return
(where a step stopped, with which error) to fail over. Only the session decides about failures.

Chaining (`ClientConfig.chain`, on by default): once every hop has an open session, a step goes to the
first hop naming the later ones, and each peer pushes its output straight to the next
(docs/protocol.md). Every peer still replies its output to the client, so the history is the same as
when relaying. A hop whose push did not leave is sent its input by the client; a hop that fails or
misses its deadline is handled exactly like a relayed failure (above). (`client.inference.chaining`)
A long prompt goes through the route in chunks (`client.inference.pipeline`); if a hop fails there, the
step is relayed from its position.

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
import time
from collections.abc import Callable

import torch

from client.inference.chaining import can_chain, chain
from client.inference.failures import Attempts, reason_of
from client.inference.hops import Failover, Link, SlowDetector, step_mask
from client.inference.pipeline import can_pipeline, pipeline
from client.inference.route import Route, second_look
from client.inference.routing import REROUTE_AFTER, Hop
from client.inference.swarm_client import SwarmClient
from client.inference.verify import Verifier
from swarm.net import hidden as wire_hidden
from swarm.errors import BadRequest, NoRoute, Rewound, SwarmError
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)


class InferenceSession:
    """`async with InferenceSession(client, max_length) as s: out = await s.step(hidden)`.

    `on_wait(message)`: called (on the event loop) when a step begins to wait for blocks to be served
    again; `waiting` is that message while the wait lasts, else None. `live`: the route and its state."""

    def __init__(self, client: SwarmClient, max_length: int, on_wait: Callable[[str], None] | None = None):
        if max_length < 1:
            raise BadRequest(f"max_length must be positive, got {max_length}")
        self.client, self.max_length = client, max_length
        self.config = client.config
        self.live = Route(client, max_length)
        self.on_wait = on_wait
        self.waiting: str | None = None
        self.waited_at = -float("inf")  # when the last wait for blocks began
        self.rng = client.session_rng()  # this session's tie-breaking between equal routes
        self.decode_steps = 0  # one-token steps done
        self.reconsidered = False  # the route was checked against its first decode steps
        self.reroutes: list[Failover] = []  # hops moved by that check (not failures)
        self.length = 0
        self.avoid: set[str] = set()  # peers too slow for this session
        self.failovers: list[Failover] = []
        self.verifier: Verifier | None = None  # checks the hops' outputs (`verify_fraction` > 0)
        self.relay_next = False  # after a rewind, later hops hold more than the session: the next step is relayed
        self.hop_inputs = {"sent": 0, "pushed": 0}  # hop inputs the client sent, and those a peer pushed on
        self.pipelined = 0  # steps that went through the route in chunks (`client.inference.pipeline`)
        self.owner: object | None = None  # whose steps it runs now (a caller's mark: a kept session changes hands)
        self.forking = 0  # forks of it being made (`client.inference.fork`): it must not roll back meanwhile

    @property
    def route(self) -> list[Hop]:
        return self.live.hops

    @property
    def links(self) -> list[Link]:
        return self.live.links

    @property
    def closed(self) -> bool:
        return self.live.closed

    async def __aenter__(self) -> InferenceSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self.live.closed = True
        if self.verifier is not None:
            await self.verifier.close()
        await self.live.close()

    # ---- steps ----

    async def step(self, hidden: torch.Tensor, position: int | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run `hidden` at `position` (default: the current length; lower: roll back) through all blocks.

        `attention_mask` [batch, position + tokens] marks padding (0) over the whole sequence so far."""
        if self.closed:
            raise BadRequest("the inference session is closed")
        live = self.live
        position = self.length if position is None else position
        await self._rewind_if_lied(position)
        if hidden.ndim != 3 or hidden.shape[1] < 1:
            raise BadRequest(f"hidden states must be [batch, tokens, hidden], got {list(hidden.shape)}")
        batch, tokens = hidden.shape[0], hidden.shape[1]
        if live.batch is None:
            live.batch = batch
        if batch != live.batch:
            raise BadRequest(f"this session was opened for batch {live.batch}, got {batch}")
        if not 0 <= position <= self.length:
            raise BadRequest(f"position {position} is beyond the session's length {self.length}")
        if position + tokens > self.max_length:
            raise BadRequest(f"{position + tokens} tokens exceed the session's max_length {self.max_length}")
        mask = step_mask(live.mask, attention_mask, live.batch, position, tokens)
        if not live.links:
            await self._first_route()
        elif not self.reconsidered and self.decode_steps >= REROUTE_AFTER:
            self._reconsider()
        live.truncate(position)  # until this step succeeds, the session holds positions [0, position)
        # a rollback is relayed: peers take a pushed step only at the end of what its session has run
        chainable, self.relay_next = position == self.length and not self.relay_next, False
        if self.verifier is not None:
            self.verifier.rollback(position)
        self.length = position  # a failed step leaves no trace
        # what the first peer decodes, kept as sent; every later hop's input is an output as decoded
        encoding = live.encodings.for_tokens(tokens)
        x, i, failed, began = wire_hidden.round_trip(hidden, encoding), 0, None, None
        not_opened = await live.open_fresh(position) if position == 0 else {}
        if not not_opened and can_pipeline(live, tokens):
            piped = await pipeline(live, x, position, mask, encoding)
            if piped.out is None:  # a hop failed: the peers may hold chunks past `position`, so the step is relayed
                chainable = False
            else:
                x, i = piped.out, len(live.links)
                self.hop_inputs["sent"] += piped.hops
                self.pipelined += 1
        while i < len(live.links):
            if failed is None and chainable and can_chain(live, i):
                done = await chain(live, i, x, position, mask, encoding)
                i, x, failed, began = done.next, done.x, done.failed, done.began
                self.hop_inputs["sent"] += done.sent
                self.hop_inputs["pushed"] += done.pushed
                # after a push a hop disowned, later hops may hold a step computed on it: relay the rest
                chainable = chainable and not done.mismatch
                continue
            began = began if failed else None
            failed = failed or not_opened.pop(id(live.links[i]), None)
            self.hop_inputs["sent"] += failed is None
            out = await self._through(i, x, position, mask, failed, began, encoding)
            failed = None
            live.record(i, x, position)
            x, i = out, i + 1
        self.length = position + tokens
        live.mask = mask
        self.decode_steps += tokens == 1
        if self.verifier is not None:
            live.record_output(x, position)
            self.verifier.after_step([(link.hop.span, link.hop.peer) for link in live.links], self.length)
        return x

    async def _first_route(self) -> None:
        """Links for a whole route; the first time, the wire encodings and the checks too."""
        live = self.live
        # nothing is lost yet, so no wait here: the caller (an API answering 503) may do better than wait
        hops = await self.client.route(cache_tokens=live.cache_tokens, rng=self.rng)
        if self.closed:
            raise BadRequest("the inference session was closed during a step")
        if self.verifier is None and self.config.verify_fraction > 0:
            self.verifier = Verifier(self.client, self.config.verify_fraction, self.rng, self.max_length,
                                     live.batch, live.views, live.formats, self.config.require_checked)
        if self.verifier is not None:
            self.verifier.require(hops)  # before anything is sent
        live.links = live.adopt(hops)
        if live.encodings is None:
            live.encodings = self.client.encodings(hops)
        logger.debug("route: %s (%s on the wire)", " -> ".join(str(h) for h in self.route),
                     "/".join(live.encodings.all))

    # ---- checked outputs (client.inference.verify) ----

    @property
    def verified_length(self) -> int:
        """Positions `[0, verified_length)` whose outputs every hop's check confirmed (all of them when checks
        are off); a caller shows users only tokens made from those."""
        if self.verifier is None:
            return self.length
        return min((self.verifier.verified(link.hop.span, self.length) for link in self.live.links),
                   default=self.length)

    @property
    def unchecked(self) -> list[Hop]:
        """Hops of the route whose outputs no other peer can check (they count as verified): what callers warn
        about. Empty when checks are off (`verify_fraction` 0: nothing is checked, and callers know it)."""
        if self.verifier is None:
            return []
        return [link.hop for link in self.live.links if self.verifier.unchecked.get(link.hop.span) == link.hop.peer]

    async def verify(self) -> None:
        """Check every hop up to the current length now; `Rewound` if a hop was found lying."""
        if self.verifier is not None and self.live.links:
            await self.verifier.flush([(link.hop.span, link.hop.peer) for link in self.live.links], self.length)
        await self._rewind_if_lied(self.length)

    async def _rewind_if_lied(self, position: int) -> None:
        """If a check found a lie: replace the lying hop (it is banned) and any other hop whose peer was found
        lying meanwhile, roll back to the first wrong position and, if the caller wanted to go on past it,
        raise `Rewound`."""
        lie = None if self.verifier is None else self.verifier.lie
        if lie is None:
            return
        self.verifier.lie = None
        back = min(lie.position, self.length)
        convicted = self.client.failures.convicted
        for _ in range(len(self.live.links) + 1):  # each round replaces one hop; bounded by the route's length
            i = next((i for i, link in enumerate(self.live.links) if (link.hop.span, link.hop.peer) ==
                      (lie.span, lie.peer) or link.hop.peer in convicted), None)
            if i is None:
                break
            link = self.live.links[i]
            self.live.close_in_background(link)
            new_hops = await self._replace(i, exclude=self.avoid)  # opened and replayed at the next step
            reason = "wrong_output" if link.hop.peer in convicted else lie.reason
            self.failovers.append(Failover(str(link.hop.span), link.hop.peer, reason, new_hops, 0.0))
        self.live.truncate(back)
        self.length = back
        self.verifier.rollback(back)
        self.relay_next = True
        if position > back:
            raise Rewound(f"peer {describe_peer(lie.peer)} returned wrong outputs for blocks {lie.span} from "
                          f"position {back}: the session went back there", back)

    # ---- failover ----

    async def _through(self, i: int, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                       failed: SwarmError | None = None, began: float | None = None,
                       encoding: str = "float32") -> torch.Tensor:
        """Output of link `i` for `x`, replacing the link (and replaying) until a peer succeeds. `failed`: the
        link's peer already failed this step (in a chained step that began at `began`), handled as if the
        first attempt here had. Waits for blocks share one `wait_for_blocks` per step: a peer that comes back
        and fails again is not waited for anew."""
        live = self.live
        began = time.perf_counter() if began is None else began
        waited = 0.0  # seconds this step has waited for blocks so far
        failure: tuple[str, str, object] | None = None
        new_hops: tuple[str, ...] = ()
        attempts: Attempts = self.client.failures.attempts(self.client.model_id)
        while True:
            if self.closed:
                raise BadRequest("the inference session was closed during a step")
            link = live.links[i]
            if link.slow and failed is None:
                await self._avoid_slow(i)
                link = live.links[i]
            try:
                if failed is not None:
                    failed, error = None, failed
                    raise error
                if link.session is None:
                    await live.open(link, position, mask)
                out = await live.step(link, x, position, mask, encoding)
            except (asyncio.TimeoutError, SwarmError) as e:
                reason = reason_of(e)
                if live.expired(link, reason, self.waited_at):
                    # the peer reclaimed our idle session (or dropped its stream): reopen there once, no ban
                    logger.info("session at peer %s for blocks %s expired (%s): reopening it there",
                                describe_peer(link.hop.peer), link.hop.span, reason)
                    link.reopened = True
                    live.close_in_background(link)
                    continue
                attempts.failed(link.hop.peer, link.hop.span, e, opening=link.session is None)  # raises: give up
                live.close_in_background(link)
                failure = failure or (link.hop.peer, reason, link.hop.span)
                before = time.monotonic()
                new_hops = await self._replace(i, exclude=self.avoid, wait_s=self.config.wait_for_blocks - waited)
                waited += time.monotonic() - before if self.waited_at >= before else 0.0
                continue
            link.reopened = False  # a later idle pause may reopen it again
            if failure is not None:
                self.failovers.append(Failover(str(failure[2]), failure[0], failure[1], new_hops,
                                               time.perf_counter() - began))
            return out

    async def _replace(self, i: int, exclude: set[str], wait: bool = True,
                       wait_s: float | None = None) -> tuple[str, ...]:
        """Put a new chain in place of link `i` (its sessions open at first use); the new hops, as text. With
        `wait`, blocks that have no live peer are waited for (`wait_s` seconds at most, default
        `wait_for_blocks`)."""
        old = self.live.links[i].hop
        cache_tokens, avoid = self.live.cache_tokens, frozenset(exclude)
        prefer = self.client.offer(old.peer).format  # keep the span's weight format if it can
        if wait:
            try:
                hops = await self.client.wait_for_route(old.span, cache_tokens=cache_tokens, exclude=avoid,
                                                        rng=self.rng, on_wait=self._waiting_for, prefer=prefer,
                                                        seconds=wait_s)
            finally:
                self.waiting = None
        else:
            hops = await self.client.route(old.span, cache_tokens=cache_tokens, exclude=avoid, rng=self.rng,
                                           prefer=prefer)
        if self.closed:
            raise BadRequest("the inference session was closed during a step")
        return self._swap(i, hops)

    def _swap(self, i: int, hops: list[Hop]) -> tuple[str, ...]:
        old = self.live.links[i].hop
        new_hops = self.live.swap(i, hops)
        if self.verifier is not None:  # the new hops are checked afresh; the old peer's outputs stay at old.span.end
            self.verifier.replaced(old.span, old.peer, self.length)
        return new_hops

    def _waiting_for(self, message: str) -> None:
        self.waiting, self.waited_at = message, time.monotonic()
        if self.on_wait is not None:
            try:
                self.on_wait(message)
            except Exception:  # boundary: a caller's notice must not end the generation
                logger.exception("the on_wait hook failed")

    def _reconsider(self) -> None:
        """Once per session, after its first decode steps: hops much slower than their route assumed are
        rerouted if the route as a whole becomes clearly cheaper (`route.second_look`). The same
        replace-and-replay as for a slow peer, so the output stays exact."""
        self.reconsidered = True
        reroute = second_look(self.live, self.avoid, self.rng)
        if reroute is None:
            return
        logger.info("route after %d decode steps: %.1f ms per token, %.1f ms by another: rerouting",
                    self.decode_steps, reroute.current_ms, reroute.new_ms)
        for i in reversed(range(len(reroute.plan))):  # the last first, so that earlier indices stay valid
            old = self.live.links[i]
            if reroute.plan[i] != (old.hop,):
                new_hops = self._swap(i, list(reroute.plan[i]))
                self.live.close_in_background(old)
                self.reroutes.append(Failover(str(old.hop.span), old.hop.peer, "rerouted", new_hops, 0.0))

    async def _avoid_slow(self, i: int) -> None:
        link = self.live.links[i]
        link.slow = False
        self.avoid.add(link.hop.peer)
        try:
            new_hops = await self._replace(i, exclude=self.avoid, wait=False)
        except NoRoute:
            logger.info("no other peer serves blocks %s: staying with the slow one", link.hop.span)
            self.avoid.discard(link.hop.peer)  # no alternative: keep the slow peer
            link.detector = SlowDetector(self.config.slow_factor, self.config.slow_steps)
            return
        self.failovers.append(Failover(str(link.hop.span), link.hop.peer, "slow", new_hops, 0.0))
        self.live.close_in_background(link)
