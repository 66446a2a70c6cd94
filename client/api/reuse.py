"""Conversations that do not pay twice: the gateway's sessions, kept after their requests and shared by prefix.

Clients of an OpenAI API are stateless: each request carries the whole conversation again, or the same long
system prompt and tool list. So a finished request's inference session stays open on the peers (`keep`),
indexed by the tokens its caches hold in a radix tree (`client.api.prefixes`), and a new request of the
same model begins where the most of its prompt is already computed. All of it lives here, behind one call: a
generation runs in a lease (`async with reuse.lease(prompt, max_length) as lease`, `client.leases`), whose
session is one of these, holding `lease.cached` of its prompt's tokens:

- a kept session whose tokens all begin the new prompt (the next turn of its conversation) is *taken*:
  the new request rolls it back to where they part, and sends only the rest;
- a kept session that shares only part of the prompt (the same system prompt, another conversation) is
  *forked* there (`client.inference.fork`): the peers copy its caches up to that position, and it stays
  kept for its own conversation;
- a running request whose prompt shares at least `MIN_SHARED` tokens (that many more than any kept session) is
  forked too, once its prompt has run: so concurrent requests with one system prompt have it computed once
  per peer.

Sessions are kept, taken and forked within one user only (`of(user)`, the gateway's API keys:
`client.api.keys`): each user's sequences begin with a mark of their own in both trees, so no prefix of one user
meets another's, and another user's cached prompt can be neither used nor seen (`cached_tokens`, timing).

When the lease is given back, its session is kept if the generation ended well (`lease.tokens`), else closed.
Requests of several choices (`n` > 1: one session of that batch) and those scoring their prompt (every
position's outputs are needed) take their sessions elsewhere (`client.leases.NewSessions`): they start afresh
and their sessions are not kept.

Bounds: kept sessions hold at most `reuse_tokens` positions together and each is closed after
`reuse_seconds` unused; beyond that the least recently used are closed first. Peers bound them too: a kept
session is idle on its peers, which may reclaim it for another client's session (it then counts as
reclaimed: its next step replays its history there, the same tokens). A peer's idle timeout (300 s by
default) closes it as well: `reuse_seconds` stays below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from client.api.prefixes import PrefixTree
from client.inference.fork import can_fork, fork
from client.inference.session import InferenceSession
from client.leases import Lease

logger = logging.getLogger(__name__)

MIN_SHARED = 16  # prompt tokens a request must share with another's before it forks that one's session
TAKE_SLACK = 4  # a kept session is taken when all its tokens but this many begin the prompt (a chat template
# may write the last turn's end a little differently from how it was generated)
READY_WAIT_S = 60.0  # the longest a fork waits for a running request's prompt to run


@dataclass(eq=False)
class Kept:
    session: InferenceSession
    tokens: list[int]
    user: str = ""
    used_at: float = field(default_factory=time.monotonic)
    forks: int = 0  # forks of it in progress: it is neither taken nor closed meanwhile


@dataclass(frozen=True)
class Choice:
    """Where a lease's session comes from: `how` "kept" (`kept` taken, rolled back to `position`), "fork" (of
    `kept`, pinned until the fork is made), "running" (a fork of the running lease `of` once its prompt ran), or
    "" (a new session)."""

    how: str = ""
    position: int = 0
    kept: Kept | None = None
    of: Lease | None = None


class Reuse:
    """The sessions of one served model kept or running (module docstring). On the gateway's event loop."""

    def __init__(self, client, max_tokens: int, max_seconds: float, metrics=None, model: str = ""):
        self.client = client
        self.max_tokens, self.max_seconds = max_tokens, max_seconds
        self.metrics, self.model = metrics, model
        self.kept = PrefixTree()  # Kept -> its user's mark, then its tokens (`_key`)
        self.running = PrefixTree()  # Lease -> its user's mark, then its prompt
        self._closing: set[asyncio.Task] = set()
        self._marks: dict[str, int] = {}  # user -> the token (below every real one) its sequences begin with

    @property
    def on(self) -> bool:
        return self.max_tokens > 0

    @property
    def kept_tokens(self) -> int:
        return sum(len(kept.tokens) for kept in self.kept.sequences)

    def of(self, user: str) -> Scoped:
        """The leases of one user (`client.api.keys`): sessions are kept, taken and forked within a user only."""
        return Scoped(self, user)

    def _key(self, user: str, tokens: list[int]) -> list[int]:
        """`tokens` as the trees hold them: after a mark of their user, so no user's prefix meets another's."""
        mark = self._marks.setdefault(user, -1 - len(self._marks))
        return [mark, *tokens]

    @contextlib.asynccontextmanager
    async def lease(self, prompt: list[int], max_length: int, user: str = "") -> AsyncIterator[Lease]:
        """A session to run `prompt` in, of at least `max_length`, starting where the most of it is computed among
        `user`'s sessions; kept afterwards if the generation ended well (`Lease.tokens`), else closed."""
        lease = Lease()
        choice = self.choose(prompt, user)
        if self.on:
            self.running.insert(lease, self._key(user, prompt))  # from now on a later request may fork it
        try:
            await self._begin(lease, choice, prompt, max_length)
            yield lease
        finally:
            self.running.remove(lease)
            lease.prefilled.set()  # forks waiting for this prompt look again (they find it ran, or not)
            if lease.session is not None and not (lease.tokens is not None and self._kept(lease, user)):
                lease.closing = self._close_later(lease.session)

    def choose(self, prompt: list[int], user: str = "") -> Choice:
        """Where a request of `user` with `prompt` starts (module docstring). A kept session chosen to be taken
        leaves the tree (it is this request's now); one chosen to be forked is pinned (`Kept.forks`)."""
        self.expire()
        if not self.on or len(prompt) < 2:
            return Choice()
        last = len(prompt) - 1  # at least one prompt token runs
        key = self._key(user, prompt)
        kept_items, kept_len = self.kept.longest(key)
        run_items, run_len = self.running.longest(key)
        kept_len, run_len = max(0, kept_len - 1), max(0, run_len - 1)  # the user's mark is no prompt token
        if not kept_len:
            kept_items = set()
        if not run_len:
            run_items = set()
        kept = max(kept_items, key=lambda k: k.used_at, default=None)
        if kept is not None and kept_len > 0 and kept_len >= len(kept.tokens) - TAKE_SLACK and not kept.forks \
                and not kept.session.forking:
            self.kept.remove(kept)  # the next turn of its conversation: taken
            return Choice("kept", min(kept_len, last), kept)
        sources = sorted(run_items, key=lambda lease: (not lease.prefilled.is_set(), lease.session is None))
        # a running request is forked only if it shares clearly more than any kept session: its fork waits for
        # its prompt to run, and then for the copy (forks of forks would wait in a chain)
        if sources and run_len >= MIN_SHARED + (kept_len if kept is not None else 0):
            return Choice("running", min(run_len, last), of=sources[0])
        if kept is not None and kept_len >= MIN_SHARED:
            kept.forks += 1
            kept.used_at = time.monotonic()
            return Choice("fork", min(kept_len, last), kept)
        return Choice()

    async def _begin(self, lease: Lease, choice: Choice, prompt: list[int], max_length: int) -> None:
        """Make the lease's session as `choice` says (a new one where that cannot be done any more)."""
        position = choice.position
        try:
            if choice.how == "kept":
                source = choice.kept.session
                if position <= 0:
                    self._close_later(source)
                elif not source.closed and source.length >= position and source.max_length >= max_length \
                        and not source.forking:
                    source.live.resume()  # its peers count it toward their load again
                    lease.session, lease.cached, lease.how = source, position, "kept"
                else:  # too short for this request (or being copied): forked into a long enough one, then closed
                    try:
                        await self._fork(lease, source, position, max_length, "kept")
                    finally:
                        self._close_later(source)
            elif choice.how == "running":
                of = choice.of
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(of.prefilled.wait(), READY_WAIT_S)
                # a running request's session holds its prompt while that request runs it: not once another took it
                if of.session is not None and of.session.owner is of:
                    await self._fork(lease, of.session, position, max_length, "fork")
            elif choice.how == "fork":
                try:
                    await self._fork(lease, choice.kept.session, position, max_length, "fork")
                finally:
                    choice.kept.forks = max(0, choice.kept.forks - 1)
        finally:
            if lease.session is None:
                lease.session, lease.cached, lease.how = InferenceSession(self.client, max_length), 0, ""
            lease.session.owner = lease  # a fork of it for a lease still running it is refused from now on

    async def _fork(self, lease: Lease, source: InferenceSession, position: int, max_length: int, how: str) -> None:
        if can_fork(source, position):
            lease.session = await fork(source, position, max(max_length, position))
            lease.cached, lease.how = position, how

    def _kept(self, lease: Lease, user: str) -> bool:
        try:
            return self.keep(lease.session, lease.tokens, user)
        except Exception:  # boundary: a bookkeeping bug closes the session rather than losing it
            logger.exception("keeping a finished session failed")
            return False

    def keep(self, session: InferenceSession, tokens: list[int], user: str = "") -> bool:
        """Keep a finished request's session (True), unless reuse is off or it holds too little."""
        if not self.on or len(tokens) < 2 or len(tokens) > self.max_tokens or session.closed:
            return False
        session.live.rest()  # idle: it does not count toward its peers' load while kept
        self.kept.insert(Kept(session, list(tokens), user), self._key(user, tokens))
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
        self._close_later(kept.session)

    def _close_later(self, session: InferenceSession) -> asyncio.Task:
        """Close `session` in a task of its own: it completes even if the caller is being cancelled."""
        task = asyncio.ensure_future(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def close(self) -> None:
        for kept in list(self.kept.sequences):
            self._close(kept, "shutdown")
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=3)


@dataclass(frozen=True)
class Scoped:
    """`Reuse` as one user's source of leases (`client.leases`)."""

    reuse: Reuse
    user: str

    def lease(self, prompt: list[int], max_length: int):
        return self.reuse.lease(prompt, max_length, self.user)
