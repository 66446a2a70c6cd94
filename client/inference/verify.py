"""Checked outputs: a session's hops are recomputed by other peers covering the same blocks, in the background,
and compared. Async, on the session's event loop.

For each hop of the route the verifier keeps a *shadow*: a chain of other peers whose spans together cover the
hop's blocks (one peer serving all of them, or several serving parts: `SwarmClient.checkers`), in the same
weight format (peers of other formats compute other numbers), with a session at each that has been sent the
hop's inputs for positions `[0, verified)`, and whose last output agreed with the hop's on every position
there. After each step, each hop starts a check with probability `fraction` (if none is running): the hop's
inputs `[verified, length)` go through the shadow's chain as one chunk (in float32: exactly the values the
hop received) and the chain's output is compared with what the hop returned. So every position is
eventually compared, in chunks that cost the checkers about what one decode step costs, and `fraction` sets
how soon: a peer that lies on every step is caught at the first check after its first lie (about
`1 / fraction` steps), and one that lies on some steps at the first check after any of them. `flush` checks
everything up to the current length (a generation calls it before its last tokens go out).

Outputs agree when, at every position, the relative L2 distance of the hidden vectors is within the
tolerance of the formats involved (`tolerance`): honest peers differ by rounding (a chunk and single tokens
use different kernels; 16-bit and 8-bit formats and wire encodings round more). A lie smaller than that is
not caught: it is also no larger than what honest peers of those formats differ by.

When they differ, `client.inference.arbiter` settles who lied, from the sides' own answers and, for the one
block they first disagree on, the client's own computation. A liar is banned for long; if it was the hop, the
session records `lie` (the first position whose output was wrong), rolls back to it and replaces the hop
(`InferenceSession.step` raises `Rewound`), and the generation goes on from that position: users saw only
verified output (`verified_length`), so nothing they saw changes. If it was a checker, the hop gets other
checkers. If nothing can tell (no referee here), the dispute stays open: the two are not used to check each
other, and the hop is checked by others or, with none, is unchecked.

A hop whose blocks no other chain covers (or only peers it has an open dispute with) cannot be checked: it
counts as verified (logged) until checkers appear, then it is checked from the start. Such hops are listed
(`unchecked`) so that callers can say so; with `require_checked` a hop that cannot be checked raises
`Unchecked` instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
import time
from dataclasses import dataclass, field

import torch

from client.inference.arbiter import Verdict, distances, settle
from client.inference.encodings import REPLAY_ENCODING
from client.inference.failures import reason_of
from client.inference.hops import Inputs, reclaimed
from client.inference.peer_session import PeerSession
from client.inference.routing import Hop
from swarm.errors import SwarmError, Unchecked
from swarm.span import Span
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

__all__ = ["Verifier", "distances", "tolerance"]

TOLERANCES = (("nf4", 0.15), ("int8", 0.06), ("float16", 0.03), ("bfloat16", 0.03), ("float32", 1e-3))


def tolerance(formats: tuple[str, ...]) -> float:
    """Largest relative distance honest outputs may have, for the weight formats and wire encodings involved
    (e.g. "int8/bfloat16", "float32", "float16"): the loosest of them."""
    return max((tol for name, tol in TOLERANCES if any(name in f for f in formats)), default=TOLERANCES[-1][1])


@dataclass
class Lie:
    peer: str
    span: Span
    position: int  # the first position whose output disagreed
    distance: float
    checker: str
    reason: str = "wrong_output"  # else why its outputs there count as unchecked (it failed to recompute them)


@dataclass
class Shadow:
    hops: list[Hop]  # the checking chain, covering the hop's blocks
    primary: str  # the peer whose outputs it checks
    sessions: list[PeerSession | None]
    # each checker's outputs for positions [0, verified), but the last one's (it agreed with the hop's own
    # outputs there): the inputs of the pieces after it, for settling a mismatch
    outputs: list[Inputs | None]
    verified: int = 0
    task: asyncio.Task | None = None
    cut: int = 0  # while a check runs: the lowest length the session was rolled back to since it began
    used_at: float = field(default_factory=time.monotonic)  # when its sessions last answered a step

    @property
    def peers(self) -> set[str]:
        return {hop.peer for hop in self.hops}


class Verifier:
    """Checks one session's hops. `views(span)` gives the hop's inputs and outputs for positions
    `[0, length)` as the session holds them (None if the hop is not part of the route any more)."""

    def __init__(self, client, fraction: float, rng: random.Random, max_length: int, batch: int,
                 views: Callable[[Span], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None],
                 formats: Callable[[Span], tuple[str, ...]], require_checked: bool = False):
        self.client, self.fraction, self.rng = client, fraction, rng
        self.max_length, self.batch, self.views, self.formats = max_length, batch, views, formats
        self.require_checked = require_checked
        self.shadows: dict[Span, Shadow] = {}
        self.unchecked: dict[Span, str] = {}  # spans no other chain covered when last looked for -> their peer
        # outputs a replaced hop left at a boundary (kept, and passed on, while its replacement replays):
        # boundary -> [(peer, positions it made there: [0, until) past the earlier entries)]
        self.owners: dict[int, list[tuple[str, int]]] = {}
        self.lie: Lie | None = None
        self.checks = self.chunks_tokens = 0

    def verified(self, span: Span, length: int) -> int:
        if span in self.unchecked and span not in self.shadows:
            return length
        shadow = self.shadows.get(span)
        return 0 if shadow is None else min(shadow.verified, length)

    def after_step(self, links: list[tuple[Span, str]], length: int) -> None:
        """A step made the hops' outputs `[0, length)`: maybe start checks (one per hop at a time)."""
        if self.fraction <= 0 or self.lie is not None:
            return
        for span, peer in links:
            # the first check right away: the prompt's outputs make the first token users wait for
            if self.rng.random() < self.fraction or self.verified(span, length) == 0:
                self.start(span, peer, length)

    def start(self, span: Span, peer: str, length: int) -> asyncio.Task | None:
        shadow = self.shadows.get(span)
        if shadow is not None and shadow.primary != peer:
            self.drop(span)  # the hop moved to another peer: check it afresh
            shadow = None
        if shadow is None:
            shadow = self._shadow(span, peer)
            if shadow is None:
                return None
        if shadow.task is None or shadow.task.done():
            if shadow.verified < length:
                shadow.cut = length
                shadow.task = asyncio.create_task(self._check(span, shadow, length))
        return shadow.task

    def require(self, hops: list[Hop]) -> None:
        """With `require_checked`: `Unchecked` before anything is sent if some hop has no other peers to check it."""
        for hop in hops if self.require_checked else ():
            if self.client.checkers(hop.span, exclude={hop.peer}, fmt=self.client.offer(hop.peer).format) is None:
                raise Unchecked(self._alone(hop.span, hop.peer))

    def _alone(self, span: Span, peer: str) -> str:
        return (f"blocks {span} of {self.client.model_id} are served by peer {describe_peer(peer)} alone: no other "
                "peer can check its outputs, and checked outputs were required (--require-checked)")

    def _excluded(self, peer: str) -> set[str]:
        return {peer} | self.client.failures.disputed(peer)

    def _shadow(self, span: Span, peer: str) -> Shadow | None:
        fmt = self.client.offer(peer).format
        hops = self.client.checkers(span, exclude=self._excluded(peer), fmt=fmt,
                                    cache_tokens=self.batch * self.max_length, rng=self.rng)
        if hops is None:
            if span not in self.unchecked:
                disputed = self.client.failures.disputed(peer)
                logger.info("blocks %s have no other peers to check %s against%s", span, describe_peer(peer),
                            f" but {len(disputed)} it has an open dispute with" if disputed else "")
                if self.require_checked:
                    raise Unchecked(self._alone(span, peer))
            self.unchecked[span] = peer
            return None
        self.unchecked.pop(span, None)  # checked from the start, now that checkers are there
        shadow = self.shadows[span] = Shadow(hops, peer, [None] * len(hops), [None] * (len(hops) - 1))
        return shadow

    async def flush(self, links: list[tuple[Span, str]], length: int) -> None:
        """Check every hop up to `length` now (and wait for it); a `SwarmError` if a hop could not be checked (its
        checkers kept failing)."""
        if self.fraction <= 0:
            return
        for _ in range(4):  # a check that was running covers less than `length`, or its checkers changed: again
            tasks = [t for span, peer in links if (t := self.start(span, peer, length)) is not None]
            if self.lie is not None:
                return
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self.lie is not None or all(self.verified(span, length) >= length for span, _ in links):
                return
        for span, peer in links:
            if self.verified(span, length) < length:
                raise SwarmError(f"the outputs of peer {describe_peer(peer)} for blocks {span} could not be checked "
                                 "(its checkers failed)")

    def replaced(self, span: Span, peer: str, length: int) -> None:
        """The hop over `span` at `peer` was replaced when the session held `length` positions: its outputs there
        stay at the boundary `span.end` (the next hop computed on them), so a wrong one found later is its."""
        self.drop(span)
        if length > 0:
            self.owners.setdefault(span.end, []).append((peer, length))

    def _owner(self, span: Span, position: int) -> str | None:
        """The replaced peer whose output is at `span.end`, `position`; None if the hop's own."""
        return next((peer for peer, until in self.owners.get(span.end, ()) if position < until), None)

    def rollback(self, position: int) -> None:
        """The session now holds positions `[0, position)` only."""
        for shadow in self.shadows.values():
            shadow.verified = min(shadow.verified, position)
            shadow.cut = min(shadow.cut, position)
            for kept in shadow.outputs:
                if kept is not None:
                    kept.truncate(shadow.verified)
        for boundary, owners in list(self.owners.items()):
            self.owners[boundary] = [(peer, min(until, position)) for peer, until in owners if min(until, position)]

    def drop(self, span: Span) -> None:
        self.unchecked.pop(span, None)
        shadow = self.shadows.pop(span, None)
        if shadow is not None:
            self._end(shadow)

    async def close(self) -> None:
        shadows, self.shadows = list(self.shadows.values()), {}
        opened = [(hop.peer, session) for s in shadows for hop, session in zip(s.hops, s.sessions)
                  if session is not None]
        for shadow in shadows:
            shadow.sessions = [None] * len(shadow.hops)  # closed below, not in the background
            if shadow.task is not None and not shadow.task.done():
                shadow.task.cancel()
        await asyncio.gather(*(s.task for s in shadows if s.task is not None), return_exceptions=True)
        await asyncio.gather(*(self.client.close_session(peer, session) for peer, session in opened))

    def _end(self, shadow: Shadow) -> None:
        if shadow.task is not None and not shadow.task.done():
            shadow.task.cancel()
        for i, (hop, session) in enumerate(zip(shadow.hops, shadow.sessions)):
            if session is not None:
                shadow.sessions[i] = None
                asyncio.ensure_future(self.client.close_session(hop.peer, session))

    async def _through(self, shadow: Shadow, x: torch.Tensor, start: int,
                       mask: torch.Tensor | None) -> list[torch.Tensor]:
        """`x` (positions from `start`) through the shadow's chain: each checker's output. A checker that fails
        is banned (`CheckerFailed`), unless it had only reclaimed the session we left idle there (`hops.reclaimed`)."""
        outs = []
        for i, hop in enumerate(shadow.hops):
            try:
                if shadow.sessions[i] is None:
                    shadow.sessions[i] = await self.client.open_session(hop, max_length=self.max_length,
                                                                        batch=self.batch,
                                                                        encodings=(REPLAY_ENCODING,))
                x = await asyncio.wait_for(shadow.sessions[i].step(x, start, mask, REPLAY_ENCODING),
                                           self.client.deadline(hop, x.shape[0] * x.shape[1]))
                self.client.failures.succeeded(hop.peer)  # it served this client: a later timeout is no stall
            except (asyncio.TimeoutError, SwarmError) as e:
                # the checker failed, not the hop: other checkers next time
                logger.info("checking blocks %s at peer %s failed (%s)", hop.span, describe_peer(hop.peer),
                            reason_of(e))
                if not reclaimed(reason_of(e), time.monotonic() - shadow.used_at):
                    self.client.ban(hop.peer, reason_of(e))
                raise CheckerFailed from None
            outs.append(x)
        shadow.used_at = time.monotonic()
        return outs

    async def _check(self, span: Span, shadow: Shadow, length: int) -> None:
        """Positions `[verified, length)` of the hop through the shadow's chain, compared. The chunk and its inputs
        are copied before anything is awaited: a rollback meanwhile changes the session's buffers from `cut`
        on, so only positions below `cut` can count as verified, while a mismatch anywhere is judged on the
        copies (what the hop returned for what it was sent)."""
        views = self.views(span)
        if views is None:
            return
        inputs, outputs, mask = views
        start = shadow.verified
        if length > inputs.shape[1] or length > outputs.shape[1]:
            return  # rolled back meanwhile
        x, want = inputs[:, start:length].clone(), outputs[:, start:length].clone()
        mask = None if mask is None else mask[:, :length].clone()
        try:
            outs = await self._through(shadow, x, start, mask)
        except CheckerFailed:
            if self.shadows.get(span) is shadow:
                self.drop(span)
            return
        if shadow.cut < start or shadow.verified != start:
            return  # rolled back below the chunk meanwhile: checked afresh next time
        self.checks += 1
        self.chunks_tokens += x.shape[1]
        far = distances(outs[-1], want)
        first = start + int(bad[0]) if len(bad := (far > self._tolerance(span, shadow, start)).nonzero()) else None
        if first is None:
            cut = min(shadow.cut, length)
            self._keep(shadow, [out[:, :cut - start] for out in outs], start)
            shadow.verified = cut
            return
        await self._settle(span, shadow, start, first, x, want, outs, mask, float(far[first - start]))

    def _tolerance(self, span: Span, shadow: Shadow, start: int) -> float:
        """What honest outputs may differ by here: the formats of the hop, its checkers, the wire, and of the
        replaced peers whose outputs are still at the hop's end."""
        owners = tuple(self.client.offer(p).format for p, until in self.owners.get(span.end, ()) if until > start)
        return tolerance(self.formats(span) + owners + tuple(self.client.offer(p).format for p in shadow.peers))

    async def _settle(self, span: Span, shadow: Shadow, start: int, first: int, x: torch.Tensor, want: torch.Tensor,
                      outs: list[torch.Tensor], mask: torch.Tensor | None, distance: float) -> None:
        """A mismatch at `first`: who lied (`client.inference.arbiter`), and what follows."""
        upto = first + 1
        inputs, outputs, _ = self.views(span) or (None, None, None)
        if inputs is None:
            return
        primary = self._owner(span, first) or shadow.primary  # a replaced peer's output, or the hop's
        logger.info("blocks %s: peer %s and checkers %s disagree from position %d (off by %.3g)", span,
                    describe_peer(primary), ", ".join(describe_peer(p) for p in sorted(shadow.peers)), first, distance)
        piece_inputs = [torch.cat([inputs[:, :start], x], 1)[:, :upto]]
        befores = [kept.view()[:, :start] if kept is not None and start else x[:, :0] for kept in shadow.outputs]
        piece_outputs = [torch.cat([before, out], 1)[:, :upto]
                         for before, out in zip(befores + [outputs[:, :start]], outs)]
        piece_inputs += piece_outputs[:-1]
        claimed = torch.cat([outputs[:, :start], want], 1)[:, :upto]
        tol = self._tolerance(span, shadow, start)
        verdict = await settle(self.client, primary, shadow.hops, piece_inputs, piece_outputs, claimed,
                               None if mask is None else mask[:, :upto], tol, start)
        if verdict.liar is None and verdict.other is None and shadow.verified == start and shadow.cut >= upto:
            # rounding: every piece agreed with the hop's own recomputation up to `first`; on from there
            self._keep(shadow, [out[:, :upto - start] for out in outs], start)
            shadow.verified = upto
            return
        if self.shadows.get(span) is shadow:
            self.drop(span)
        self._judge(span, primary, verdict, first, distance, shadow)

    def _judge(self, span: Span, primary: str, verdict: Verdict, first: int, distance: float,
               shadow: Shadow) -> None:
        checker = ", ".join(describe_peer(p) for p in sorted(shadow.peers))
        if verdict.liar == primary:
            if verdict.convicted:
                self.client.failures.convict(primary)
            logger.warning("peer %s returned wrong outputs for blocks %s at position %d (off by %.3g, checked "
                           "at %s)", describe_peer(primary), span, first, distance, checker)
            self._found(Lie(primary, span, first, distance, checker,
                            "wrong_output" if verdict.convicted else "failed_recompute"))
        elif verdict.liar is not None:
            if verdict.convicted:
                self.client.failures.convict(verdict.liar)
            logger.warning("peer %s returned wrong outputs while checking blocks %s of peer %s: other checkers "
                           "next", describe_peer(verdict.liar), span, describe_peer(primary))
        elif verdict.other is not None:
            logger.warning("peers %s and %s disagree about blocks %s from position %d, and nothing here can tell "
                           "which is right: other checkers next, else the hop is unchecked", describe_peer(primary),
                           describe_peer(verdict.other), verdict.span, first)
        else:
            logger.info("blocks %s: the difference at position %d is rounding (%s)", span, first, verdict.evidence)

    def _found(self, lie: Lie) -> None:
        """Keep the earliest lie found (the session rolls back to it; later ones are found again after it)."""
        if self.lie is None or lie.position < self.lie.position:
            self.lie = lie

    def _keep(self, shadow: Shadow, outs: list[torch.Tensor], start: int) -> None:
        for i, out in enumerate(outs[:len(shadow.outputs)]):  # the last checker's: the hop's own
            if start == 0 or shadow.outputs[i] is None:
                shadow.outputs[i] = Inputs(out, self.max_length)
            else:
                shadow.outputs[i].append(out)


class CheckerFailed(Exception):
    """A checker of a shadow failed (it is banned; the shadow is dropped)."""
