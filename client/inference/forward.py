"""The stateless forward: whole sequences through every block, hop by hop, with no cache on the peers. Async.

A failed hop (a typed error, no reply within the hop's deadline, or an output no blocks can produce:
`client.inference.hops.check_plausible`) goes to the client's one failure policy
(`client.inference.failures.Attempts`), which raises or bans the peer; the hop's span is then rerouted and
the same input sent to the new hops. Nothing stays on a peer between calls, so nothing is replayed: unlike a
session's failover (`client.inference.session`) there is no expired session to reopen, no slow peer to
avoid and no history to keep.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from client.config import ClientConfig
from client.inference import peer_session
from client.inference.failures import FailurePolicy
from client.inference.hops import check_plausible
from client.inference.routing import Hop
from swarm.errors import SwarmError
from swarm.net.transport import Node
from swarm.span import Span


class Peers(Protocol):
    """What a stateless forward asks of the client's view of the swarm (`SwarmClient`)."""

    node: Node
    model_id: str
    digest: str | None  # the weights of the client's head
    config: ClientConfig
    failures: FailurePolicy
    floor: float  # the spread under which a hidden vector is degenerate for the model

    async def route(self, span: Span | None = None) -> list[Hop]: ...

    def deadline(self, hop: Hop, tokens: int) -> float: ...

    def succeeded(self, peer: str) -> None: ...


async def forward(peers: Peers, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`hidden` [batch, tokens, hidden] through every block, hop by hop, rerouting a failed hop's span."""
    hops = await peers.route()
    x, i = hidden.float(), 0
    attempts = peers.failures.attempts(peers.model_id)
    while i < len(hops):
        hop = hops[i]
        try:
            x_next = await asyncio.wait_for(
                peer_session.forward(peers.node, hop.peer, peers.model_id, hop.span, x, attention_mask,
                                     timeout=peers.config.step_timeout, digest=peers.digest),
                peers.deadline(hop, x.shape[0] * x.shape[1]))
            check_plausible(hop, x, x_next, peers.floor)
        except (asyncio.TimeoutError, SwarmError) as e:
            attempts.failed(hop.peer, hop.span, e)  # raises: give up
            hops[i:i + 1] = await peers.route(hop.span)
            continue
        peers.succeeded(hop.peer)
        x, i = x_next, i + 1
    return x
