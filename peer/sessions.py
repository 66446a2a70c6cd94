"""Inference sessions of one peer and the attention-cache budget they share.

Invariants:
- A session reserves `batch x max_length` cache tokens when it opens and gives them back when it
  closes; the sum of reservations never exceeds the budget. A request for more than is free fails
  at once with `OutOfCache` (no queueing), so a flood of greedy sessions costs the peer almost nothing.
- At most `max_sessions` are open; one more is `Busy`.
- The table is touched only on the event loop; a session's cache only by the compute thread.
- Idle sessions are reclaimed by their stream handler (a read timeout), which closes them here.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

from swarm.errors import Busy, OutOfCache, UnknownSession
from swarm.span import Span


@dataclass
class Session:
    id: str
    span: Span
    batch: int
    max_length: int
    encodings: tuple  # wire encodings its steps may come in
    reserved: int
    opened_at: float
    cache: object = None  # the SpanCache, created by the owner of the blocks
    blocks: object = None  # the SpanBlocks it runs on: a moving peer's old sessions keep the old span's
    steps: int = 0
    closed: bool = False
    last_step: int = -1  # step ids only increase: a late duplicate (a push after the client relayed) is dropped
    used_at: float = 0.0  # monotonic time of the last step, from the client or pushed by a peer
    end: int = 0  # position after the last step taken: where a pushed step must start
    pushes: int = 0  # pushed steps of this session in progress
    send: object = None  # coroutine function sending a message to the session's client on its stream


@dataclass
class SessionTable:
    cache_tokens: int
    max_sessions: int
    sessions: dict[str, Session] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count)

    @property
    def reserved(self) -> int:
        return sum(s.reserved for s in self.sessions.values())

    @property
    def tokens_left(self) -> int:
        return self.cache_tokens - self.reserved

    def open(self, span: Span, batch: int, max_length: int, encodings: tuple, now: float) -> Session:
        need = batch * max_length
        if need > self.tokens_left:
            raise OutOfCache(f"session needs {need} cache tokens (batch {batch} x length {max_length}), "
                             f"{self.tokens_left} of {self.cache_tokens} are free; try another peer or a shorter "
                             "max length")
        if len(self.sessions) >= self.max_sessions:
            raise Busy(f"{len(self.sessions)} sessions are open, the limit is {self.max_sessions}; try another peer")
        # the id is also what lets a peer push steps into the session: unguessable (96 random bits)
        sid = f"s{next(self._counter)}-{secrets.token_hex(12)}"
        session = Session(sid, span, batch, max_length, tuple(encodings), need, now, used_at=now)
        self.sessions[sid] = session
        return session

    def get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None or session.closed:
            raise UnknownSession(f"session {sid} is not open on this peer (closed, reclaimed or never opened)")
        return session

    def close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.closed = True
            session.cache = None  # the memory goes with the last reference
