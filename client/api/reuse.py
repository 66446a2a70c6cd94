"""Conversations that do not pay twice: the gateway's sessions, kept after their requests and shared by prefix.

Clients of an OpenAI API are stateless: each request carries the whole conversation again, or the same long
system prompt and tool list. So a finished request's inference session stays open on the peers (`keep`),
indexed by the tokens its caches hold in a radix tree (`client.api.prefixes`), and a new request of the
same model begins where the most of its prompt is already computed (`start`):

- a kept session whose tokens all begin the new prompt (the next turn of its conversation) is *taken*:
  the new request rolls it back to where they part, and sends only the rest;
- a kept session that shares only part of the prompt (the same system prompt, another conversation) is
  *forked* there (`client.inference.fork`): the peers copy its caches up to that position, and it stays
  kept for its own conversation;
- a running request whose prompt shares at least `MIN_SHARED` tokens (that many more than any kept session) is
  forked too, once its prompt has run: so concurrent requests with one system prompt have it computed once
  per peer.

Requests of several choices (`n` > 1: one session of that batch) and those scoring their prompt (every
position's outputs are needed) start afresh; their sessions are not kept.

Bounds: kept sessions hold at most `reuse_tokens` positions together and each is closed after
`reuse_seconds` unused; beyond that the least recently used are closed first. Peers bound them too: a kept
session is idle on its peers, which may reclaim it for another client's session (it then counts as
reclaimed: its next step replays its history there, the same tokens). A peer's idle timeout (300 s by
default) closes it as well: `reuse_seconds` stays below it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from client.api.prefixes import PrefixTree
from client.generation import Generation, Start
from client.inference.session import InferenceSession

logger = logging.getLogger(__name__)

MIN_SHARED = 16  # prompt tokens a request must share with another's before it forks that one's session
TAKE_SLACK = 4  # a kept session is taken when all its tokens but this many begin the prompt (a chat template
# may write the last turn's end a little differently from how it was generated)


@dataclass(eq=False)
class Kept:
    session: InferenceSession
    tokens: list[int]
    used_at: float = field(default_factory=time.monotonic)
    forks: int = 0  # forks of it in progress: it is neither taken nor closed meanwhile


class Reuse:
    """The sessions of one served model kept or running (module docstring). On the gateway's event loop."""

    def __init__(self, max_tokens: int, max_seconds: float, metrics=None, model: str = ""):
        self.max_tokens, self.max_seconds = max_tokens, max_seconds
        self.metrics, self.model = metrics, model
        self.kept = PrefixTree()  # Kept -> its tokens
        self.running = PrefixTree()  # Generation -> its prompt
        self._closing: set[asyncio.Task] = set()

    @property
    def on(self) -> bool:
        return self.max_tokens > 0

    @property
    def kept_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.kept.sequences.values())

    def start(self, prompt: list[int], reusable: bool) -> Start | None:
        """Where a request with `prompt` starts (None: a new session); `reusable` False for the requests the
        module docstring excludes."""
        self.expire()
        if not self.on or not reusable or len(prompt) < 2:
            return None
        kept_items, kept_len = self.kept.longest(prompt)
        run_items, run_len = self.running.longest(prompt)
        kept = max(kept_items, key=lambda k: k.used_at, default=None)
        if kept is not None and kept_len > 0 and kept_len >= len(kept.tokens) - TAKE_SLACK and not kept.forks \
                and not kept.session.forking:
            self.kept.remove(kept)  # the next turn of its conversation: taken, it is this request's now
            return Start(kept.session, kept_len)
        sources = sorted(run_items, key=lambda g: (not g.prefilled.is_set(), g.session is None))
        # a running request is forked only if it shares clearly more than any kept session: its fork waits for
        # its prompt to run, and then for the copy (forks of forks would wait in a chain)
        if sources and run_len >= MIN_SHARED + (kept_len if kept is not None else 0):
            # its session may not be open yet: the fork waits for its prompt to have run
            return Start(None, run_len, fork=True, ready=sources[0].prefilled, of=sources[0])
        if kept is not None and kept_len >= MIN_SHARED:
            kept.forks += 1
            kept.used_at = time.monotonic()
            return Start(kept.session, kept_len, fork=True, forked=lambda: self._forked(kept))
        return None

    def _forked(self, kept: Kept) -> None:
        """A fork of a kept session was made or given up: it may be taken or closed again."""
        kept.forks = max(0, kept.forks - 1)

    def began(self, gen: Generation) -> None:
        """`gen`, a reusable request (`start`), runs: its prompt may be forked once it has run."""
        self.running.insert(gen, gen.prompt)

    def ended(self, gen: Generation) -> None:
        """`gen` is over: not a source of forks any more; a start it never looked at is let go."""
        self.running.remove(gen)
        if not gen.start_used:
            gen.release_start()

    def keep(self, session: InferenceSession, tokens: list[int]) -> bool:
        """Keep a finished request's session (True), unless reuse is off or it holds too little."""
        if not self.on or len(tokens) < 2 or len(tokens) > self.max_tokens or session.closed:
            return False
        session.live.rest()  # idle: it does not count toward its peers' load while kept
        self.kept.insert(Kept(session, list(tokens)), tokens)
        self.expire()
        asyncio.get_running_loop().call_later(self.max_seconds + 0.5, self.expire)  # closed in time when idle
        return True

    def expire(self) -> None:
        """Close kept sessions unused for `max_seconds`, then the least recently used beyond `max_tokens`."""
        now = time.monotonic()
        by_age = sorted((k for k in self.kept.sequences if not k.forks and not k.session.forking),
                        key=lambda k: k.used_at)
        total = self.kept_tokens
        for kept in by_age:
            if now - kept.used_at <= self.max_seconds and total <= self.max_tokens:
                break
            total -= len(kept.tokens)
            self._close(kept, "unused" if now - kept.used_at > self.max_seconds else "budget")

    def _close(self, kept: Kept, why: str) -> None:
        self.kept.remove(kept)
        logger.debug("closing a kept session of %d tokens (%s)", len(kept.tokens), why)
        if self.metrics is not None:
            self.metrics.reuse_evicted.labels(why, self.model).inc()
        task = asyncio.ensure_future(kept.session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for kept in list(self.kept.sequences):
            self._close(kept, "shutdown")
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=3)
