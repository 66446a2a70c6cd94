"""Drafting tokens for speculative decoding on a server: prompt lookup, with the number of drafted tokens
adapted to what the model accepts.

A step through the swarm costs about the same whether it carries one token or a few, so a generation
that can guess its next tokens sends them along and keeps the ones the model agrees with: one pass for
several tokens. Prompt lookup guesses by finding the sequence's last few tokens (an n-gram) earlier in
the prompt or the output and proposing what followed them there: it costs no model and pays on copying,
rewriting, code editing and quoting. `PromptLookup.propose` tries the longest n-gram (3 tokens, then 2)
first and the most recent match. It drafts `START_TOKENS` at first; `accepted` adapts the draft length the
way transformers' assisted generation does (two more after a step that accepted every draft, one fewer
otherwise) and pauses drafting after a few steps in a row that accepted none, so an answer that copies
nothing pays almost nothing for trying.
"""

from __future__ import annotations

START_TOKENS = 4  # drafted at first: on CPU peers a wrong guess of 8 cost open-ended answers 12% (measured)
MAX_NGRAM = 3  # longest n-gram looked up
MIN_NGRAM = 2  # shortest: a single repeated token is too weak a hint (most such drafts are rejected)
MISSES_BEFORE_PAUSE = 2  # steps in a row with no draft accepted before drafting pauses
PAUSE_STEPS = 16  # steps without drafts after that
LOOKBACK = 4096  # tokens searched for a match, most recent first


class PromptLookup:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.k = min(START_TOKENS, max_tokens)  # tokens to draft next
        self.misses = 0
        self.paused = 0

    def propose(self, context: list[int], limit: int) -> list[int]:
        """Up to `min(k, limit)` tokens that followed the latest earlier occurrence of the context's last
        n-gram ([] if none, or while paused)."""
        if self.paused:
            self.paused -= 1
            return []
        k = min(self.k, limit)
        if k <= 0:
            return []
        window = context[-LOOKBACK:]
        for n in range(min(MAX_NGRAM, len(window) - 1), MIN_NGRAM - 1, -1):
            tail = window[-n:]
            for start in range(len(window) - n - 1, -1, -1):
                if window[start:start + n] == tail:
                    return window[start + n:start + n + k]
        return []

    def accepted(self, drafted: int, kept: int) -> None:
        """After a step that drafted `drafted` tokens and kept `kept` of them."""
        if not drafted:
            return
        self.k = min(self.max_tokens, self.k + 2) if kept == drafted else max(1, self.k - 1)
        self.misses = self.misses + 1 if kept == 0 else 0
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.misses, self.paused = 0, PAUSE_STEPS
