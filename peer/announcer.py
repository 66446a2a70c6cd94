"""Signed announcements of what this peer serves, stored for every block of its span and once in the
swarm's directory (its bucket `records.directory_key(peer)`, with the model's number of blocks) for
health monitors.

Sequence numbers only grow, also across restarts with the same identity: each is at least the
current time in milliseconds. Re-announcing before the TTL runs out keeps the peer visible; a peer
that vanishes drops out of the swarm when its records expire.
"""

from __future__ import annotations

import logging
import time

from swarm import __version__, records
from swarm.identity import Identity
from swarm.span import Span
from swarm.transport import Node, key_id

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(self, node: Node, identity: Identity, model_id: str, span: Span, num_blocks: int, ttl: float):
        if not 0 < ttl <= records.MAX_TTL - records.CLOCK_SKEW:
            raise ValueError(f"record TTL must be in (0, {records.MAX_TTL - records.CLOCK_SKEW:.0f}] seconds")
        self.node, self.identity, self.model_id, self.span, self.ttl = node, identity, model_id, span, ttl
        self.num_blocks = num_blocks
        self.seq = 0
        self.state = "joining"

    def _next_seq(self) -> int:
        self.seq = max(self.seq + 1, int(time.time() * 1000))
        return self.seq

    async def announce(self, state: str, throughput: float = 0.0, prefill_tps: float = 0.0,
                       cache_tokens_left: int = 0) -> int:
        """Store this peer's record under every block of its span and in the directory; returns how many
        block records were stored."""
        now = time.time()
        ann = records.Announcement(self.identity.peer_id, self.model_id, self.span.start, self.span.end, state,
                                   float(throughput), float(prefill_tps), int(cache_tokens_left), __version__,
                                   self._next_seq(), now, self.num_blocks)
        expiration = now + self.ttl
        directory = records.directory_key(self.identity.peer_id)
        keys = [records.block_key(self.model_id, block) for block in self.span] + [directory]
        items = [(key, self.identity.peer_id, records.seal(self.identity, ann, key_id(key), expiration), expiration)
                 for key in keys]
        ok = await self.node.put_records(items)
        stored = sum(ok.get((key, self.identity.peer_id), False) for key in keys[:-1])
        self.state = state
        if stored < len(self.span):
            logger.warning("announced %s for %d of %d blocks %s", state, stored, len(self.span), self.span)
        if not ok.get((directory, self.identity.peer_id), False):
            logger.warning("announced %s for blocks %s, but not in the swarm's directory", state, self.span)
        return stored
