"""Chained steps of an inference session: peers pass activations straight to the next peer of the route
(docs/protocol.md). A mixin of `InferenceSession` (client/inference/session.py), which owns the links, the history and
the failover these methods hand failures to.

Every peer still replies its output to the client. Each later hop's step is tagged for the hop before it, so
only that peer can push it, and each output names what it computed on: a hop that computed on something else
than the previous hop's output (as the client received it) means the previous hop pushed something else than
it returned (`ChainMismatch`): that hop fails, its step is redone, and the rest of the step is relayed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from client.inference.hops import IDLE_REOPEN_S, check_plausible
from swarm.net import wire
from swarm.errors import BadRequest, ChainMismatch, StepTimeout, SwarmError
from swarm.net.integrity import input_digest
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.5  # seconds a peer that missed a chained step's deadline has to answer an info call


class ChainedSteps:

    def _can_chain(self, i: int) -> bool:
        """Whether links `i`.. can take a chained step: chaining is on, at least two hops are left, each has an
        open session used recently (a long-idle one may have been reclaimed: relaying finds out at once), and
        no peer holds two of them (a route rebuilt around a failure can visit a peer twice; peers refuse a
        chain that names one twice, so such a route is relayed)."""
        if not self.config.chain or i >= len(self.links) - 1:
            return False
        peers = [link.hop.peer for link in self.links[i:]]
        if len(set(peers)) < len(peers):
            return False
        now = time.monotonic()
        return all(link.session is not None and not link.slow and now - link.used_at < IDLE_REOPEN_S
                   for link in self.links[i:])

    async def _chain(self, i: int, x: torch.Tensor, position: int, mask: torch.Tensor | None,
                     encoding: str) -> tuple[int, torch.Tensor, SwarmError | None]:
        """Send `x` to link `i` naming every later link, then collect each link's output as the peers push
        the step along. Returns where to go on: (the first link not done, its input, and the error of that
        link's peer if it failed). A link that failed or stayed past its deadline is handled as in a relayed
        step (reopened if it expired, else replaced and replayed); a link whose push did not leave hands the
        next link to the client, which sends it the step itself."""
        links = self.links[i:]
        tokens, shape = x.shape[1], tuple(x.shape)
        # each later hop's step is tagged for the hop before it: only that peer can push it (`swarm.net.integrity`)
        chain = [link.session.chain_hop(sender=before.hop.peer) for before, link in zip(links, links[1:])]
        mask_blob = None if mask is None else wire.blob_of(mask)
        now = time.monotonic()
        for link in links:
            link.used_before, link.used_at = link.used_at, now
        started = self._chain_began = time.perf_counter()
        try:
            step = await asyncio.wait_for(links[0].session.send(x, position, mask, chain=chain, encoding=encoding),
                                          self.client.deadline(links[0].hop, shape[0] * tokens))
        except asyncio.TimeoutError:
            return i, x, StepTimeout(f"peer {describe_peer(links[0].hop.peer)} did not take a step in time")
        except SwarmError as e:
            return i, x, e
        steps = [step] + [hop.step for hop in chain]
        before: torch.Tensor | None = None  # the previous link's input
        for j, link in enumerate(links):
            if self.closed:
                raise BadRequest("the inference session was closed during a step")
            # what a pushed step must have computed on: the previous hop's output, as the client received it
            expected = input_digest(position, links[j - 1].session.last_output.hidden, mask_blob) if j else None
            try:
                out = await link.session.receive(steps[j], shape, self.client.deadline(link.hop, shape[0] * tokens),
                                                 expected)
                check_plausible(link.hop, x, out)
            except ChainMismatch as e:
                # the previous hop pushed something else than it returned: it fails, and its step is redone
                upstream = links[j - 1]
                self.client.failures.chain_mismatch(upstream.hop.peer, link.hop.peer)
                self.history[upstream.hop.span.start].truncate(position)
                return i + j - 1, before, e
            except SwarmError as e:
                if j and isinstance(e, StepTimeout) and await self.client.answers(link.hop.peer, PROBE_TIMEOUT):
                    # alive, so its input may be what went missing (a push lost on the way): send it directly
                    logger.info("no chained output from peer %s for blocks %s, but it answers: sending it the "
                                "step", describe_peer(link.hop.peer), link.hop.span)
                    return i + j, x, None
                return i + j, x, e
            now = time.perf_counter()
            self._observe(link, (now - started) * 1e3, tokens)
            self.hop_inputs["sent" if j == 0 else "pushed"] += 1
            started = now
            self._record(i + j, x, position)
            before, x = x, out
            if j < len(links) - 1 and not link.session.pushed:
                return i + j + 1, x, None
        return len(self.links), x, None
