"""Settling a failed check (`client.inference.verify`): who returned wrong outputs, the hop or a checker. Async.

A check runs a hop's inputs (peer P, blocks S) through a chain of other peers covering S (its checkers: one
peer, or several whose spans together cover S) and compares the outputs. When they differ, the client takes
neither side on its word:
1. P recomputes each checker's piece (a stateless forward of that piece's inputs, as the checkers computed
   them). P disagreeing with two or more different checkers means two independent peers agree against P:
   P lied. If P agrees with every piece, P recomputes its whole span: if that contradicts what its session
   returned (an honest peer computes the same numbers both ways, within the tolerance), P lied; if not,
   nobody did (the pieces' rounding added up past the tolerance) and the outputs count as checked.
2. Otherwise P disagrees with exactly one checker c, on c's piece T. A third opinion: another chain of peers
   for T, neither P nor c, recomputes it, and whichever of P and c it agrees with (and the other not) is
   right; a third that agrees with both or neither settles nothing (step 3).
3. No third chain exists: a dispute (`FailurePolicy.dispute`). A peer that disputed with two different
   peers is the liar; otherwise the dispute stays open: neither is banned, and the hop's outputs from
   there on are not given out (the session refuses with `Disputed` if nothing settles it).
A peer that fails to recompute (an error, no answer in time) is banned as any failed peer is, and loses.
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


@dataclass(frozen=True)
class Verdict:
    liar: str | None  # the peer that returned wrong outputs; None: nobody (`other` None) or an open dispute
    other: str | None = None  # the other side of an open dispute
    span: Span | None = None  # the blocks they disagree about
    convicted: bool = True  # False: the liar failed to recompute (a failure, not a proven lie)


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


async def settle(client, primary: str, fmt: str, checkers: list[Hop], inputs: list[torch.Tensor],
                 outputs: list[torch.Tensor], claimed: torch.Tensor, mask: torch.Tensor | None,
                 tol: float) -> Verdict:
    """Who lied, P (`primary`) or one of `checkers` (module docstring). `inputs[j]`, `outputs[j]`: what checker
    j was given and returned, positions `[0, n)`; `claimed`: what P returned for them; `mask`: the attention
    mask of those positions."""
    against, mine = [], None
    for hop, x, want in zip(checkers, inputs, outputs):
        mine = await _recompute(client, Hop(primary, hop.span), x, mask)
        if mine is None:
            return Verdict(primary, convicted=False)
        if disagree(mine, want, tol):
            against.append((hop, x, want, mine))
    if len({hop.peer for hop, *_ in against}) > 1:
        logger.info("peer %s's outputs contradict %d different peers", describe_peer(primary), len(against))
        return Verdict(primary)
    if not against:
        if len(checkers) > 1:  # one checker: its piece was the whole span, recomputed already
            whole = Hop(primary, Span(checkers[0].span.start, checkers[-1].span.end))
            mine = await _recompute(client, whole, inputs[0], mask)
            if mine is None:
                return Verdict(primary, convicted=False)
        if disagree(mine, claimed, tol):
            logger.info("peer %s's outputs contradict its own recomputation", describe_peer(primary))
            return Verdict(primary)
        return Verdict(None)  # everyone agrees piece by piece: rounding, not a lie
    hop, x, want, mine = against[0]
    third = await _third_opinion(client, hop.span, {primary, hop.peer}, fmt, x, mask)
    if third is not None:
        if not disagree(third, want, tol) and disagree(third, mine, tol):
            return Verdict(primary)
        if not disagree(third, mine, tol) and disagree(third, want, tol):
            return Verdict(hop.peer)
    liar = client.failures.dispute(primary, hop.peer)
    return Verdict(liar, None if liar else hop.peer, hop.span, convicted=False)


async def _recompute(client, hop: Hop, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """`recompute` by the hop under suspicion; None if it failed (it is banned as a failed peer)."""
    try:
        return await recompute(client, hop, x, mask)
    except (asyncio.TimeoutError, SwarmError) as e:
        client.ban(hop.peer, reason_of(e))
        logger.info("peer %s could not recompute blocks %s to settle a check (%s)", describe_peer(hop.peer),
                    hop.span, reason_of(e))
        return None


async def _third_opinion(client, span: Span, parties: set[str], fmt: str, x: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor | None:
    """`x` through another chain of peers covering `span` in format `fmt` (none of `parties`, nor the peers
    they disputed with); None if there is none or it fails."""
    exclude = set(parties).union(*(client.failures.disputed(p) for p in parties))
    chain = client.checkers(span, exclude=exclude, fmt=fmt)
    if chain is None:
        return None
    for hop in chain:
        try:
            x = await recompute(client, hop, x, mask)
        except (asyncio.TimeoutError, SwarmError) as e:
            client.ban(hop.peer, reason_of(e))
            return None
    return x
