"""The OpenAI-shaped JSON bodies `swarm api` answers with: a whole completion, or its stream chunks, the
usage figures, and log-probabilities in each endpoint's shape. Pure: no HTTP (the gateway in `client/api/gateway.py`
sends them).

A request of several prompts (completions) runs one generation per prompt; choice `j` of prompt `i` has
index `i * n + j`, as OpenAI numbers them. Log-probabilities: `/v1/completions` has `tokens`,
`token_logprobs`, `top_logprobs` (a dict of the k most likely tokens, plus the chosen one, so up to k + 1
entries, as OpenAI's and vLLM's) and `text_offset` (each token's offset in the choice's text, the echoed
prompt included); `/v1/chat/completions` has `content`: one object per token with `token`, `logprob`,
`bytes` and `top_logprobs` (a list of k). A token's text is its own decoding (`tokenizer.decode([id])`);
`-inf` becomes -9999.0, as JSON has no infinities.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from client.api.tools import Tools, ToolStream, find_calls, openai_calls
from client.generation import Delta, Generation
from client.sampling import TokenLogprob

NO_LOGPROB = -9999.0  # what -inf is sent as
UNCHECKED_HEADER = "X-Swarm-Unchecked-Blocks"


class ResponseBodies:
    """Builds a response's JSON: whole, or as stream chunks, in OpenAI's formats, for the generations of one
    request (one per prompt). `echo`: each prompt's text, put before its choices' text (completions)."""

    def __init__(self, kind: str, model: str, n: int, tokenizer=None, *, logprobs: int | None = None,
                 echo: Sequence[str] | None = None, tools: Tools | None = None):
        self.kind, self.model, self.n, self.tokenizer = kind, model, n, tokenizer
        self.logprobs, self.echo, self.tools = logprobs, echo, tools
        self.tool_streams: dict[int, ToolStream] = {}  # per choice index, when tools are on
        self.chat = kind == "chat.completion"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice index: characters of text its stream has logged so far
        self._strings: dict[int, str] = {}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def index(self, prompt: int, choice: int) -> int:
        return prompt * self.n + choice

    # ---- whole ----

    def whole(self, gens: list[Generation]) -> dict[str, Any]:
        """The finished generations' answer: each choice's text is what a stream would have carried."""
        choices = []
        for p, gen in enumerate(gens):
            for c in gen.choices:
                index = self.index(p, c.index)
                if self.chat:
                    message: dict[str, Any] = {"role": "assistant", "content": c.text}
                    finish = c.finish_reason
                    if self.tools is not None:
                        content, calls = find_calls(c.text, self.tools.names)
                        if calls:
                            message = {"role": "assistant", "content": content or None,
                                       "tool_calls": openai_calls(calls, self.tools.parallel)}
                            finish = "tool_calls"
                    choices.append({"index": index, "message": message, "finish_reason": finish,
                                    "logprobs": self._chat_logprobs(c.logprobs)})
                else:
                    prefix = self.echo[p] if self.echo is not None else ""
                    logged = self._prompt_entries(gen) + list(c.logprobs)
                    choices.append({"index": index, "text": prefix + c.text, "finish_reason": c.finish_reason,
                                    "logprobs": self._completion_logprobs(index, logged)})
        return {**self._head(self.kind), "choices": choices, "usage": usage(gens)}

    # ---- streamed ----

    def opening(self, gens: list[Generation]) -> list[dict[str, Any]]:
        """Chat streams start with the assistant role, one chunk per choice; completions that echo start
        with each prompt (and its log-probabilities)."""
        if self.chat:
            return [{**self._head("chat.completion.chunk"), "choices": [
                {"index": self.index(p, i), "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                 "logprobs": None}]} for p in range(len(gens)) for i in range(self.n)]
        if self.echo is None:
            return []
        out = []
        for p, gen in enumerate(gens):
            for i in range(self.n):
                index = self.index(p, i)
                out.append({**self._head("text_completion"), "choices": [
                    {"index": index, "text": self.echo[p], "finish_reason": None,
                     "logprobs": self._completion_logprobs(index, self._prompt_entries(gen))}]})
        return out

    def chunks(self, prompt: int, deltas: list[Delta]) -> list[dict[str, Any]]:
        """One chunk per choice's delta, as OpenAI sends them (clients read `choices[0]`)."""
        out = []
        for d in deltas:
            index = self.index(prompt, d.index)
            if self.chat and self.tools is not None:
                out += self._tool_chunks(index, d)
            elif self.chat:
                out.append({**self._head("chat.completion.chunk"), "choices": [
                    {"index": index, "delta": {"content": d.text} if d.text else {},
                     "finish_reason": d.finish_reason, "logprobs": self._chat_logprobs(d.logprobs)}]})
            else:
                out.append({**self._head("text_completion"), "choices": [
                    {"index": index, "text": d.text, "finish_reason": d.finish_reason,
                     "logprobs": self._completion_logprobs(index, list(d.logprobs))}]})
        return out

    def _tool_chunks(self, index: int, d: Delta) -> list[dict[str, Any]]:
        """A chat delta when tools are on: text that may be a call waits; calls go out whole at the end."""
        stream = self.tool_streams.setdefault(index, ToolStream(self.tools.names))
        text, calls = stream.feed(d.text), []
        if d.finish_reason:
            rest, calls = stream.finish()
            text += rest
        head = self._head("chat.completion.chunk")
        out = [{**head, "choices": [{"index": index, "delta": {"content": text} if text else {},
                                     "finish_reason": None if calls else d.finish_reason,
                                     "logprobs": self._chat_logprobs(d.logprobs)}]}]
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(openai_calls(calls, self.tools.parallel))]
            out.append({**head, "choices": [{"index": index, "delta": {"tool_calls": deltas},
                                             "finish_reason": "tool_calls", "logprobs": None}]})
        return out

    def usage_chunk(self, gens: list[Generation]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(gens)}

    # ---- log-probabilities ----

    def _string(self, token: int) -> str:
        if token not in self._strings:
            self._strings[token] = self.tokenizer.decode([token])
        return self._strings[token]

    def _prompt_entries(self, gen: Generation) -> list[TokenLogprob | int]:
        """The echoed prompt's tokens: scored ones, and bare ids where nothing scored them (the first)."""
        if self.echo is None or self.logprobs is None:
            return []
        scored = gen.prompt_logprobs or [None] * len(gen.prompt)
        return [lp if lp is not None else token for token, lp in zip(gen.prompt, scored)]

    def _completion_logprobs(self, index: int, entries: list[TokenLogprob | int]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for e in entries:
            token = e if isinstance(e, int) else e.token
            text = self._string(token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if isinstance(e, int):
                values.append(None)
                tops.append(None)
            else:
                values.append(_value(e.logprob))
                top = {self._string(t): _value(v) for t, v in e.top}
                top.setdefault(text, _value(e.logprob))
                tops.append(top)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None

        def one(token: int, value: float) -> dict[str, Any]:
            text = self._string(token)
            return {"token": text, "logprob": _value(value), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}


def _value(logprob: float) -> float:
    return logprob if logprob > NO_LOGPROB else NO_LOGPROB


def usage(gens: list[Generation]) -> dict[str, Any]:
    """OpenAI's usage figures (with cached prompt tokens), and `unchecked_blocks` when some blocks had no other
    peer to check them."""
    prompt = sum(g.prompt_tokens for g in gens)
    completion = sum(g.completion_tokens for g in gens)
    figures = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               # prompt tokens whose outputs the peers held already (a kept or forked session), as OpenAI reports them
               "prompt_tokens_details": {"cached_tokens": sum(g.cached for g in gens)}}
    if blocks := unchecked_blocks(gens):
        figures["unchecked_blocks"] = blocks
    return figures


def unchecked_blocks(gens: list[Generation]) -> list[str]:
    """The hops of these generations' routes that no other peer could check, as `str(hop)` (ASCII)."""
    return sorted({str(hop) for g in gens for hop in g.unchecked})


def unchecked_headers(gens: list[Generation]) -> dict[str, str]:
    """`X-Swarm-Unchecked-Blocks` when some blocks had no other peer to check them."""
    blocks = unchecked_blocks(gens)
    return {UNCHECKED_HEADER: ", ".join(blocks)} if blocks else {}
