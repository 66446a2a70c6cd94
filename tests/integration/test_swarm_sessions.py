"""Peers started with no --blocks cover the model; a raw session through them (head -> peers -> head,
driven here) matches transformers run locally; chunked transfer, rollback and the stateless forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.inference import peer_session
from swarm.net import discovery, wire
from swarm.model.blocks import SpanBlocks
from swarm.model.head import ModelHead
from swarm.span import Span

pytestmark = pytest.mark.integration
from swarm_harness import MODEL_ID as MODEL


@pytest.fixture(scope="module")
def route(swarm, client, loop):
    """(peer id, span) for each peer, ordered by span, read from the peers themselves."""
    infos = [loop.run(peer_session.info(client, p.peer_id)) for p in swarm.procs.values() if p.name.startswith("peer")]
    return sorted(((i.peer, Span(i.start, i.end)) for i in infos), key=lambda r: r[1].start)


def test_peers_without_blocks_cover_every_block_once(route, client, loop):
    spans = [span for _, span in route]
    assert spans == [Span(0, 2), Span(2, 4), Span(4, 6)]
    anns = loop.run(discovery.announcements(client, MODEL, 6))
    for block in range(6):
        online = {a.peer for a in anns[block] if a.state == "online"}
        owner = next(peer for peer, span in route if span.start <= block < span.end)
        assert online == {owner}, f"block {block} announced by {online}: {anns}"


def test_raw_session_matches_local_transformers(route, client, loop, tiny_llama):
    torch.manual_seed(0)
    head = ModelHead(tiny_llama)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = torch.randint(3, 256, (1, 11))

    async def run() -> tuple[list[torch.Tensor], list[int]]:
        sessions = [await peer_session.PeerSession.open(client, peer, MODEL, span, max_length=64)
                    for peer, span in route]
        try:
            async def through(hidden: torch.Tensor, position: int) -> torch.Tensor:
                for s in sessions:
                    hidden = await s.step(hidden, position)
                return hidden

            logits, ids = [], prompt
            for start in range(0, 11, 4):  # prefill in chunks of 4 tokens
                out = await through(head.embed(prompt[:, start:start + 4], start), start)
            logits.append(head.logits(out)[:, -1])
            for pos in range(11, 19):  # greedy decode
                ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], dim=1)
                logits.append(head.logits(await through(head.embed(ids[:, -1:], pos), pos))[:, -1])
            # roll back: replace the last 5 generated tokens with other ones, from position 14
            alt = torch.tensor([[7, 8, 9]])
            out = await through(head.embed(alt, 14), 14)
            return logits, ids[0].tolist(), head.logits(out)
        finally:
            for s in sessions:
                await s.close()

    logits, ids, alt_logits = loop.run(run())
    with torch.no_grad():
        full = reference(torch.tensor([ids])).logits
        alt_ref = reference(torch.cat([torch.tensor([ids[:14]]), torch.tensor([[7, 8, 9]])], dim=1)).logits
    assert len(ids) == 19
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, full[:, 10 + i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alt_logits, alt_ref[:, 14:17], atol=1e-4, rtol=1e-4)


def test_prefill_larger_than_the_message_cap_is_chunked(route, client, loop, tiny_llama):
    peer, span = route[1]
    hidden = torch.randn(8, 2100, 64)  # 4.3 MB: two data frames each way
    assert hidden.numel() * 4 > wire.MAX_FRAME_BYTES
    out = loop.run(peer_session.forward(client, peer, MODEL, span, hidden))
    local = SpanBlocks(tiny_llama, span)
    torch.testing.assert_close(out, local(hidden), atol=1e-4, rtol=1e-4)


def test_forward_of_a_sub_span_and_a_padded_batch(route, client, loop, tiny_llama):
    peer, span = route[2]
    sub = Span(span.start + 1, span.end)
    hidden = torch.randn(2, 6, 64)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, :2] = 0  # left padding
    out = loop.run(peer_session.forward(client, peer, MODEL, sub, hidden, mask))
    local = SpanBlocks(tiny_llama, span)
    torch.testing.assert_close(out, local(hidden, attention_mask=mask, span=sub), atol=1e-4, rtol=1e-4)
