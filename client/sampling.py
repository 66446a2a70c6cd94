"""Choosing tokens from logits, for servers: sampling parameters, the sampler, and log-probabilities.

The sampler is transformers' own logits processors and warpers, in the order `generate()` applies them,
after a structured-output grammar's mask (`client.grammar`: what the grammar forbids cannot be chosen):
repetition penalty (over the prompt and the tokens generated so far), OpenAI's presence and frequency
penalties (over the tokens generated so far: a processor of ours, as transformers has none), then, when
sampling, temperature, top-k, top-p and min-p. Temperature 0 (below `MIN_TEMPERATURE`) is greedy: the
argmax of the penalized logits, the token transformers' greedy search picks. Each choice draws from a
torch generator of its own, seeded `seed + index`, so a seeded request is reproducible.

Log-probabilities are the model's own: the log-softmax of the raw logits, before any penalty or warper
(what a user scoring text expects, and what transformers' `log_softmax` of the same logits gives).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from swarm.errors import SwarmError

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (dividing by it would overflow)
LOGPROB_CHUNK = 256  # positions whose logits are computed at once when scoring a prompt


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely
    prompt_logprobs: bool = False  # also score the prompt's tokens (completions' `echo` with `logprobs`)
    grammar: Any = None  # a `client.grammar.Grammar` every choice must follow (structured output), or None
    speculate: int = 0  # tokens a generation of one choice may draft per step (`client.drafts`); 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the most likely tokens at its position with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties: `frequency x count + presence x (count > 0)` off each token's logit, counting the
    tokens each row generated so far (`counts` [rows, vocab], kept by the sampler)."""

    def __init__(self, presence: float, frequency: float, counts: torch.Tensor):
        self.presence, self.frequency, self.counts = presence, frequency, counts

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores - self.frequency * self.counts - self.presence * (self.counts > 0).to(scores.dtype)


class Sampler:
    """Chooses the next token of each choice from its logits (see the module docstring). `prompt`: the
    tokens before the first choice (the repetition penalty counts them)."""

    def __init__(self, sampling: Sampling, vocab_size: int, prompt: list[int] | tuple[int, ...] = ()):
        s = self.sampling = sampling
        seed = s.seed if s.seed is not None else secrets.randbits(62)
        self.generators = [torch.Generator().manual_seed((seed + i) % 2**63) for i in range(s.n)]
        self.history = [list(prompt) for _ in range(s.n)] if s.repetition_penalty != 1.0 else None
        self.counts = torch.zeros(s.n, vocab_size) if (s.presence_penalty or s.frequency_penalty) else None
        self.processors = LogitsProcessorList()
        if self.history is not None:
            self.processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if self.counts is not None:
            self.penalty = PresenceFrequencyPenalty(s.presence_penalty, s.frequency_penalty, self.counts)
            self.processors.append(self.penalty)
        self.constraint = None
        if s.grammar is not None:
            from client.grammar import Constraint

            self.constraint = Constraint(s.grammar, s.n)
        self.warpers = LogitsProcessorList()
        if not s.greedy:
            if s.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k > 0:
                self.warpers.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(s.top_p))
            if s.min_p > 0.0:
                self.warpers.append(MinPLogitsWarper(s.min_p))

    def _input_ids(self, rows: int) -> torch.Tensor:
        """Each row's history as one tensor, shorter rows padded with their own first token (a token the
        row has seen already, so the set of tokens penalized is unchanged)."""
        if self.history is None:
            return torch.zeros(rows, 0, dtype=torch.int64)
        longest = max(len(h) for h in self.history)
        return torch.tensor([h + [h[0]] * (longest - len(h)) if h else [0] * longest for h in self.history],
                            dtype=torch.int64)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor) -> list[int]:
        """`logits` [n, vocab] -> one token per choice."""
        logits = logits.float()
        if not torch.isfinite(logits).all():
            raise SwarmError("the swarm returned non-finite activations (a faulty peer, or an overflow in "
                             "a half-precision peer)")
        if self.constraint is not None:  # what the grammar forbids is -inf from here on
            logits = self.constraint.mask(logits)
        ids = self._input_ids(len(logits))
        scores = self.processors(ids, logits)
        if self.sampling.greedy:
            tokens = scores.argmax(-1)
        else:
            probs = torch.softmax(self.warpers(ids, scores), dim=-1)
            tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0]
                                  for i, g in enumerate(self.generators)])
        self.chose(tokens.tolist())
        return tokens.tolist()

    def chose(self, tokens: list[int]) -> None:
        if self.constraint is not None:
            self.constraint.advance(tokens)
        if self.counts is not None:
            self.counts[torch.arange(len(tokens)), torch.tensor(tokens)] += 1
        if self.history is not None:
            for h, t in zip(self.history, tokens):
                h.append(t)

    def state(self) -> tuple:
        return ([g.get_state() for g in self.generators],
                None if self.counts is None else self.counts.clone(),
                None if self.history is None else [list(h) for h in self.history],
                None if self.constraint is None else self.constraint.state())

    def restore(self, state: tuple) -> None:
        generators, counts, history, constraint = state
        if constraint is not None:
            self.constraint.restore(constraint)
        for g, saved in zip(self.generators, generators):
            g.set_state(saved)
        if counts is not None:
            self.counts.copy_(counts)  # in place: the penalty processor holds this tensor
        self.history = None if history is None else [list(h) for h in history]


@torch.inference_mode()
def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """The log-probability of each of `tokens` [rows] under `logits` [rows, vocab], with the `k` most likely
    tokens of each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None].to(logp.device))[:, 0].tolist()
    if k > 0:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops)]


def score(logits_of, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of `targets` [t] given the last layer's hidden states `hidden` [t, hidden] (position
    i predicts `targets[i]`), computed `LOGPROB_CHUNK` positions at a time so a long prompt's logits never
    exist all at once. `logits_of`: the head's logits function."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), LOGPROB_CHUNK):
        chunk = hidden[start:start + LOGPROB_CHUNK]
        out += logprobs_of(logits_of(chunk[None])[0], torch.tensor(targets[start:start + LOGPROB_CHUNK]), k)
    return out
