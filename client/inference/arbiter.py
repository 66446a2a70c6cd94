"""Settling a failed check (`client.inference.verify`): who returned wrong outputs, the hop or a checker. Async.

A check runs a hop's inputs (peer P, blocks S) through a chain of other peers covering S (its checkers: one
peer, or several whose spans together cover S) and compares the outputs. When they differ, nobody is taken
on its word, and no number of peers agreeing convicts anyone (identities cost nothing). A peer is convicted
only by evidence no accuser can make:
- **its own answers contradict each other**: what its session returned against its stateless recomputation
  of the same inputs (within the formats' tolerance), or its stateless answers for parts chained together
  against its stateless answer for their whole span (tightly: one peer computing the same numbers twice,
  `TIGHT` of the tolerance);
- **the client's own computation** (`client.inference.referee`) of the one block where it and the other side
  first disagree on the same input.

1. P recomputes its whole span: its session's answer must agree with it. P recomputes each checker's piece on
   that checker's input; where it disagrees with checker c's answer, c recomputes its piece too (its
   session's answer must agree with that), and if the two recomputations disagree it is a dispute of two
   (step 2). If every piece agrees, P's pieces chained must agree with its whole-span recomputation;
   otherwise nobody lied (the pieces' rounding added up past the tolerance).
2. Bisection, on stateless answers only: both sides compute the first half of T on their input and the second
   half on their own first half's output; a side whose halves contradict its answer for T is convicted. The
   half where they disagree is kept (for the second half, each side's input is its own first-half output) until one
   block is left, which the client computes on each side's input: a side that disagrees with that lied.
   About 2 log2(|T|) forwards of at most |T| blocks by each side, then one block here. Halves are cut only where a
   span of the model may start (`swarm.span.span_starts`, the client's `starts`), nearest the middle: the blocks
   left are then those from one start to the next, computed here together.
3. Without a referee (no checkpoint at hand, or its weights cannot be had), the dispute stays open: neither
   side is banned, and the hop's outputs from there are unchecked (said as for a sole server), never
   verified. Disputes are forgotten after `failures.DISPUTE_S`.
A peer that fails to answer (an error, no answer in time) is banned as any failed peer is, and loses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from client.inference import peer_session
from client.inference.encodings import REPLAY_ENCODING
from client.inference.failures import reason_of
from client.inference.routing import Hop
from swarm.errors import SwarmError
from swarm.net.transport import describe_peer
from swarm.span import Span

logger = logging.getLogger(__name__)

TIGHT = 0.25  # a peer's stateless answers chained may differ from its answer for their whole span by this share of
# the tolerance (the same peer computing the same numbers twice: 0.0 measured on CPU in float32, bfloat16 and int8)
SESSION_CONTRADICTS = "its session's outputs contradict its own recomputation"


@dataclass(frozen=True)
class Verdict:
    liar: str | None  # the peer that returned wrong outputs; None: nobody (`other` None) or an open dispute
    other: str | None = None  # the other side of an open dispute
    span: Span | None = None  # the blocks they disagree about
    convicted: bool = True  # False: the liar failed to answer (a failure, not a proven lie)
    evidence: str = ""  # why, as a log says it


def distances(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position, the largest over the batch of |got - want| / |want| (L2 over the hidden dimension)."""
    got, want = got.float(), want.float()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).amax(0)


