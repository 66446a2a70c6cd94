"""Inference sessions of one peer, and fair shares of the cache and of the session slots they use.

Invariants:
- A session commits cache as it uses it: `GROW_TOKENS` tokens per sequence at open, then, before a step
  would run past its reservation, enough more to cover it, in whole chunks of `GROW_TOKENS`, never beyond its
  `max_length`. The sum of reservations never exceeds the budget; at most `max_sessions` are open.
- A session whose `batch x max_length` exceeds the whole budget is refused at open with `OutOfCache`.
- Room is made fairly (`SessionTable.make_room`). When a request (an open, or a session's growth) does not
  fit, sessions are reclaimed from the client holding the most, its longest idle first, where a session may
  go if it is idle (no step in flight, silent for `reclaim_idle` seconds), or if its client holds more than
  its share while the requester, once served, holds no more than its own. Holdings count cache tokens when
  the cache is short, sessions when the slots are short; a client's share is `share` of the budget (of
  `max_sessions`). Nothing is reclaimed unless that makes the request fit; otherwise it fails with
  `OutOfCache` (cache) or `Busy` (slots). So a client may take what is free, but keeps no more than its share
  while another client within its share needs room, and a growing session never loses itself.
- The table is touched only on the event loop; a session's cache only by the compute thread.
- Idle sessions are also reclaimed by their stream handler (`--idle-timeout`), which closes them here.
  `on_release` is called whenever a close gives cache back.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.errors import Busy, OutOfCache, UnknownSession
from swarm.net.integrity import new_push_key
from swarm.span import Span
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

GROW_TOKENS = 128  # tokens per sequence a reservation grows by: a step rarely waits for the table


@dataclass
class ServedSession:
    id: str
    span: Span
    batch: int
    max_length: int
    encodings: tuple  # wire encodings its steps may come in
    room: int  # tokens per sequence its reservation covers
    opened_at: float
    client: str = ""  # authenticated peer id of the client that opened it
    cache: object = None  # the SpanCache, created by the owner of the blocks
    blocks: object = None  # the SpanBlocks it runs on: a moving peer's old sessions keep the old span's
    steps: int = 0
    closed: bool = False
    why: str = ""  # why it closed, for its client's next step
    inflight: int = 0  # its steps submitted and not yet answered: it is not idle
    last_step: int = -1  # step ids only increase: a late duplicate (a push after the client relayed) is dropped
    used_at: float = 0.0  # monotonic time of the last step, from the client or pushed by a peer
    end: int = 0  # position after the last step taken: where a pushed step must start
    pushes: int = 0  # pushed steps of this session in progress
    send: object = None  # coroutine function sending a message to the session's client on its stream
    push_key: str = field(default_factory=new_push_key)  # shared with the client only: it tags pushes for us

    @property
    def reserved(self) -> int:
        """Cache tokens committed to it."""
        return self.batch * self.room

    def idle_for(self, now: float) -> float:
        return 0.0 if self.inflight else now - self.used_at


def room_for(length: int, max_length: int) -> int:
    """The reservation per sequence covering `length` tokens: whole chunks, at most `max_length`."""
    return min(max_length, -(-max(length, 1) // GROW_TOKENS) * GROW_TOKENS)


@dataclass
class SessionTable:
    cache_tokens: int
    max_sessions: int
    share: float = 0.25  # of the cache and of the sessions, one client's fair share
    reclaim_idle: float = 5.0  # seconds without a step before a session may be reclaimed for another
    on_release: Callable[[], None] | None = None
    sessions: dict[str, ServedSession] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count)

    @property
    def reserved(self) -> int:
        return sum(s.reserved for s in self.sessions.values())

    @property
    def tokens_left(self) -> int:
        """Cache tokens no session has committed."""
        return self.cache_tokens - self.reserved

    @property
    def token_share(self) -> int:
        return int(self.cache_tokens * self.share)

    @property
    def session_share(self) -> int:
        return max(1, int(self.max_sessions * self.share))

    def held(self) -> tuple[Counter, Counter]:
        """Per client: cache tokens committed, sessions open."""
        tokens, count = Counter(), Counter()
        for s in self.sessions.values():
            tokens[s.client] += s.reserved
            count[s.client] += 1
        return tokens, count

    def open(self, span: Span, batch: int, max_length: int, encodings: tuple, now: float,
             client: str = "") -> ServedSession:
        if batch * max_length > self.cache_tokens:
            raise OutOfCache(f"a session of batch {batch} x length {max_length} needs more than this peer's whole "
                             f"cache ({self.cache_tokens} tokens); try another peer or a shorter max length")
        room = room_for(1, max_length)
        self.make_room(client, batch * room, 1, now)
        # pushes into the session need a tag made with its push key (`swarm.net.integrity`); the id is unguessable too
        sid = f"s{next(self._counter)}-{secrets.token_hex(12)}"
        session = ServedSession(sid, span, batch, max_length, tuple(encodings), room, now, client, used_at=now)
        self.sessions[sid] = session
        return session

    def grow(self, session: ServedSession, length: int, now: float) -> None:
        """Make `session`'s reservation cover `length` tokens per sequence (at most its max length). A closed
        session does not grow (its step fails when it reaches the compute)."""
        room = room_for(length, session.max_length)
        if session.closed or room <= session.room:
            return
        self.make_room(session.client, session.batch * (room - session.room), 0, now, keep=session)
        session.room = room

    def make_room(self, client: str, tokens: int, slots: int, now: float, keep: ServedSession | None = None) -> None:
        """Reclaim sessions (never `keep`) until `tokens` more cache tokens and `slots` more sessions fit for
        `client`, by the rules of the module docstring; `OutOfCache` or `Busy`, reclaiming nothing, if they
        cannot."""
        if self.tokens_left >= tokens and len(self.sessions) + slots <= self.max_sessions:
            return
        held = self.held()
        free = [self.tokens_left, self.max_sessions - len(self.sessions)]
        want, shares = (tokens, slots), (self.token_share, self.session_share)
        left = [s for s in self.sessions.values() if s is not keep]
        victims = []
        while free[0] < tokens or free[1] < slots:
            short = 0 if free[0] < tokens else 1
            by = held[short]
            pick = max((s for s in left if self._reclaimable(s, client, by, shares[short], want[short], now)),
                       key=lambda s: (by[s.client], s.idle_for(now)), default=None)
            if pick is None:
                raise self._refusal(short, client, tokens)
            victims.append(pick)
            left.remove(pick)
            free[0], free[1] = free[0] + pick.reserved, free[1] + 1
            held[0][pick.client] -= pick.reserved
            held[1][pick.client] -= 1
        for s in victims:
            logger.info("session %s of client %s (%d cache tokens, idle %.1f s) reclaimed for client %s", s.id,
                        describe_peer(s.client), s.reserved, s.idle_for(now), describe_peer(client))
            self.close(s.id, f"was reclaimed for another session when this peer was full (it was idle "
                             f"{s.idle_for(now):.1f} s)")

    def _idle(self, s: ServedSession, now: float) -> bool:
        return s.idle_for(now) >= self.reclaim_idle

    def _reclaimable(self, s: ServedSession, client: str | None, held: Counter, share: int, need: int, now: float) -> bool:
        return self._idle(s, now) or (s.client != client and held[s.client] > share and held[client] + need <= share)

    def _refusal(self, short: int, client: str, tokens: int) -> Exception:
        held = self.held()
        if short == 1:
            return Busy(f"{len(self.sessions)} sessions are open, the limit is {self.max_sessions}, and none can be "
                        f"reclaimed (this client holds {held[1][client]}, its share is {self.session_share}); "
                        "try another peer")
        return OutOfCache(f"{tokens} more cache tokens needed, {self.tokens_left} of {self.cache_tokens} are free "
                          f"and none can be reclaimed (this client holds {held[0][client]}, its share is "
                          f"{self.token_share}); try another peer")

    def available(self, client: str | None, now: float) -> int:
        """Cache tokens `client` (None: one holding nothing here) could take now, an estimate for routing: what
        is free or idle, or up to its share where reclaiming from clients over theirs would make room."""
        tokens, _ = self.held()
        free = self.tokens_left + sum(s.reserved for s in self.sessions.values() if self._idle(s, now))
        forced = sum(s.reserved for s in self.sessions.values() if not self._idle(s, now)
                     and self._reclaimable(s, client, tokens, self.token_share, GROW_TOKENS, now))
        return max(free, min(self.token_share - tokens[client], free + forced))

    def get(self, sid: str, client: str | None = None) -> ServedSession:
        """The open session `sid`; with `client`, only if that client opened it: another client's session is
        `UnknownSession` with the same message as one that does not exist, so its existence never shows."""
        session = self.sessions.get(sid)
        if session is None or session.closed or (client is not None and session.client != client):
            raise UnknownSession(f"session {sid} is not open on this peer (closed, reclaimed or never opened)")
        return session

    def close(self, sid: str, why: str = "was closed") -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.closed, session.why = True, why
            if session.cache is not None:  # its blocks go back to the pool now; a step still running reads on
                session.cache.release()
            session.cache = None
            if self.on_release is not None:
                self.on_release()
