"""Chained steps: peers pass activations straight to the next peer of the route (docs/protocol.md).
Functions over a `Route` (client/inference/route.py); they step its links, keep its history and measure its
hops, and hand what went wrong back in a `Chained` result, which the session (client/inference/session.py)
reads to go on or fail over. They never call the session.

Every peer still replies its output to the client. Each later hop's step is tagged for the hop before it, so
only that peer can push it, and each output names what it computed on: a hop that computed on something else
than the previous hop's output (as the client received it) means the previous hop pushed something else than
it returned, or that it lies about what it got (`ChainMismatch`): word against word, so nobody is blamed; the
client sends that hop its input itself (a relayed step, whose input digest the client checks against what it
sent), relays the rest of the step (the later hops roll back to its position), and does not chain that pair
again (`FailurePolicy.chain_mismatch`).

Invariant: the history holds the input of every link the result says is done (links before `next`), as in a
relayed step, so a failover after a chained step replays exactly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from client.inference.hops import IDLE_REOPEN_S, check_plausible
from client.inference.route import Route
from swarm.net import wire
from swarm.errors import BadRequest, ChainMismatch, StepTimeout, SwarmError
from swarm.net.integrity import input_digest
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.5  # seconds a peer that missed a chained step's deadline has to answer an info call


@dataclass(frozen=True)
class Chained:
    """Where a chained step leaves off: `next`, the first link not done, with `x`, its input, and `failed`,
    the error of that link's peer if it failed (None: the client sends it the step itself). `began`: when the
    step was sent (a failover's stall counts from there); `sent` and `pushed`: hop inputs the client sent and
    those a peer pushed on."""

    next: int
    x: torch.Tensor
    failed: SwarmError | None
    began: float
    sent: int = 0
    pushed: int = 0
    mismatch: bool = False  # a hop said it got other input than pushed: the rest of the step is relayed


def can_chain(route: Route, i: int) -> bool:
    """Whether links `i`.. can take a chained step: chaining is on, at least two hops are left, each has an
    open session used recently (a long-idle one may have been reclaimed: relaying finds out at once), and
    no peer holds two of them (a route rebuilt around a failure can visit a peer twice; peers refuse a
    chain that names one twice, so such a route is relayed)."""
    if not route.config.chain or i >= len(route.links) - 1:
        return False
    peers = [link.hop.peer for link in route.links[i:]]
    if len(set(peers)) < len(peers):
        return False
    now = time.monotonic()
    failures = route.client.failures
    return all(link.session is not None and not link.slow and now - link.used_at < IDLE_REOPEN_S
               for link in route.links[i:]) and \
        all(failures.chainable(a.hop.peer, b.hop.peer) for a, b in zip(route.links[i:], route.links[i + 1:]))


async def chain(route: Route, i: int, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                encoding: str) -> Chained:
    """Send `x` to link `i` naming every later link, then collect each link's output as the peers push the
    step along, keeping each done link's input in the history. A link that failed or stayed past its deadline
    ends the step with its error (the caller handles it as in a relayed step); a link whose push did not
    leave ends it without one (the caller sends the next link its input)."""
    links, client = route.links[i:], route.client
    tokens, shape = x.shape[1], tuple(x.shape)
    # each later hop's step is tagged for the hop before it: only that peer can push it (`swarm.net.integrity`)
    hops = [link.session.chain_hop(sender=before.hop.peer) for before, link in zip(links, links[1:])]
    mask_blob = None if mask is None else wire.blob_of(mask)
    now = time.monotonic()
    for link in links:
        link.used_at = now
    began = started = time.perf_counter()
    try:
        step = await asyncio.wait_for(links[0].session.send(x, position, mask, chain=hops, encoding=encoding),
                                      route.deadline(links[0], shape[0] * tokens))
    except asyncio.TimeoutError:
        return Chained(i, x, StepTimeout(f"peer {describe_peer(links[0].hop.peer)} did not take a step in time"),
                       began)
    except SwarmError as e:
        return Chained(i, x, e, began)
    steps = [step] + [hop.step for hop in hops]
    for j, link in enumerate(links):
        done = {"began": began, "sent": min(j, 1), "pushed": max(j - 1, 0)}  # links 0.. j - 1 are done
        if route.closed:
            raise BadRequest("the inference session was closed during a step")
        # what a pushed step must have computed on: the previous hop's output, as the client received it
        expected = input_digest(position, links[j - 1].session.last_output.hidden, mask_blob) if j else None
        try:
            out = await link.session.receive(steps[j], shape, route.deadline(link, shape[0] * tokens), expected)
            check_plausible(link.hop, x, out, route.client.floor)
        except ChainMismatch:
            # word against word (module docstring): the client sends this hop the previous one's output itself
            client.failures.chain_mismatch(links[j - 1].hop.peer, link.hop.peer)
            return Chained(i + j, x, None, **done, mismatch=True)
        except SwarmError as e:
            if j and isinstance(e, StepTimeout) and await client.answers(link.hop.peer, PROBE_TIMEOUT):
                # alive, so its input may be what went missing (a push lost on the way): send it directly
                logger.info("no chained output from peer %s for blocks %s, but it answers: sending it the "
                            "step", describe_peer(link.hop.peer), link.hop.span)
                return Chained(i + j, x, None, **done)
            return Chained(i + j, x, e, **done)
        now = time.perf_counter()
        route.observe(link, (now - started) * 1e3, tokens)
        started = now
        route.record(i + j, x, position)
        x = out
        if j < len(links) - 1 and not link.session.pushed:
            return Chained(i + j + 1, x, None, began, sent=1, pushed=j)
    return Chained(len(route.links), x, None, began, sent=1, pushed=len(links) - 1)
