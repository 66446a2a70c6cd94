"""A server-side generation with checked outputs (`client.generation.Generation.run`): it gives out only text
made from verified outputs, and when the session rewinds (a lying hop caught and replaced) it goes on from the
first wrong position, so what a user receives is the honest generation, whatever the lie and whenever it is
found. Driven by a scripted session (no network): the model is a fixed next-token function."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from leased import Given
from client.generation import Generation, Sampling
from swarm.errors import Rewound
from test_generation import byte_tokenizer

pytestmark = pytest.mark.unit

VOCAB = 256
PROMPT = [40, 69, 76, 76, 79]


def honest_next(token: int) -> int:
    return 65 + (token * 7 + 3) % 26


class Head:
    vocab_size = VOCAB

    def embed(self, ids: torch.Tensor, position: int, mask=None) -> torch.Tensor:
        return ids.float()[..., None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(hidden[..., 0].long(), VOCAB).float()


class ScriptedSession:
    """The model through a route whose hop lies from `lie_at` on (its outputs are one letter off), until a check
    finds it after the step that made position `found_after`; checks lag `lag` positions behind."""

    unchecked: list = []  # every hop had a checker

    def __init__(self, lie_at: int, found_after: int, lag: int):
        self.lie_at, self.found_after, self.lag = lie_at, found_after, lag
        self.length, self.caught, self.failovers, self.waiting = 0, False, [], None
        self.rewinds = 0

    @property
    def verified_length(self) -> int:
        honest_upto = self.length if self.caught else min(self.length, self.lie_at)
        return max(0, min(honest_upto, self.length - self.lag))

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        self._rewind_if_found(position)
        tokens = hidden[..., 0].long()
        out = tokens.clone()
        for i in range(tokens.shape[1]):
            wrong = not self.caught and position + i >= self.lie_at
            out[:, i] = torch.tensor([honest_next(int(t)) + (1 if wrong else 0) for t in tokens[:, i]])
        self.length = position + tokens.shape[1]
        return out.float()[..., None]

    async def verify(self) -> None:
        if not self.caught and self.length > self.lie_at:
            self.found_after = min(self.found_after, self.length - 1)
        self._rewind_if_found(self.length)
        self.lag = 0

    def _rewind_if_found(self, position: int) -> None:
        if not self.caught and self.length - 1 >= self.found_after and self.length > self.lie_at:
            self.caught, self.rewinds = True, self.rewinds + 1
            self.length = min(self.length, self.lie_at)
            if position > self.length:
                raise Rewound("caught", self.length)

    async def close(self) -> None:
        pass


def run(lie_at: int, found_after: int, lag: int, max_tokens: int = 12,
        **sampling) -> tuple[str, list[str], ScriptedSession]:
    tokenizer = byte_tokenizer(eos_token="<eos>")
    session = ScriptedSession(lie_at, found_after, lag)
    with ThreadPoolExecutor(1) as pool:
        gen = Generation(None, Head(), tokenizer, pool, PROMPT,
                         Sampling(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}), [],
                         sessions=Given(session))

        async def collect():
            out = []
            async for deltas in gen.run():
                out.append("".join(d.text for d in deltas))
            return out

        pieces = asyncio.run(asyncio.wait_for(collect(), 30))
    return "".join(pieces), pieces, session


def honest_text(max_tokens: int = 12) -> str:
    tokens, last = [], PROMPT[-1]
    for _ in range(max_tokens):
        last = honest_next(last)
        tokens.append(last)
    return byte_tokenizer(eos_token="<eos>").decode(tokens)


@pytest.mark.parametrize("lie_at, found_after, lag", [
    (len(PROMPT) + 3, len(PROMPT) + 6, 4),  # caught a few steps after the first lie
    (2, len(PROMPT) + 2, 3),  # a lie inside the prompt: every token is made again
    (len(PROMPT) + 5, 10**6, 2),  # never found by a background check: the final check finds it
    (10**6, 10**6, 3),  # no lie
])
def test_users_receive_the_honest_text_whenever_a_lie_is_found(lie_at, found_after, lag):
    text, pieces, session = run(lie_at, found_after, lag)
    assert text == honest_text()
    assert session.rewinds == (1 if lie_at < 10**6 else 0)


def test_text_goes_out_only_as_far_as_it_is_verified():
    _, pieces, _ = run(10**6, 10**6, lag=3)
    # the first piece waits for the lag; the last carries what was held back until the final check
    assert len(pieces) < 12 and pieces[-1] and len("".join(pieces)) == 12


@pytest.mark.parametrize("lie_at, found_after, lag", [
    (len(PROMPT) + 9, len(PROMPT) + 14, 4),
    (2, len(PROMPT) + 2, 3),
])
def test_a_rewind_inside_a_drafted_step_restores_the_sampler_of_that_token(lie_at, found_after, lag):
    """Sampled (a seeded generator, a repetition penalty) with drafts: a rewind to the middle of a step that kept
    several drafted tokens goes on with the sampler as it was after the token rewound to, so the text is that of
    the same request on an honest route without drafts."""
    sampling = dict(temperature=0.15, seed=5, repetition_penalty=1.02)  # the model's token 3 times in 4
    want, _, _ = run(10**6, 10**6, 0, max_tokens=40, speculate=0, **sampling)
    text, _, session = run(lie_at, found_after, lag, max_tokens=40, speculate=8, **sampling)
    assert text == want and len(want) == 40
    assert session.rewinds == 1
