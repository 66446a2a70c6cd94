"""Speculative decoding on the server without a swarm: prompt lookup's drafts and their adaptation, and a
generation that drafts gives the same tokens as one that does not, in fewer steps when the text repeats.
The model is a fixed next-token function behind a scripted session (`test_checked_generation`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client.drafts import MISSES_BEFORE_PAUSE, PAUSE_STEPS, PromptLookup
from leased import Given
from client.generation import Generation, Sampling
from test_checked_generation import PROMPT, Head, honest_next
from test_generation import byte_tokenizer

pytestmark = pytest.mark.unit


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(max_tokens=8)
    assert lookup.propose([1, 2, 3, 4, 5, 9, 2, 3], limit=8) == [4, 5, 9, 2]  # "2 3" seen before: what followed
    assert lookup.propose([1, 2, 3, 7, 2, 3, 8, 2, 3], limit=8) == [8, 2, 3]  # the most recent match wins
    assert lookup.propose([1, 2, 3, 4], limit=8) == []  # nothing repeats
    assert lookup.propose([1, 2, 3, 1, 2], limit=1) == [3]  # never more than the limit
    assert lookup.propose([5, 6, 7, 5], limit=8) == []  # one repeated token is no match
    assert lookup.propose([5], limit=8) == []


def test_the_draft_length_adapts_and_drafting_pauses_after_misses():
    lookup = PromptLookup(max_tokens=16)
    assert lookup.k == 4
    lookup.accepted(4, 4)
    assert lookup.k == 6
    lookup.accepted(6, 2)
    assert lookup.k == 5
    assert PromptLookup(max_tokens=3).k == 3
    for _ in range(MISSES_BEFORE_PAUSE):
        lookup.accepted(5, 0)
    assert all(lookup.propose([1, 2, 3, 1, 2], limit=8) == [] for _ in range(PAUSE_STEPS))
    assert lookup.propose([1, 2, 3, 1, 2], limit=8) != []


class CountingSession:
    """The fixed model through one honest hop; counts steps and positions stepped."""

    unchecked: list = []  # every hop had a checker

    def __init__(self):
        self.length, self.steps, self.failovers, self.waiting = 0, 0, [], None

    @property
    def verified_length(self) -> int:
        return self.length

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        assert position <= self.length  # a rollback, or the end of what it holds
        self.steps += 1
        tokens = hidden[..., 0].long()
        self.length = position + tokens.shape[1]
        return torch.tensor([[honest_next(int(t)) for t in row] for row in tokens]).float()[..., None]

    async def verify(self) -> None:
        pass

    async def close(self) -> None:
        pass


def run(speculate: int, max_tokens: int = 40, **sampling) -> tuple[str, int]:
    session = CountingSession()
    with ThreadPoolExecutor(1) as pool:
        gen = Generation(None, Head(), byte_tokenizer(eos_token="<eos>"), pool, PROMPT,
                         Sampling(max_tokens=max_tokens, speculate=speculate, logprobs=1,
                                  **{"temperature": 0.0, **sampling}), [], sessions=Given(session))

        async def collect():
            return [d for deltas in [x async for x in gen.run()] for d in deltas]

        deltas = asyncio.run(asyncio.wait_for(collect(), 30))
    assert sum(len(d.logprobs) for d in deltas) == max_tokens  # each token's log-probability, drafted or not
    return "".join(d.text for d in deltas), session.steps


def test_drafting_gives_the_same_tokens_in_fewer_steps():
    plain, plain_steps = run(speculate=0)
    drafted, drafted_steps = run(speculate=8)
    assert drafted == plain and len(plain) == 40
    assert plain_steps == 40  # the prompt, then one step per token after the first
    assert drafted_steps < plain_steps / 2  # the output cycles: prompt lookup drafts it


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.1, seed=3),  # the model's token 98.9% of the time: some drafts are rejected
    dict(temperature=0.1, seed=4, top_p=0.9, repetition_penalty=1.02, frequency_penalty=0.01),
])
def test_sampled_drafting_gives_the_same_tokens_as_sampling_without_drafts(sampling):
    """The sampler chooses at each drafted position as it would one step at a time (same generator state,
    same penalties): a seeded request gives the same text with drafts, in fewer steps."""
    plain, plain_steps = run(0, max_tokens=60, **sampling)
    drafted, drafted_steps = run(8, max_tokens=60, **sampling)
    assert drafted == plain and len(plain) >= 50
    assert drafted_steps < plain_steps * 3 / 4, (drafted_steps, plain_steps)
