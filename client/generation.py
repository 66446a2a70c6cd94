"""Async text generation over the swarm, for servers: one `Generation` per request, many at once.

The SDK's `generate()` is synchronous and runs one session per model object; a server instead needs
many generations on one event loop, each cancellable at any await (a client that disconnects). So
this module drives an `InferenceSession` directly: the prompt is one step, then one token per step.
The head (embeddings, LM head) and sampling run in a thread pool, so the event loop keeps serving.

Tokens are chosen by `client.sampling.Sampler` (transformers' logits processors); when asked, each
token's log-probability comes with it (`Sampling.logprobs`), and the prompt's own tokens are scored from
the prompt step's outputs (`Sampling.prompt_logprobs`). `max_tokens` 0 only scores the prompt.

Text and stop strings: text is decoded incrementally, the way streaming servers do it: each new token
is decoded together with the few tokens before it (the prompt's last tokens at first), and only what
that adds to their own decoding is new text. So tokenizers whose decoders strip a leading space or
spell a character over several byte tokens give the same text as decoding everything at once, and
an incomplete character waits for its last byte. Text that could still become a stop string is held
back until it is known; a stop string ends the choice and is not part of its text. Special tokens are
skipped.

Sessions come from a lease (`client.leases`): a new session by default; the gateway's prompt reuse
(`client.api.reuse`) may instead lease one that already holds the first tokens of the prompt (`Lease.cached`):
only the rest is sent, at its position, and the tokens chosen are the same, since every peer computes the same
function of the same tokens. A generation marks when its prompt has run (`Lease.prefilled`) and, when it ends
well, what its session holds (`Lease.tokens`); what becomes of the session is the lease's source's business.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from client.drafts import PromptLookup
from client.head_queue import HeadQueue
from client.leases import NewSessions
from client.sampling import Sampler, Sampling, TokenLogprob, logprobs_of, score
from client.inference.routing import Hop
from client.inference.session import Failover, InferenceSession
from client.inference.swarm_client import SwarmClient
from swarm.errors import Rewound, SwarmError
from swarm.model.head import ModelHead

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """New text of one choice; `finish_reason` ('stop' or 'length') on its last delta."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this delta adds, when log-probabilities were asked for


CONTEXT_TOKENS = 6  # tokens decoded before a new one, so that its text is decoded in context
MAX_REWINDS = 8  # wrong outputs found in one generation before it gives up


