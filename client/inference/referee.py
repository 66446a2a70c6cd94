"""The client's own computation of one block, the last word in a dispute between two peers. Sync loading, async use.

Two peers that computed different outputs for the same inputs are narrowed down, by their own answers, to one
block and one input (`client.inference.arbiter`; the blocks from one start to the next where a span of the model
may start only at some, `swarm.span.span_starts`); the client then runs that block itself, from the checkpoint's
weights, and whoever disagrees with it lied. The weights are the model's own: a local checkpoint's files, or a
hub model's shard holding the block, fetched once and checked against the hashes the hub lists (the same
hashes that name the weights in the swarm, `swarm.weights.digest`). No peer's word enters the verdict.

Cost, once per dispute: one block's forward over the disputed positions on the client (float32, on its CPU),
and, for a hub model, the shard files holding that block the first time one of its blocks is disputed (a shard
of a large checkpoint is a few GB). At most `KEEP` blocks stay loaded between disputes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict

import torch

from swarm.model.blocks import SpanBlocks
from swarm.model.checkpoint import Checkpoint
from swarm.span import Span

logger = logging.getLogger(__name__)

KEEP = 2  # blocks kept loaded after a dispute (the next one is often about the same block)


class Referee:
    """Runs the blocks of a dispute (one, or those from one start to the next) of `checkpoint` locally, in float32."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._blocks: OrderedDict[Span, SpanBlocks] = OrderedDict()
        self._lock = threading.Lock()  # one load or forward at a time: the client's CPU is the user's
        self.runs = 0

    async def run(self, span: Span, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """`x` (positions `[0, n)`, attention mask `mask`) through blocks `span`; None if their weights
        cannot be had (a hub that cannot be reached, a file whose hash is wrong): the dispute stays open."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._run, span, x, mask)
        except Exception as e:  # noqa: BLE001 - whatever kept the weights away, the dispute is then unsettled
            logger.warning("could not compute blocks %s here to settle a dispute: %s", span, e)
            return None

    def _run(self, span: Span, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        with self._lock:
            blocks = self._blocks.pop(span, None)
            if blocks is None:
                logger.info("loading blocks %s here to settle a dispute", span)
                blocks = SpanBlocks(self.checkpoint, span)
            self._blocks[span] = blocks
            while len(self._blocks) > KEEP:
                self._blocks.popitem(last=False)
            self.runs += 1
            return blocks.forward(x.float(), None, 0, mask).float()
