"""Checked outputs: a session's hops are recomputed on other replicas of the same blocks, in the background,
and compared. Async, on the session's event loop.

For each hop of the route the verifier keeps a *shadow*: a session on another peer serving the hop's blocks
in the same weight format (peers of other formats compute other numbers) that has been sent the hop's
inputs for positions `[0, verified)` and agreed on every output there. After each step, each hop starts a check with probability
`fraction` (if none is running): the shadow is sent the hop's inputs `[verified, length)` as one chunk (in
float32: exactly the values the hop received) and its outputs are compared with what the hop returned. So
every position is eventually compared, in chunks that cost a replica about what one decode step costs, and
`fraction` sets how soon: a peer that lies on every step is caught at the first check after its first lie
(about `1 / fraction` steps), and one that lies on some steps at the first check after any of them. `flush`
checks everything up to the current length (a generation calls it before its last tokens go out).

Outputs agree when, at every position, the relative L2 distance of the hidden vectors is within the
tolerance of the formats involved (`tolerance`): honest replicas differ by rounding (a chunk and single
tokens use different kernels; 16-bit and 8-bit formats and wire encodings round more). A lie smaller than
that is not caught: it is also no larger than what honest peers of those formats differ by.

On a mismatch the hop's peer is taken for the liar (the client cannot tell a lying checker from a lying
hop with two replicas, so a checker that accuses two different peers is banned as well): it is banned for
long, and the session records `lie`: the first position whose output was wrong. The session then rolls
back to it and replaces the hop (`InferenceSession.step` raises `Rewound`), and the generation goes on from
that position: what users saw was only verified output (`verified_length`), so nothing they saw changes.
A hop whose blocks have no other peer cannot be checked: it counts as verified (logged), until a replica
appears; then it is checked from the start.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from client.inference.encodings import REPLAY_ENCODING
from client.inference.failures import reason_of
from client.inference.peer_session import PeerSession
from client.inference.routing import Hop
from swarm.errors import SwarmError
from swarm.span import Span
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

TOLERANCES = (("nf4", 0.15), ("int8", 0.06), ("float16", 0.03), ("bfloat16", 0.03), ("float32", 1e-3))


def tolerance(formats: tuple[str, ...]) -> float:
    """Largest relative distance honest outputs may have, for the weight formats and wire encodings involved
    (e.g. "int8/bfloat16", "float32", "float16"): the loosest of them."""
    return max((tol for name, tol in TOLERANCES if any(name in f for f in formats)), default=TOLERANCES[-1][1])


def distances(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position, the largest over the batch of |got - want| / |want| (L2 over the hidden dimension)."""
    got, want = got.float(), want.float()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).amax(0)


@dataclass
class Lie:
    peer: str
    span: Span
    position: int  # the first position whose output disagreed
    distance: float
    checker: str


@dataclass
class Shadow:
    hop: Hop  # the checking replica
    primary: str  # the peer whose outputs it checks
    session: PeerSession | None = None
    verified: int = 0
    task: asyncio.Task | None = None


class Verifier:
    """Checks one session's hops. `views(span)` gives the hop's inputs and outputs for positions
    `[0, length)` as the session holds them (None if the hop is not part of the route any more)."""

    def __init__(self, client, fraction: float, rng: random.Random, max_length: int, batch: int,
                 views: Callable[[Span], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None],
                 formats: Callable[[Span], tuple[str, ...]]):
        self.client, self.fraction, self.rng = client, fraction, rng
        self.max_length, self.batch, self.views, self.formats = max_length, batch, views, formats
        self.shadows: dict[Span, Shadow] = {}
        self.unchecked: set[Span] = set()  # spans that had no other replica when last looked for
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
            replica = self.client.replica(span, exclude={peer}, fmt=self.client.offer(peer).format, rng=self.rng)
            if replica is None:
                if span not in self.unchecked:
                    logger.info("blocks %s have no other peer to check %s against", span, describe_peer(peer))
                self.unchecked.add(span)
                return None
            self.unchecked.discard(span)  # checked from the start, now that a replica is there
            shadow = self.shadows[span] = Shadow(replica, peer)
        if shadow.task is None or shadow.task.done():
            if shadow.verified < length:
                shadow.task = asyncio.create_task(self._check(span, shadow, length))
        return shadow.task

    async def flush(self, links: list[tuple[Span, str]], length: int) -> None:
        """Check every hop up to `length` now (and wait for it)."""
        if self.fraction <= 0:
            return
        for _ in range(3):  # a check that was running covers less than `length`: once more
            tasks = [t for span, peer in links if (t := self.start(span, peer, length)) is not None]
            if not tasks or self.lie is not None:
                return
            await asyncio.gather(*tasks, return_exceptions=True)
            if all(self.verified(span, length) >= length for span, _ in links):
                return

    def rollback(self, position: int) -> None:
        """The session now holds positions `[0, position)` only."""
        for shadow in self.shadows.values():
            shadow.verified = min(shadow.verified, position)

    def drop(self, span: Span) -> None:
        shadow = self.shadows.pop(span, None)
        if shadow is not None:
            self._end(shadow)

    async def close(self) -> None:
        shadows, self.shadows = list(self.shadows.values()), {}
        for shadow in shadows:
            self._end(shadow)
        await asyncio.gather(*(s.task for s in shadows if s.task is not None), return_exceptions=True)
        await asyncio.gather(*(self.client.close_session(s.hop.peer, s.session) for s in shadows
                               if s.session is not None))

    def _end(self, shadow: Shadow) -> None:
        if shadow.task is not None and not shadow.task.done():
            shadow.task.cancel()
        if shadow.session is not None:
            session, shadow.session = shadow.session, None
            asyncio.ensure_future(self.client.close_session(shadow.hop.peer, session))

    async def _check(self, span: Span, shadow: Shadow, length: int) -> None:
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
            if shadow.session is None:
                shadow.session = await self.client.open_session(shadow.hop, max_length=self.max_length,
                                                                batch=self.batch, encodings=(REPLAY_ENCODING,))
            got = await asyncio.wait_for(shadow.session.step(x, start, mask, REPLAY_ENCODING),
                                         self.client.deadline(shadow.hop, x.shape[0] * x.shape[1]))
        except (asyncio.TimeoutError, SwarmError) as e:
            # the checker failed, not the hop: another replica checks next time
            logger.info("checking blocks %s at peer %s failed (%s)", span, describe_peer(shadow.hop.peer), reason_of(e))
            self.client.ban(shadow.hop.peer, reason_of(e))
            if self.shadows.get(span) is shadow:
                self.drop(span)
            return
        self.checks += 1
        self.chunks_tokens += x.shape[1]
        far = distances(got, want)
        tol = tolerance(self.formats(span) + (self.client.offer(shadow.hop.peer).format,))
        bad = (far > tol).nonzero()
        if len(bad) == 0:
            shadow.verified = max(shadow.verified, length)
            return
        first = int(bad[0])
        self.lie = Lie(shadow.primary, span, start + first, float(far[first]), shadow.hop.peer)
        logger.warning("peer %s returned wrong outputs for blocks %s at position %d (off by %.3g, tolerance "
                       "%.3g, checked at %s)", describe_peer(shadow.primary), span, start + first, float(far[first]),
                       tol, describe_peer(shadow.hop.peer))
        self.client.failures.wrong_output(shadow.primary, shadow.hop.peer)
        shadow.verified = start + first