@dataclass
class Choice:
    index: int
    ids: list[int] = field(default_factory=list)  # generated tokens, an end token included
    context: list[int] = field(default_factory=list)  # the prompt's last tokens, then the generated ones
    prefix_offset: int = 0  # context[prefix_offset:read_offset] is text already decoded
    read_offset: int = 0
    decoded: str = ""  # all text decoded so far
    text: str = ""  # the text given out so far (all of it once finished)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `ids`, when asked for


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Tokens that end a generation: the end-of-sequence tokens of the tokenizer and the generation
    config, and the end-of-turn markers of common chat templates."""
    eos = getattr(generation_config, "eos_token_id", None)
    ids = {v for v in (tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])) if isinstance(v, int)}
    for marker in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        value = tokenizer.convert_tokens_to_ids(marker)
        # a marker the vocabulary lacks reads as the unknown token; a declared end of text may be that token
        if isinstance(value, int) and value != tokenizer.unk_token_id:
            ids.add(value)
    return sorted(ids)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may still turn out to start a stop string (or are an
    incomplete character)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class Generation:
    """One request's generation: `async for deltas in gen.run(): ...` (one list per token, maybe empty);
    afterwards the token counts, each choice's text and finish reason, and the session's `failovers`.
    Cancelling the task that runs it closes its peer sessions."""

    def __init__(self, client: SwarmClient, head: ModelHead, tokenizer, executor: Executor, prompt: list[int],
                 sampling: Sampling, end_tokens: list[int], *, sessions=None, heads: HeadQueue | None = None):
        self.client, self.head, self.tokenizer, self.executor = client, head, tokenizer, executor
        # the head's logits, computed together with the other generations' that are ready (`client.head_queue`)
        self.heads = heads if heads is not None else HeadQueue(head, executor)
        # where its session comes from and goes (`client.leases`: `lease(prompt, max_length)`)
        self.sessions = sessions if sessions is not None else NewSessions(client)
        self.prompt, self.sampling, self.end_tokens = prompt, sampling, set(end_tokens)
        context = prompt[-CONTEXT_TOKENS:]
        self.choices = [Choice(i, context=list(context), read_offset=len(context)) for i in range(sampling.n)]
        self.longest_stop = max((len(stop) for stop in sampling.stop), default=0)
        self.failovers: list[Failover] = []
        self.first_token_s: float | None = None
        self.closing: asyncio.Task | None = None  # the session's close (if not kept), which outlives `run`
        self.released = 0  # tokens whose deltas were given out
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when `sampling.prompt_logprobs`
        self.drafted = self.accepted = 0  # tokens drafted by prompt lookup, and those the model kept
        self.session: InferenceSession | None = None
        self.unchecked: list[Hop] = []  # hops of its route no other peer could check (`InferenceSession.unchecked`)
        self.cached = 0  # prompt tokens its session held when it began (reused), not sent again
        self.reuse = ""  # how: "kept" (a finished request's session), "fork" (a copy of a session's prefix) or ""
        self.made: list[list[int]] = []  # each step's tokens, one per choice

    @property
    def waiting(self) -> str | None:
        """While a step waits for blocks to be served again, what it waits for; else None."""
        return None if self.session is None else self.session.waiting

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices)

    async def _in_pool(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run(self) -> AsyncIterator[list[Delta]]:
        """Deltas as they are verified (`InferenceSession.verified_length`): a token's text goes out once the
        outputs it was made from were checked, so a lying peer caught later changes nothing already sent (the
        session rewinds, and the tokens after the wrong position are made again)."""
        lease = None
        try:
            async with self.sessions.lease(self.prompt, len(self.prompt) + max(self.sampling.max_tokens, 1)) as lease:
                self.session, self.cached, self.reuse = lease.session, lease.cached, lease.how
                async for deltas in self._run(lease):
                    yield deltas
        finally:
            self.closing = None if lease is None else lease.closing

    async def _run(self, lease) -> AsyncIterator[list[Delta]]:
        s, prompt = self.sampling, len(self.prompt)
        started = time.perf_counter()
        sampler = Sampler(s, self.head.vocab_size, self.prompt)
        session = self.session
        earlier = len(session.failovers)  # a kept session's, from the requests before
        made = self.made
        saved = [self._save(sampler)]  # the state after 0, 1, ... tokens
        pending: list[list[Delta]] = []  # deltas of tokens made but not given out yet
        position = self.cached
        ids = torch.tensor([self.prompt[position:]] * s.n, dtype=torch.int64)
        drafter = PromptLookup(s.speculate) if self._can_speculate() else None
        try:
            for _ in range(MAX_REWINDS + 1):
                try:
                    if s.max_tokens == 0:  # score the prompt only
                        if s.prompt_logprobs and position < prompt:
                            hidden = await self._in_pool(self.head.embed, ids, position)
                            out = await session.step(hidden, position)
                            self._note_unchecked(session)
                            await self._in_pool(self._score_prompt, out, position)
                        await session.verify()
                        for c in self.choices:
                            c.finish_reason = "length"
                        yield [Delta(c.index, "", "length") for c in self.choices]
                        return
                    while len(made) < s.max_tokens and not all(c.finish_reason for c in self.choices):
                        drafts = [] if drafter is None or position < prompt else drafter.propose(
                            self.prompt + [t for (t,) in made], s.max_tokens - len(made) - 1)
                        feed = torch.cat([ids, torch.tensor([drafts], dtype=torch.int64)], 1) if drafts else ids
                        hidden = await self._in_pool(self.head.embed, feed, position)
                        out = await session.step(hidden, position)
                        self._note_unchecked(session)
                        if session.length >= prompt:
                            lease.prefilled.set()  # forks of its prompt may begin
                        if s.prompt_logprobs and position < prompt:
                            await self._in_pool(self._score_prompt, out, position)
                        if drafts:  # the token chosen at each fed position, up to the first draft it differs from
                            logits = await self.heads.logits(out[0])
                            step = await self._in_pool(self._checked_drafts, sampler, logits, drafts)
                            drafter.accepted(len(drafts), len(step) - 1)
                            self.drafted, self.accepted = self.drafted + len(drafts), self.accepted + len(step) - 1
                        else:
                            logits = await self.heads.logits(out[:, -1])
                            step = [await self._in_pool(self._choose, sampler, logits)]
                        for tokens, logprobs, state in step:
                            if len(made) == s.max_tokens or all(c.finish_reason for c in self.choices):
                                break
                            made.append(tokens)
                            pending.append(self._advance(tokens, last=len(made) == s.max_tokens, logprobs=logprobs))
                            saved.append(([_copy(c) for c in self.choices], state))
                        position, ids = prompt + len(made) - 1, torch.tensor(made[-1], dtype=torch.int64)[:, None]
                        if out_now := self._release(pending, len(made), session.verified_length - prompt + 1):
                            self.first_token_s = self.first_token_s or time.perf_counter() - started
                            saved[:self.released] = [None] * self.released  # never rewound to: released
                            yield out_now
                    await session.verify()  # everything, before the last deltas go out
                    self._note_unchecked(session)
                    if s.n == 1:  # what its caches hold, for the lease's next request (the last token never ran)
                        held = min(session.length, prompt + max(len(made) - 1, 0))
                        lease.tokens = (self.prompt + [t for (t,) in made])[:held]
                    yield self._release(pending, len(made), len(made))
                    return
                except Rewound as e:
                    keep = max(0, e.position - prompt + 1)  # tokens made from outputs before the wrong one
                    if keep < self.released:  # given out as unchecked (no checker then), found wrong since
                        raise SwarmError(f"{e}; tokens already given out were made from it (their blocks had no "
                                         "other peer to check them then)") from None
                    del made[keep:], saved[keep + 1:], pending[keep - self.released:]
                    self._restore(sampler, saved[keep])
                    position = e.position
                    ids = (torch.tensor([self.prompt[position:]] * s.n, dtype=torch.int64) if position < prompt
                           else torch.tensor(made[-1], dtype=torch.int64)[:, None])
            raise SwarmError(f"outputs were found wrong {MAX_REWINDS} times in one generation")
        finally:
            self.failovers = list(session.failovers[earlier:])

    def _note_unchecked(self, session: InferenceSession) -> None:
        """Hops of the route no other peer could check, over the whole generation (one may be replaced later)."""
        self.unchecked += [hop for hop in session.unchecked if hop not in self.unchecked]

    def _score_prompt(self, out: torch.Tensor, position: int) -> None:
        """Log-probabilities of the prompt's tokens after `position` that the outputs `out` [n, t, hidden] of
        positions `position`... predict (the first prompt token has none: nothing predicts it)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt)
        targets = self.prompt[position + 1:position + out.shape[1] + 1]
        scored = score(self.head.logits, out[0, :len(targets)], targets, self.sampling.logprobs or 0)
        self.prompt_logprobs[position + 1:position + 1 + len(scored)] = scored

    def _release(self, pending: list[list[Delta]], made: int, verified: int) -> list[Delta]:
        """The deltas of tokens up to `verified` (of `made`) not given out yet, merged per choice."""
        upto = max(self.released, min(made, verified))
        out = [d for deltas in pending[:upto - self.released] for d in deltas]
        del pending[:upto - self.released]
        self.released = upto
        merged: dict[int, Delta] = {}
        for d in out:
            before = merged.get(d.index)
            merged[d.index] = d if before is None else Delta(d.index, before.text + d.text, d.finish_reason,
                                                             before.logprobs + d.logprobs)
        return list(merged.values())

    def _save(self, sampler: Sampler) -> tuple:
        return [_copy(c) for c in self.choices], sampler.state()

    def _restore(self, sampler: Sampler, state: tuple) -> None:
        choices, sampler_state = state
        self.choices = [_copy(c) for c in choices]
        sampler.restore(sampler_state)

    def _can_speculate(self) -> bool:
        """Drafts need one choice: the choices of a request share one session, which holds one length."""
        return self.sampling.speculate > 0 and self.sampling.n == 1

    def _checked_drafts(self, sampler: Sampler, logits: torch.Tensor, drafts: list[int]) -> list[tuple]:
        """The tokens a pass over [last token, drafts...] gives (`logits` [1 + drafts, vocabulary]), each with its
        log-probabilities and the sampler's state after it: the sampler chooses at each position in turn, as
        it would have one step at a time, for as long as it chooses the draft there; the first token that
        differs from the draft ends the step. A token chosen at a position is the token decoding without
        drafts chooses there: its logits come from the same tokens before it, and the sampler (its random
        generator, penalties, grammar) is in the same state. So the output, sampled or greedy, is the same."""
        step = []
        for j, row in enumerate(logits):
            step.append(self._choose(sampler, row[None]))
            token = step[-1][0][0]
            if j == len(drafts) or token != drafts[j] or token in self.end_tokens:
                break
        return step

    def _choose(self, sampler: Sampler, logits: torch.Tensor) -> tuple:
        """The next token of each choice from its `logits` [n, vocabulary], its log-probabilities when asked for,
        and the sampler's state after it."""
        tokens = sampler(logits)
        logprobs = None if self.sampling.logprobs is None else logprobs_of(logits, torch.tensor(tokens),
                                                                           self.sampling.logprobs)
        return tokens, logprobs, sampler.state()

    def _decode_next(self, choice: Choice, flush: bool) -> str:
        """The text the choice's newest context token adds; '' while it ends in an incomplete character
        (unless `flush`)."""
        prefix = self.tokenizer.decode(choice.context[choice.prefix_offset:choice.read_offset],
                                       skip_special_tokens=True)
        whole = self.tokenizer.decode(choice.context[choice.prefix_offset:], skip_special_tokens=True)
        if len(whole) > len(prefix) and (flush or not whole.endswith("\ufffd")):
            choice.prefix_offset, choice.read_offset = choice.read_offset, len(choice.context)
            return whole[len(prefix):]
        return ""

    def _advance(self, tokens: list[int], last: bool, logprobs: list[TokenLogprob] | None = None) -> list[Delta]:
        stops = self.sampling.stop
        deltas = []
        for choice, token, logprob in zip(self.choices, tokens, logprobs or [None] * len(tokens)):
            if choice.finish_reason:
                continue
            choice.ids.append(token)
            if logprob is not None:
                choice.logprobs.append(logprob)
            ended = token in self.end_tokens
            if not ended:
                choice.context.append(token)
            finish = "stop" if ended else ("length" if last else None)
            before = len(choice.decoded)
            choice.decoded += self._decode_next(choice, flush=finish is not None)
            text = choice.decoded
            # a stop string not found before cannot start before the new text, less its own length
            start = max(0, before - self.longest_stop)
            cut = min((i for i in (text.find(stop, start) for stop in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
            new = text[len(choice.text):len(text) - (0 if finish else held_back(text, stops))]
            choice.text += new
            choice.finish_reason = finish
            if new or finish or logprob is not None:
                deltas.append(Delta(choice.index, new, finish, () if logprob is None else (logprob,)))
        return deltas


def _copy(choice: Choice) -> Choice:
    return dataclasses.replace(choice, ids=list(choice.ids), context=list(choice.context),
                               logprobs=list(choice.logprobs))