def disagree(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Whether some position's hidden vectors differ by more than `tol` of their norm."""
    return bool((distances(got, want) > tol).any())


async def recompute(client, hop: Hop, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`x` (positions `[0, n)`) through `hop` as a stateless forward; raises what the peer did wrong."""
    return await asyncio.wait_for(
        peer_session.forward(client.node, hop.peer, client.model_id, hop.span, x, mask,
                             timeout=client.config.step_timeout, encoding=REPLAY_ENCODING, digest=client.digest),
        client.deadline(hop, x.shape[0] * x.shape[1]))


class Failed(Exception):
    """A side failed to answer (it is banned as a failed peer)."""

    def __init__(self, peer: str):
        self.peer = peer


async def settle(client, primary: str, checkers: list[Hop], inputs: list[torch.Tensor],
                 outputs: list[torch.Tensor], claimed: torch.Tensor, mask: torch.Tensor | None,
                 tol: float, start: int = 0) -> Verdict:
    """Who lied, P (`primary`) or one of `checkers` (module docstring). `inputs[j]`, `outputs[j]`: what checker
    j was given and returned, positions `[0, n)` (its own from `start` on: before, what was kept of earlier
    checks); `claimed`: what P returned for them; `mask`: the attention mask of those positions."""
    try:
        return await _settle(client, primary, checkers, inputs, outputs, claimed, mask, tol, start)
    except Failed as e:
        return Verdict(e.peer, convicted=False, evidence="it failed to answer")


async def _settle(client, primary, checkers, inputs, outputs, claimed, mask, tol, start) -> Verdict:
    whole = Span(checkers[0].span.start, checkers[-1].span.end)
    own = await _forward(client, primary, whole, inputs[0], mask)
    if disagree(own, claimed, tol):
        return _convicted(primary, whole, SESSION_CONTRADICTS)
    mine = []
    for hop, x, want in zip(checkers, inputs, outputs):
        mine.append(own if len(checkers) == 1 else await _forward(client, primary, hop.span, x, mask))
        if not disagree(mine[-1], want, tol):
            continue
        # the dispute is between stateless answers of both sides; the checker's session answered the same first
        theirs = await _forward(client, hop.peer, hop.span, x, mask)
        if disagree(theirs[:, start:], want[:, start:], tol):
            return _convicted(hop.peer, hop.span, SESSION_CONTRADICTS)
        if disagree(mine[-1], theirs, tol):
            return await bisect(client, (primary, hop.peer), hop.span, (x, x), (mine[-1], theirs), mask, tol)
    if len(checkers) > 1:
        chained = mine[0]
        for hop in checkers[1:]:
            chained = await _forward(client, primary, hop.span, chained, mask)
        if disagree(chained, own, tol * TIGHT):
            return _convicted(primary, whole, "its pieces chained contradict its answer for their whole span")
    return Verdict(None, evidence="every piece agrees: rounding")


async def bisect(client, sides: tuple[str, str], span: Span, inputs: tuple[torch.Tensor, torch.Tensor],
                 claims: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, tol: float) -> Verdict:
    """Two peers (`sides`) that computed `claims` for `span` from `inputs` (each its own) and disagree: narrowed
    down to one block, which the client computes (module docstring, step 2)."""
    starts = getattr(client, "starts", None)
    while len(span) > 1:
        mid = _middle(span, starts)
        if mid is None:
            break  # no span may start inside it: the client computes it whole
        first, second = Span(span.start, mid), Span(mid, span.end)
        halves = await asyncio.gather(*(_halves(client, peer, first, second, x, mask)
                                        for peer, x in zip(sides, inputs)))
        for peer, (_, b), claim in zip(sides, halves, claims):
            if disagree(b, claim, tol * TIGHT):
                return _convicted(peer, span, f"its answers for blocks {first} and {second} chained contradict its "
                                              f"answer for {span}")
        (a0, b0), (a1, b1) = halves
        if disagree(a0, a1, tol):
            span, claims = first, (a0, a1)
        elif disagree(b0, b1, tol):
            span, inputs, claims = second, (a0, a1), (b0, b1)
        else:
            return Verdict(None, evidence=f"every half of blocks {span} agrees: rounding")
    return await _referee(client, sides, span, inputs, claims, mask, tol)


def _middle(span: Span, starts) -> int | None:
    """Where to cut `span` in two: its middle, or the start of `starts` inside it nearest the middle (the lower on a
    tie); None if no span may start inside it."""
    middle = span.start + len(span) // 2
    if starts is None:
        return middle
    inside = [b for b in starts if span.start < b < span.end]
    return min(inside, key=lambda b: (abs(b - middle), b)) if inside else None


async def _referee(client, sides, span, inputs, claims, mask, tol) -> Verdict:
    referee = getattr(client, "referee", None)
    truths = [None, None]
    if referee is not None:  # the second side's input is the first's, or its own (after a half they agreed on)
        truths[0] = await referee.run(span, inputs[0], mask)
        same = inputs[1] is inputs[0] or truths[0] is None
        truths[1] = truths[0] if same else await referee.run(span, inputs[1], mask)
    if any(t is None for t in truths):
        logger.warning("peers %s and %s disagree about blocks %s, and they cannot be computed here: the dispute stays "
                       "open", describe_peer(sides[0]), describe_peer(sides[1]), span)
        client.failures.dispute(*sides)
        return Verdict(None, sides[1], span, convicted=False)
    wrong = [peer for peer, claim, t in zip(sides, claims, truths) if disagree(claim, t, tol)]
    evidence = f"its output of blocks {span} contradicts this client's own computation"
    if len(wrong) == 2:
        client.failures.convict(wrong[1])  # both lied: one verdict returned, the other convicted here
        logger.warning("peer %s returned wrong outputs for blocks %s: %s", describe_peer(wrong[1]), span, evidence)
    if wrong:
        return _convicted(wrong[0], span, evidence)
    return Verdict(None, evidence=f"both sides agree with this client's computation of blocks {span}: rounding")


def _convicted(peer: str, span: Span, evidence: str) -> Verdict:
    logger.warning("peer %s returned wrong outputs for blocks %s: %s", describe_peer(peer), span, evidence)
    return Verdict(peer, span=span, evidence=evidence)


async def _halves(client, peer: str, first: Span, second: Span, x: torch.Tensor,
                  mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    a = await _forward(client, peer, first, x, mask)
    return a, await _forward(client, peer, second, a, mask)


async def _forward(client, peer: str, span: Span, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`recompute` by a side of a dispute; `Failed` if it failed (it is banned as a failed peer)."""
    try:
        out = await recompute(client, Hop(peer, span), x, mask)
    except (asyncio.TimeoutError, SwarmError) as e:
        client.ban(peer, reason_of(e))
        logger.info("peer %s could not recompute blocks %s to settle a check (%s)", describe_peer(peer), span,
                    reason_of(e))
        raise Failed(peer) from None
    client.failures.succeeded(peer)  # it served this client: a later timeout is no stall
    return out
