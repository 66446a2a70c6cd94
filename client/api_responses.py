"""The OpenAI-shaped JSON bodies `swarm api` answers with: a whole completion, or its stream chunks, and the
usage figures. Pure: no HTTP (the gateway in `client/api.py` sends them)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from client.generation import Generation


class ResponseBodies:
    """Builds a response's JSON: whole, or as stream chunks, in OpenAI's formats."""

    def __init__(self, kind: str, model: str, n: int):
        self.kind, self.model, self.n = kind, model, n
        self.chat = kind == "chat.completion"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, gen: Generation) -> dict[str, Any]:
        """The finished generation's answer: each choice's text is what a stream would have carried."""
        if self.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish_reason, "logprobs": None} for c in gen.choices]
        else:
            choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                       for c in gen.choices]
        return {**self._head(self.kind), "choices": choices, "usage": usage(gen)}

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams start with the assistant role, one chunk per choice."""
        if not self.chat:
            return []
        return [{**self._head("chat.completion.chunk"), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]}
            for i in range(self.n)]

    def chunks(self, deltas) -> list[dict[str, Any]]:
        """One chunk per choice's delta, as OpenAI sends them (clients read `choices[0]`)."""
        if self.chat:
            return [{**self._head("chat.completion.chunk"), "choices": [
                {"index": d.index, "delta": {"content": d.text} if d.text else {},
                 "finish_reason": d.finish_reason, "logprobs": None}]} for d in deltas]
        return [{**self._head("text_completion"), "choices": [
            {"index": d.index, "text": d.text, "finish_reason": d.finish_reason, "logprobs": None}]} for d in deltas]

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(gen)}


def usage(gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}
