"""The SDK through the shared swarm (three peers of a tiny llama): transformers' own `generate` run
through the swarm equals the same model's `generate` run locally by transformers."""

from __future__ import annotations

import time

import pytest
import torch

from client.model import DistributedModelForCausalLM
from swarm.errors import BadRequest
from swarm_harness import IDLE_TIMEOUT, MODEL_ID

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def remote(swarm, tiny_llama):
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, swarm.bootstrap_addrs, model_id=MODEL_ID)
    yield model
    model.close()


PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])


def test_greedy_equals_local(remote, local):
    expected = local.generate(PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=0)
    got = remote.generate(PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert [str(h.span) for h in remote.route()] == ["[0:2)", "[2:4)", "[4:6)"]


def test_seeded_sampling_equals_local(remote, local):
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2,
                  pad_token_id=0)
    torch.manual_seed(7)
    expected = local.generate(PROMPT, **kwargs)
    torch.manual_seed(7)
    got = remote.generate(PROMPT, **kwargs)
    assert got.tolist() == expected.tolist()
    assert got.shape[1] == PROMPT.shape[1] + 20


def test_batch_of_two_with_left_padding(remote, local):
    ids = torch.tensor([[0, 0, 0, 9, 8, 7, 6, 5], [5, 17, 42, 99, 3, 64, 200, 11]])
    mask = (ids != 0).long()
    expected = local.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = remote.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.tolist() == expected.tolist()


def test_stateless_forward_matches_local_logits(remote, local):
    with torch.inference_mode():
        expected = local(PROMPT).logits
    got = remote(PROMPT).logits
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_session_steps_and_rollback(remote, local):
    with torch.inference_mode():
        expected = local(PROMPT).logits
    with remote.inference_session(max_length=32) as session:
        first = session.step(PROMPT[:, :5])
        second = session.step(PROMPT[:, 5:])
        assert torch.allclose(torch.cat([first, second], 1), expected, atol=1e-4)
        # a different continuation after the first 6 tokens rolls the peers' caches back
        other = torch.cat([PROMPT[:, :6], torch.tensor([[1, 2]])], 1)
        with torch.inference_mode():
            expected_other = local(other).logits[:, 6:]
        assert torch.allclose(session.feed(other), expected_other, atol=1e-4)
        assert session.position == 8
        # generate inside the session continues it
        out = remote.generate(other, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape[1] == 12 and session.position == 11
        with pytest.raises(BadRequest):
            session.step(torch.zeros(1, 30, dtype=torch.long))  # beyond max_length


def test_a_session_reclaimed_while_idle_is_reopened_on_the_same_peers(remote, local):
    """Peers reclaim a silent session's cache after IDLE_TIMEOUT; the next step reopens it on the same
    peers, replays, and bans nobody (a chat that pauses must not lose its peers)."""
    with torch.inference_mode():
        expected = local(PROMPT).logits
    client = remote.connection.client
    with remote.inference_session(max_length=32) as session:
        first = session.step(PROMPT[:, :6])
        route = [str(h) for h in session.route]
        time.sleep(IDLE_TIMEOUT + 1.5)
        second = session.step(PROMPT[:, 6:])
        assert torch.allclose(torch.cat([first, second], 1), expected, atol=1e-4)
        assert [str(h) for h in session.route] == route and session.failovers == []
    assert not any(client.bans.banned(h.peer) for h in remote.route())


def test_a_banned_peer_that_answers_a_ping_is_used_when_there_is_no_other_route(remote):
    """The only peer of some blocks, banned after a lost connection (a dial can fail once), is pinged and
    forgiven rather than ending the generation; a peer banned for a protocol error is not."""
    from swarm.errors import NoRoute

    client = remote.connection.client
    only = next(h.peer for h in remote.route() if h.span.start == 2)
    try:
        client.ban(only, "connection_lost")
        assert only in [h.peer for h in remote.connection.run(client.route())]
        assert not client.bans.banned(only)
        client.ban(only, "protocol")
        with pytest.raises(NoRoute, match="blocks \\[2:4\\)"):
            remote.connection.run(client.route())
    finally:
        client.bans.lift(only)
