"""Signed announcements of what this peer serves, stored for every block of its span and once in the
swarm's directory (its bucket `records.directory_key(peer)`, with the model's number of blocks) for
health monitors.

Sequence numbers only grow, also across restarts with the same identity: each is at least the
current time in milliseconds. Re-announcing before the TTL runs out keeps the peer visible; a peer
that vanishes drops out of the swarm when its records expire.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from swarm import __version__

from swarm.net import records
from swarm.net.identity import Identity
from swarm.span import Span
from swarm.net.transport import Node, key_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Figures:
    """What a record says besides span and state: speed, cache left, load and links."""

    throughput: float = 0.0
    prefill_tps: float = 0.0
    cache_tokens_left: int = 0
    sessions: int | None = None
    queued: int | None = None
    links: dict | None = None
    max_blocks: int | None = None
    precision: tuple[str, str, str] | None = None  # device kind, dtype, quant


class Announcer:
    """Announces one span at a time (`span`, `state`), and retracts blocks a peer stops serving."""

    def __init__(self, node: Node, identity: Identity, model_id: str, span: Span, num_blocks: int, ttl: float,
                 digest: str | None = None):
        if not 0 < ttl <= records.MAX_TTL - records.CLOCK_SKEW:
            raise ValueError(f"record TTL must be in (0, {records.MAX_TTL - records.CLOCK_SKEW:.0f}] seconds")
        self.node, self.identity, self.model_id, self.span, self.ttl = node, identity, model_id, span, ttl
        self.num_blocks, self.digest = num_blocks, digest
        self.seq = 0
        self.state = "joining"
        self.since = time.time()  # when this peer began to claim `span`

    def _next_seq(self) -> int:
        self.seq = max(self.seq + 1, int(time.time() * 1000))
        return self.seq

    def claim(self, span: Span) -> None:
        """From now on announce `span` (a new claim: `since` restarts)."""
        self.span, self.since = span, time.time()

    async def announce(self, state: str, figures: Figures = Figures(), *, keep: Span | None = None,
                       keep_state: str = "online", directory: bool = True) -> int:
        """Store this peer's record under every block of its span and in the directory; returns how many
        block records were stored. With `keep` (the span a moving peer still serves), the blocks of `keep`
        outside the span also get a record of `keep` in `keep_state`: online while it drains, offline
        once it stops."""
        now = time.time()
        ann = records.Announcement(self.identity.peer_id, self.model_id, self.span.start, self.span.end, state,
                                   float(figures.throughput), float(figures.prefill_tps),
                                   int(figures.cache_tokens_left), __version__, self._next_seq(), now,
                                   self.num_blocks, figures.sessions, figures.queued, round(self.since, 3),
                                   figures.links or None, figures.max_blocks,
                                   *(figures.precision or (None, None, None)), digest=self.digest,
                                   reach=self.node.reached_by)
        expiration = now + self.ttl
        own = self.identity.peer_id
        keys = [records.block_key(self.model_id, block) for block in self.span]
        items = [(key, own, records.seal(self.identity, ann, key_id(key), expiration), expiration) for key in keys]
        if keep is not None:
            # the same speed over the kept span's length: throughput is per span
            old = dataclasses.replace(ann, start=keep.start, end=keep.end, state=keep_state, seq=self._next_seq(),
                                      since=None, throughput=round(ann.throughput * len(self.span) / len(keep), 3))
            for block in keep:
                if block not in self.span:
                    key = records.block_key(self.model_id, block)
                    items.append((key, own, records.seal(self.identity, old, key_id(key), expiration), expiration))
        bucket = records.directory_key(own)
        if directory:
            items.append((bucket, own, records.seal(self.identity, ann.for_directory(), key_id(bucket), expiration),
                          expiration))
        ok = await self.node.put_records(items)
        stored = sum(ok.get((key, own), False) for key in keys)
        self.state = state
        if stored < len(self.span):
            logger.warning("announced %s for %d of %d blocks %s", state, stored, len(self.span), self.span)
        if directory and not ok.get((bucket, own), False):
            logger.warning("announced %s for blocks %s, but not in the swarm's directory", state, self.span)
        return stored
