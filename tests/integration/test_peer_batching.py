"""Six clients decoding at once on one peer get what they get one after another, and the peer batched them.

A swarm of its own: one peer serving all blocks of the tiny llama with --metrics-port 0. Six sessions,
each at a different prompt length (one a batch of 2 with left padding), decode greedily: first one
session after another, then all at once (their steps sent together each round). Logits within 1e-4,
greedy tokens identical; the peer's `swarm_peer_batch_size` histogram shows shared forwards.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from client.inference import peer_session
from swarm.model.head import ModelHead
from swarm.span import Span
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm, client_node

pytestmark = pytest.mark.integration

ALL = Span(0, 6)
MAX_LENGTH, DECODE_STEPS = 40, 10
# (prompt length, batch, left padding of the second row)
SESSIONS = [(2, 1, 0), (4, 1, 0), (6, 2, 2), (9, 1, 0), (13, 1, 0), (17, 1, 0)]


@pytest.fixture(scope="module")
def batching_peer(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("batching"))
    try:
        net.start_bootstrap()
        net.start_peer("batcher", tiny_llama, "--blocks", "0:6", "--metrics-port", "0", *PEER_OPTIONS)
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def url(batching_peer) -> str:
    return batching_peer.metrics_url(batching_peer.procs["batcher"])


@pytest.fixture(scope="module")
def node(batching_peer, loop):
    with client_node(loop, batching_peer.bootstrap_addrs) as node:
        yield node


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of one scrape of `/metrics`."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


class Client:
    """One session's client side: its prompt, its greedy tokens and logits, its padding mask."""

    def __init__(self, head: ModelHead, length: int, batch: int, pad: int, seed: int):
        self.head, self.batch = head, batch
        self.tokens = torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
        self.mask = None
        if pad:
            self.mask = torch.ones(batch, length, dtype=torch.int64)
            self.mask[1, :pad] = 0
        self.logits: list[torch.Tensor] = []
        self.session: peer_session.PeerSession | None = None

    async def open(self, node, peer: str) -> None:
        self.session = await peer_session.PeerSession.open(node, peer, MODEL_ID, ALL, max_length=MAX_LENGTH,
                                                          batch=self.batch)

    async def prefill(self) -> None:
        await self._run(self.tokens, 0)

    async def step(self) -> None:
        position = self.tokens.shape[1]
        nxt = self.logits[-1].argmax(-1, keepdim=True)
        self.tokens = torch.cat([self.tokens, nxt], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones(self.batch, 1, dtype=torch.int64)], dim=1)
        await self._run(nxt, position)

    async def _run(self, ids: torch.Tensor, position: int) -> None:
        out = await self.session.step(self.head.embed(ids, position, self.mask), position, self.mask)
        self.logits.append(self.head.logits(out)[:, -1])


def clients(head: ModelHead) -> list[Client]:
    return [Client(head, length, batch, pad, seed) for seed, (length, batch, pad) in enumerate(SESSIONS)]


def test_concurrent_sessions_equal_sessions_one_after_another(batching_peer, url, node, loop, tiny_llama):
    peer = batching_peer.procs["batcher"].peer_id
    head = ModelHead(tiny_llama)

    async def one_after_another() -> list[Client]:
        done = clients(head)
        for c in done:
            await c.open(node, peer)
            try:
                await c.prefill()
                for _ in range(DECODE_STEPS):
                    await c.step()
            finally:
                await c.session.close()
        return done

    async def all_at_once() -> list[Client]:
        together = clients(head)
        try:
            for c in together:
                await c.open(node, peer)
            await asyncio.gather(*(c.prefill() for c in together))
            for _ in range(DECODE_STEPS):
                await asyncio.gather(*(c.step() for c in together))
        finally:
            for c in together:
                if c.session is not None:
                    await c.session.close()
        return together

    alone = loop.run(one_after_another())
    before = scrape(url)
    together = loop.run(all_at_once())
    after = scrape(url)

    for a, b in zip(alone, together):
        assert torch.equal(a.tokens, b.tokens), "greedy tokens differ when sessions run at once"
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=1e-4, rtol=1e-4)
    steps = len(SESSIONS) * (1 + DECODE_STEPS)
    assert after["swarm_peer_steps_total"] - before["swarm_peer_steps_total"] == steps
    shared = after["swarm_peer_batch_size_count"] - before["swarm_peer_batch_size_count"]
    batched_steps = after["swarm_peer_batch_size_sum"] - before["swarm_peer_batch_size_sum"]
    assert shared >= 1 and batched_steps >= 2 * shared, "no decode steps shared a forward"
    assert batched_steps <= len(SESSIONS) * DECODE_STEPS  # only one-token steps are batched
