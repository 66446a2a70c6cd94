"""Where a generation's inference session comes from and where it goes: a `Lease`, taken for the generation's run
(`async with sessions.lease(prompt, max_length) as lease`), given back when it ends.

A lease holds a session and how many of the prompt's tokens it already holds (`cached`: they are not sent
again). The generation marks two moments on it: `prefilled` once its prompt has run (a fork of it may begin),
and `tokens` once it ended well (the tokens the session's caches hold: the source may keep it for the next
request). What happens to the session afterwards is the source's business, not the generation's.

`NewSessions` is the plain source: a new session per lease, closed when it is given back. The gateway's prompt
reuse (`client.api.reuse.Reuse`) is the other: sessions kept after their requests and forked by prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from client.inference.session import InferenceSession


@dataclass(eq=False)
class Lease:
    """A session a generation runs in, from its source (module docstring)."""

    session: InferenceSession | None = None  # None only until the source has made it
    cached: int = 0  # prompt tokens the session held when leased: sent no more
    how: str = ""  # "kept" (a finished request's session, taken), "fork" (a copy of a session's prefix) or ""
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)  # set once the prompt has run
    tokens: list[int] | None = None  # set by a generation that ended well: the tokens the session's caches hold
    closing: asyncio.Task | None = None  # the session's close, once given back and not kept


class NewSessions:
    """Leases of new sessions of `client`, closed when given back (in a task of their own, which completes even
    when the generation is being cancelled: `Lease.closing`)."""

    def __init__(self, client):
        self.client = client

    @contextlib.asynccontextmanager
    async def lease(self, prompt: list[int], max_length: int) -> AsyncIterator[Lease]:
        lease = Lease(InferenceSession(self.client, max_length))
        lease.session.owner = lease
        try:
            yield lease
        finally:
            lease.prefilled.set()
            lease.closing = asyncio.ensure_future(lease.session.close())
