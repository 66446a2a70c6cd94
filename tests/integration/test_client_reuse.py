"""The SDK keeps a `generate()`'s session for the next call (`reuse_sessions`), through the shared swarm (three
peers of a tiny llama): a chat turn that passes the whole conversation sends the peers only its new tokens, and
gives the tokens of a fresh session and of transformers run locally."""

from __future__ import annotations

import time

import pytest
import torch

from client.inference.session import InferenceSession
from client.model import DistributedModelForCausalLM
from swarm_harness import IDLE_TIMEOUT, MODEL_ID

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
USER = torch.tensor([[7, 8, 9, 10, 12]])  # the next turn's new tokens
GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def remote(swarm, tiny_llama):
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, swarm.bootstrap_addrs, model_id=MODEL_ID)
    yield model
    model.close()


@pytest.fixture
def steps(monkeypatch):
    """Every step the client sends the swarm, as (session, position, tokens)."""
    sent: list[tuple[InferenceSession, int, int]] = []
    step = InferenceSession.step

    async def spy(self, hidden, position=None, attention_mask=None):
        sent.append((self, self.length if position is None else position, hidden.shape[1]))
        return await step(self, hidden, position, attention_mask)

    monkeypatch.setattr(InferenceSession, "step", spy)
    return sent


def next_turn(out: torch.Tensor) -> torch.Tensor:
    return torch.cat([out, USER], 1)


def test_a_chat_turn_sends_only_its_new_tokens(remote, local, steps, monkeypatch):
    first = remote.generate(PROMPT, **GREEDY)
    kept = remote.kept_session
    assert kept is not None and kept.session.max_length == PROMPT.shape[1] + GREEDY["max_new_tokens"]
    turn = next_turn(first)
    steps.clear()
    got = remote.generate(turn, **GREEDY)
    assert got.tolist() == local.generate(turn, **GREEDY).tolist()
    # the turn needs more room than the kept session has: the peers copied it into a longer one
    longer = remote.kept_session
    assert longer is not kept and kept.session.closed and longer.session.max_length == turn.shape[1] + 10
    held = first.shape[1] - 1  # the session ran every token but the last one generated
    assert steps[0] == (longer.session, held, turn.shape[1] - held)  # the first step: the new part, where it starts
    assert all(session is longer.session for session, _, _ in steps)
    assert sum(tokens for _, _, tokens in steps) == turn.shape[1] - held + got.shape[1] - turn.shape[1] - 1
    assert remote.last_reused_tokens == held
    kept = longer
    # without reuse: a session of its own, the same tokens; the kept one is closed
    monkeypatch.setattr(remote, "reuse_sessions", False)
    steps.clear()
    assert remote.generate(turn, **GREEDY).tolist() == got.tolist()
    assert steps[0][1:] == (0, turn.shape[1]) and steps[0][0] is not kept.session
    assert kept.session.closed and remote.kept_session is None and remote.last_reused_tokens == 0


def test_another_conversation_or_batch_size_opens_a_new_session(remote, local, steps):
    remote.generate(PROMPT, **GREEDY)
    kept = remote.kept_session
    other = torch.tensor([[6, 17, 42, 99, 3]])  # nothing in common from the first token
    assert remote.generate(other, **GREEDY).tolist() == local.generate(other, **GREEDY).tolist()
    assert kept.session.closed and remote.kept_session is not kept and remote.last_reused_tokens == 0
    # a batch (left padded) asks for the length it needs, and a second call with the same rows goes on in it
    ids = torch.tensor([[0, 0, 0, 9, 8, 7, 6, 5], [5, 17, 42, 99, 3, 64, 200, 11]])
    mask = (ids != 0).long()
    want = local.generate(ids, attention_mask=mask, **GREEDY).tolist()
    single = remote.kept_session
    assert remote.generate(ids, attention_mask=mask, **GREEDY).tolist() == want
    batch = remote.kept_session
    assert single.session.closed and batch.session.max_length == ids.shape[1] + GREEDY["max_new_tokens"]
    steps.clear()
    assert remote.generate(ids, attention_mask=mask, **GREEDY).tolist() == want
    assert remote.kept_session is batch and steps[0][1] == ids.shape[1] - 1
    # one sequence again: a new session
    assert remote.generate(PROMPT, **GREEDY).tolist() == local.generate(PROMPT, **GREEDY).tolist()
    assert batch.session.closed and remote.kept_session.session.max_length == PROMPT.shape[1] + 10


def test_drafts_the_kept_session_holds_already_are_computed_again(remote, local, steps):
    """The same prompt twice with an assistant model: its drafts are the answer the session holds from the first
    call, and transformers wants their logits (a pass verifies them) though nothing is new to the session."""
    want = local.generate(PROMPT, **GREEDY).tolist()
    assert remote.generate(PROMPT, assistant_model=local, **GREEDY).tolist() == want
    steps.clear()
    assert remote.generate(PROMPT, assistant_model=local, **GREEDY).tolist() == want
    assert remote.last_reused_tokens == PROMPT.shape[1] - 1 and steps[0][1] == PROMPT.shape[1] - 1


def test_an_explicit_session_closes_the_kept_one(remote, local):
    remote.generate(PROMPT, **GREEDY)
    kept = remote.kept_session
    with remote.inference_session(max_length=64) as session:
        assert kept.session.closed and remote.kept_session is None
        out = remote.generate(PROMPT, **GREEDY)
        assert session.position == out.shape[1] - 1 and remote.kept_session is None
    remote.generate(PROMPT, **GREEDY)
    kept = remote.kept_session
    remote.close_session()
    assert kept.session.closed and remote.kept_session is None


def test_a_kept_session_reclaimed_while_idle_is_reopened_and_replayed(remote, local, steps):
    """Peers reclaim a silent session after IDLE_TIMEOUT (a user reading the answer); the next turn reopens it
    on the same peers, replays what it held, and gives the same tokens."""
    client = remote.connection.client
    first = remote.generate(PROMPT, **GREEDY)
    kept = remote.kept_session
    route = [str(h) for h in kept.route]
    time.sleep(IDLE_TIMEOUT + 1.5)
    steps.clear()  # the same prompt again (a retry): it fits the kept session, reclaimed at every peer by now
    assert remote.generate(PROMPT, **GREEDY).tolist() == first.tolist()
    assert remote.kept_session is kept and steps[0][1] == PROMPT.shape[1] - 1
    assert [str(h) for h in kept.route] == route and kept.failovers == []
    assert not any(client.bans.banned(h.peer) for h in kept.route)
