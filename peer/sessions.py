"""Inference sessions of one peer, and fair shares of the cache and of the session slots they use.

Invariants:
- A session's keys and values live in its `rows` (`swarm.model.kv`), blocks of its blocks' pool. It commits cache
  as it uses it: `GROW_TOKENS` tokens per sequence at open, then, before a step would run past its reservation,
  enough more to cover it, in whole chunks of `GROW_TOKENS`, never beyond its `max_length`. What is committed is
  counted in the pools, a block shared by several sessions (a fork's prefix) once: the table's `reserved` is
  exact, and never exceeds the budget. At most `max_sessions` are open.
- A request that does not fit is refused before anything is allocated: a session whose `batch x max_length`
  exceeds the whole budget at open (`OutOfCache`), any other when room cannot be made (below).
- Room is made fairly (`SessionTable.make_room`). When a request (an open, a fork, or a session's growth) does
  not fit, sessions are reclaimed: idle ones first (no step in flight, silent for `reclaim_idle` seconds: kept
  sessions a gateway keeps for the next turn, among them), from the client holding the most, its longest idle
  first; then sessions of a client holding more than its share while the requester, once served, holds no more
  than its own. A session frees what no other session holds. Holdings count cache tokens when the cache is
  short, sessions when the slots are short; a client's share is `share` of the budget (of `max_sessions`), or an
  equal part of it among the clients holding something here, the requester counted, if that is less (so k
  identities that took every slot between them lose their excess to a newcomer: to refuse one, the slots must
  be held by as many identities as there are slots, or `1 / share` identities at their share each).
  Nothing is reclaimed unless that makes the request fit; otherwise it fails with `OutOfCache` (cache) or `Busy`
  (slots). So a client may take what is free, but keeps no more than its share while another client within its
  share needs room, and a growing session never loses itself.
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

import torch

from swarm.errors import Busy, OutOfCache, UnknownSession
from swarm.model.kv import KVLayout, Pool, Rows
from swarm.net.integrity import new_push_key
from swarm.span import Span
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

GROW_TOKENS = 128  # tokens per sequence a reservation grows by: a step rarely waits for the table
COUNTED = KVLayout.of({}, torch.float32, "cpu")  # a pool of this layout holds nothing: it only counts


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
    rows: Rows | None = None  # where its keys and values live (its cache's), made by the table at open
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
        """Cache tokens committed to it, blocks it shares with other sessions included."""
        return 0 if self.rows is None else self.rows.held * self.rows.pool.block_tokens

    def exclusive(self) -> int:
        """Cache tokens closing it would free: what it holds that no other session holds."""
        return 0 if self.rows is None else self.rows.exclusive() * self.rows.pool.block_tokens

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
    pool: Pool | None = None  # where sessions opened without one count their cache (a pool of tokens, no memory)
    sessions: dict[str, ServedSession] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.pool is None:
            self.pool = Pool(COUNTED, self.cache_tokens, mapped=False, block_tokens=1)

    def _pools(self) -> list[Pool]:
        pools = {id(self.pool): self.pool}
        for s in self.sessions.values():
            if s.rows is not None:
                pools.setdefault(id(s.rows.pool), s.rows.pool)
        return list(pools.values())

    @property
    def reserved(self) -> int:
        """Cache tokens committed to open sessions, each block once however many sessions share it."""
        return sum(pool.committed * pool.block_tokens for pool in self._pools())

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
        """Per client: cache tokens committed (a block its sessions share once), sessions open."""
        blocks: dict[str, set] = {}
        tokens, count = Counter(), Counter()
        for s in self.sessions.values():
            count[s.client] += 1
            if s.rows is not None:
                pool = s.rows.pool
                blocks.setdefault(s.client, set()).update((id(pool), b, pool.block_tokens) for b in s.rows.blocks())
                tokens[s.client] += s.rows.credits * pool.block_tokens
        for client, held in blocks.items():
            tokens[client] += sum(size for _, _, size in held)
        return tokens, count

    def open(self, span: Span, batch: int, max_length: int, encodings: tuple, now: float,
             client: str = "", pool: Pool | None = None, shared: int = 0) -> ServedSession:
        """A new session of `client` whose cache lives in `pool` (default: the table's own, which only counts),
        with `GROW_TOKENS` per sequence committed; `shared`: for a fork, the tokens per sequence it will hold of its
        source's (its full blocks are shared: only the rest is committed here, the fork takes it when made)."""
        pool = pool or self.pool
        if batch * pool.blocks_for(max_length) * pool.block_tokens > self.cache_tokens:  # in whole blocks
            raise OutOfCache(f"a session of batch {batch} x length {max_length} needs more than this peer's whole "
                             f"cache ({self.cache_tokens} tokens); try another peer or a shorter max length")
        room = room_for(max(shared, 1), max_length)
        kept = shared // pool.block_tokens if pool.mapped else 0  # full blocks of the source a fork maps, not copies
        blocks = batch * (pool.blocks_for(room) - kept)
        self.make_room(client, blocks * pool.block_tokens, 1, now)
        rows = pool.rows(batch, max_length)
        if not rows.promise(blocks):  # the compute thread took blocks meanwhile (copies on write)
            rows.release()
            raise self._refusal(0, client, blocks * pool.block_tokens)
        # pushes into the session need a tag made with its push key (`swarm.net.integrity`); the id is unguessable too
        sid = f"s{next(self._counter)}-{secrets.token_hex(12)}"
        session = ServedSession(sid, span, batch, max_length, tuple(encodings), room, now, client, used_at=now,
                                rows=rows)
        self.sessions[sid] = session
        return session

    def grow(self, session: ServedSession, length: int, now: float) -> None:
        """Make `session`'s reservation cover `length` tokens per sequence (at most its max length). A closed
        session does not grow (its step fails when it reaches the compute)."""
        room = room_for(length, session.max_length)
        if session.closed or room <= session.room:
            return
        rows = session.rows
        if not rows.reserve(room):
            self.make_room(session.client, rows.need(room) * rows.pool.block_tokens, 0, now, keep=session)
            if not rows.reserve(room):
                raise self._refusal(0, session.client, rows.need(room) * rows.pool.block_tokens)
        session.room = room

    def make_room(self, client: str, tokens: int, slots: int, now: float, keep: ServedSession | None = None) -> None:
        """Reclaim sessions (never `keep`) until `tokens` more cache tokens and `slots` more sessions fit for
        `client`, by the rules of the module docstring; `OutOfCache` or `Busy`, reclaiming nothing, if they
        cannot."""
        if self.tokens_left >= tokens and len(self.sessions) + slots <= self.max_sessions:
            return
        held = self.held()
        free = [self.tokens_left, self.max_sessions - len(self.sessions)]
        want, shares = (tokens, slots), self.shares(held, client)
        left = [s for s in self.sessions.values() if s is not keep]
        victims = []
        while free[0] < tokens or free[1] < slots:
            short = 0 if free[0] < tokens else 1
            by = held[short]
            pick = max((s for s in left if self._reclaimable(s, client, by, shares[short], want[short], now)),
                       key=lambda s: (self._idle(s, now), by[s.client], s.idle_for(now)), default=None)
            if pick is None:
                raise self._refusal(short, client, tokens, shares[short])
            victims.append(pick)
            left.remove(pick)
            freed = pick.exclusive()
            free[0], free[1] = free[0] + freed, free[1] + 1
            held[0][pick.client] -= freed
            held[1][pick.client] -= 1
        for s in victims:
            logger.info("session %s of client %s (%d cache tokens, idle %.1f s) reclaimed for client %s", s.id,
                        describe_peer(s.client), s.reserved, s.idle_for(now), describe_peer(client))
            self.close(s.id, f"was reclaimed for another session when this peer was full (it was idle "
                             f"{s.idle_for(now):.1f} s)")

    def shares(self, held: tuple[Counter, Counter], client: str | None) -> tuple[int, int]:
        """One client's fair share of the cache tokens and of the slots now (module docstring)."""
        parts = len({c for c, n in held[1].items() if n > 0} | {client})
        return (min(self.token_share, self.cache_tokens // parts),
                min(self.session_share, max(1, self.max_sessions // parts)))

    def _idle(self, s: ServedSession, now: float) -> bool:
        return s.idle_for(now) >= self.reclaim_idle

    def _reclaimable(self, s: ServedSession, client: str | None, held: Counter, share: int, need: int, now: float) -> bool:
        return self._idle(s, now) or (s.client != client and held[s.client] > share and held[client] + need <= share)

    def _refusal(self, short: int, client: str, tokens: int, share: int | None = None) -> Exception:
        held = self.held()
        share = self.shares(held, client)[short] if share is None else share
        if short == 1:
            return Busy(f"{len(self.sessions)} sessions are open, the limit is {self.max_sessions}, and none can be "
                        f"reclaimed (this client holds {held[1][client]}, its share is {share}); try another peer")
        return OutOfCache(f"{tokens} more cache tokens needed, {self.tokens_left} of {self.cache_tokens} are free "
                          f"and none can be reclaimed (this client holds {held[0][client]}, its share is {share}); "
                          "try another peer")

    def available(self, client: str | None, now: float) -> int:
        """Cache tokens `client` (None: one holding nothing here) could take now, an estimate for routing: what
        is free or idle, or up to its share where reclaiming from clients over theirs would make room."""
        held = self.held()
        tokens, share = held[0], self.shares(held, client)[0]
        free = self.tokens_left + sum(s.exclusive() for s in self.sessions.values() if self._idle(s, now))
        forced = sum(s.exclusive() for s in self.sessions.values() if not self._idle(s, now)
                     and self._reclaimable(s, client, tokens, share, GROW_TOKENS, now))
        return max(free, min(share - tokens[client], free + forced))

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
            if session.rows is not None:  # counted free now; reused once no step of it can run (`Pool.collect`)
                session.rows.release(later=True)
            session.cache = None
            if self.on_release is not None:
                self.on_release()
