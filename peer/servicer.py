"""The peer's network side: decodes requests, checks them, submits compute, encodes replies.

One error policy for every protocol: a `SwarmError` becomes an ERROR message with its code and the
stream goes on (a session survives a bad step: its cache is untouched); a framing error
(`ProtocolError`) is answered, then the stream is closed, since the byte stream cannot be trusted
any more; anything else is logged and answered as `internal`. Nothing a client sends can stop the
peer from serving others. Events and their timings go to `PeerMetrics`; errors are counted in `_count`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.runtime import Runtime
from peer.push import Pusher, parse_chain
from peer.sessions import Session, SessionTable
from swarm import wire
from swarm.blocks import SpanBlocks
from swarm.errors import BadRequest, NotServing, ProtocolError, SwarmError, UnknownSession
from swarm.span import Span
from swarm.transport import Stream, describe_peer

logger = logging.getLogger(__name__)

WIRE_FLOATS = ("float32", "float16", "bfloat16")
PUSH_STEP_WINDOW = 256  # a pushed step id may be at most this far past the session's last (ids skipped by relays)
MAX_PUSHES_PER_SESSION = 2  # pushed steps of one session in progress at once; more are dropped
MAX_PUSH_TASKS_PER_SESSION = 2  # ... and of all sessions, per allowed session
PAD_SLACK = 64  # tokens of padding a batched forward may add to any session regardless of the ratio


def _int(fields: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = fields.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _similar_lengths(shared: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
    """Split (item, cache) pairs into groups of similar cache length: a batched forward pads every cache to
    the longest of its group (a temporary copy), so a long session never makes short ones copy its length.
    Within a group the longest is at most twice the shortest plus `PAD_SLACK` tokens."""
    groups: list[list[tuple[int, Any]]] = []
    for pair in sorted(shared, key=lambda p: p[1].length):
        if groups and pair[1].length <= 2 * groups[-1][0][1].length + PAD_SLACK:
            groups[-1].append(pair)
        else:
            groups.append([pair])
    return groups


@dataclass
class Served:
    peer: str
    model_id: str
    span: Span
    version: str
    throughput: float = 0.0
    prefill_tps: float = 0.0


class Servicer:
    def __init__(self, config: PeerConfig, served: Served, blocks: SpanBlocks, runtime: Runtime,
                 sessions: SessionTable, metrics: PeerMetrics):
        self.config, self.served, self.blocks, self.runtime, self.sessions = config, served, blocks, runtime, sessions
        self.metrics = metrics
        self.hidden_size = blocks.hidden_size  # the model's: the same whatever span is served, also mid-move
        self.errors: dict[str, int] = {}
        self.pusher: Pusher | None = None  # set by the server once its node runs
        self.pushes = {"received": 0, "dropped": 0, "stale": 0, "rejected": 0}
        self._tasks: set[asyncio.Task] = set()  # pushed steps in progress
        self.capacity = None  # peer.capacity.Capacity, set by the server: follows the real decode steps
        self.moves = 0  # spans this peer moved to since it started
        self.moving = False  # loading a new span after dropping the old one: nothing new is accepted

    # ---- the served span ----

    def activate(self, blocks: SpanBlocks, span: Span) -> None:
        """Serve `blocks` for `span` from now on: new sessions and forwards use them; sessions already open
        keep running on the blocks they opened with until they close (a moving peer drains its old span)."""
        self.blocks, self.served.span = blocks, span

    def sessions_on(self, blocks: SpanBlocks | None) -> list[Session]:
        """Open sessions running on `blocks` (None: on any blocks but the active ones)."""
        return [s for s in self.sessions.sessions.values()
                if (s.blocks is blocks if blocks is not None else s.blocks is not self.blocks)]

    # ---- shared checks ----

    def _check_target(self, fields: dict[str, Any]) -> Span:
        if self.moving:
            raise NotServing(f"this peer is moving to blocks {self.served.span} and serves nothing new until they "
                             "load; try another peer")
        if fields.get("model") != self.served.model_id:
            raise NotServing(f"this peer serves model {self.served.model_id!r}, not {fields.get('model')!r}")
        start = _int(fields, "start", 0, 2**20)
        end = _int(fields, "end", start + 1, 2**20)
        span = Span(start, end)
        if not (self.served.span.start <= start and end <= self.served.span.end):
            raise NotServing(f"blocks {span} are not within the served blocks {self.served.span}")
        return span

    def _hidden(self, msg: wire.Message, dtype: str | None, batch_max: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not 1 <= len(msg.tensors) <= 2:
            raise BadRequest(f"expected hidden states and an optional attention mask, got {len(msg.tensors)} tensors")
        hidden = msg.tensors[0]
        if hidden.dtype not in WIRE_FLOATS or (dtype is not None and hidden.dtype != dtype):
            raise BadRequest(f"hidden states must be {dtype or ' or '.join(WIRE_FLOATS)}, got {hidden.dtype}")
        size = self.hidden_size
        if len(hidden.shape) != 3 or hidden.shape[2] != size or not 1 <= hidden.shape[0] <= batch_max \
                or hidden.shape[1] < 1:
            raise BadRequest(f"hidden states must be [batch <= {batch_max}, tokens >= 1, {size}], "
                             f"got {list(hidden.shape)}")
        mask = None
        if len(msg.tensors) == 2:
            if msg.tensors[1].dtype not in ("bool", "int64"):
                raise BadRequest(f"attention mask must be bool or int64, got {msg.tensors[1].dtype}")
            mask = wire.tensor_of(msg.tensors[1])
            if mask.dtype == torch.int64 and not ((mask == 0) | (mask == 1)).all():
                raise BadRequest("attention mask must hold only 0 and 1")
        return wire.tensor_of(hidden), mask

    def _count(self, err: SwarmError) -> None:
        self.errors[err.code] = self.errors.get(err.code, 0) + 1
        self.metrics.failed(err.code)

    async def _send(self, stream: Stream, msg: wire.Message) -> bool:
        """Write `msg`; False if the client is gone (its stream broke or stopped reading)."""
        try:
            await asyncio.wait_for(wire.write_message(stream.writer, msg), self.config.step_timeout)
            return True
        except (ConnectionError, OSError, asyncio.TimeoutError):
            return False

    async def _receive(self, stream: Stream, timeout: float) -> wire.Message:
        return await asyncio.wait_for(wire.read_message(stream.reader, self.config.max_request_bytes), timeout)

    async def _answer(self, stream: Stream, handle, msg: wire.Message, send=None) -> bool:
        """Run `handle(msg)` and send its reply or its error (with `send`, if given); False if the stream must end."""
        received = time.perf_counter()
        keep = True
        try:
            reply = await handle(msg)
        except SwarmError as e:
            self._count(e)
            reply = wire.error_message(e, step=msg.fields.get("step"))
            keep = not isinstance(e, (ProtocolError, UnknownSession))
        except Exception as e:  # boundary: a bug in one request is reported, the peer keeps serving
            logger.exception("request %s from %s failed", msg.type, describe_peer(stream.remote))
            self._count(SwarmError())
            reply = wire.error_message(SwarmError(f"internal error: {type(e).__name__}"))
        if not await (send(reply) if send is not None else self._send(stream, reply)):
            logger.debug("%s went away before the reply to %s", describe_peer(stream.remote), msg.type)
            return False  # a client that left is not an error of ours
        if msg.type == wire.STEP and reply.type == wire.OUTPUT:
            self.metrics.step_replied(time.perf_counter() - received)
        return keep

    # ---- session protocol ----

    async def serve_session(self, stream: Stream) -> None:
        session: Session | None = None
        reclaimed = False  # the session went idle: its cache is freed, the next message learns why
        lock = asyncio.Lock()  # replies come from this handler and from steps pushed into the session

        async def send(msg: wire.Message) -> bool:
            async with lock:
                return await self._send(stream, msg)

        async def handle(msg: wire.Message) -> wire.Message:
            nonlocal session
            if msg.type == wire.OPEN:
                if session is not None:
                    raise BadRequest("a session is already open on this stream")
                session = self._open(msg.fields)
                session.send = send
                return wire.Message(wire.OPENED, {"session": session.id, "start": session.span.start,
                                                  "end": session.span.end, "batch": session.batch,
                                                  "max_length": session.max_length, "dtype": session.dtype,
                                                  "cache_tokens_left": self.sessions.tokens_left})
            if msg.type == wire.STEP:
                if session is None:
                    raise UnknownSession("no session is open on this stream: send 'open' first")
                if reclaimed:
                    raise UnknownSession(f"session {session.id} was idle for more than "
                                         f"{self.config.idle_timeout:.0f} s and its cache was reclaimed")
                return await self._chained_step(self.sessions.get(session.id), msg)
            raise BadRequest(f"unexpected message {msg.type!r} in a session")

        # A read is never cancelled midway (that would tear a message): it waits while steps pushed by
        # peers keep the session busy, and the idle clock counts from the last step of either kind.
        read: asyncio.Future | None = None
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(wire.read_message(stream.reader, self.config.max_request_bytes))
                wait = self.config.idle_timeout
                if session is not None and not reclaimed:
                    wait = max(0.0, session.used_at + self.config.idle_timeout - time.monotonic())
                done, _ = await asyncio.wait({read}, timeout=wait)
                if not done:
                    if session is None or reclaimed:
                        return  # silent twice over (or never opened): drop the stream
                    if time.monotonic() - session.used_at < self.config.idle_timeout:
                        continue
                    logger.info("session %s idle for %.0f s: cache reclaimed", session.id, self.config.idle_timeout)
                    self.sessions.close(session.id)
                    reclaimed = True
                    continue
                finished, read = read, None
                try:
                    msg = finished.result()
                except EOFError:
                    return
                except ProtocolError as e:
                    self._count(e)
                    await send(wire.error_message(e))
                    return
                if msg.type == wire.CLOSE:
                    return
                if not await self._answer(stream, handle, msg, send):
                    return
        finally:
            if read is not None:
                read.cancel()
            if session is not None:
                self.sessions.close(session.id)

    async def _chained_step(self, session: Session, msg: wire.Message) -> wire.Message:
        """A step from the session's client or pushed by the previous peer. With `next` (the rest of the
        client's route), the output is pushed on to the next peer before the reply says whether it left."""
        step = _int(msg.fields, "step", 0, 2**62)
        chain = parse_chain(msg.fields.get("next"), self.served.peer)
        position = msg.fields.get("position")
        tokens = msg.tensors[0].shape[1] if msg.tensors and len(msg.tensors[0].shape) == 3 else 0
        # the client's own steps are never refused for their id: a push cannot lock the client out
        session.last_step = max(session.last_step, step)
        session.end = position + tokens if type(position) is int else -1
        session.used_at = time.monotonic()
        reply = await self._step(session, msg)
        if chain is not None:
            reason = await self._push(msg, reply, chain)
            reply.fields["pushed"] = reason is None
            if reason is not None:
                reply.fields["push_error"] = reason
        return reply

    async def _push(self, msg: wire.Message, reply: wire.Message, chain: list[dict[str, Any]]) -> str | None:
        if self.pusher is None or not self.config.push:
            return "disabled"
        first, rest = chain[0], chain[1:]
        fields = {"session": first["session"], "step": first["step"], "position": msg.fields["position"]}
        if rest:
            fields["next"] = rest
        # the output, and the step's attention mask if it had one
        return await self.pusher.push(first["peer"], wire.Message(wire.PUSH, fields, reply.tensors + msg.tensors[1:]))

    # ---- push protocol: steps from the previous peer of a client's route ----

    async def serve_push(self, stream: Stream) -> None:
        """Read pushed steps and run each in its own task (so they can batch); nothing is answered here:
        each result goes to its session's client, on the session's stream. A stream holds at most
        `max_sessions` pushed steps in compute; one waiting for its client to read holds none."""
        slots = asyncio.Semaphore(self.config.max_sessions)
        while True:
            try:
                msg = await self._receive(stream, self.config.idle_timeout)
            except (EOFError, asyncio.TimeoutError):
                return
            except ProtocolError as e:
                self._count(e)
                return
            if msg.type != wire.PUSH:
                self._count(BadRequest())
                logger.info("peer %s sent %r on the push protocol: stream closed", describe_peer(stream.remote),
                            msg.type)
                return
            session = self._pushable(msg)
            if session is None:
                continue
            await slots.acquire()
            session.pushes += 1
            task = asyncio.create_task(self._pushed(session, msg, slots))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _pushable(self, msg: wire.Message) -> Session | None:
        """The session a pushed step may run in, or None (counted) if it must be dropped: the session is not
        open here, the step is not the session's next one (an old id, an id far ahead, a position other than
        the end of what the session has run: a late duplicate or a forgery), or too many pushed steps wait."""
        sid, step, position = (msg.fields.get(k) for k in ("session", "step", "position"))
        session = self.sessions.sessions.get(sid) if isinstance(sid, str) else None
        if session is None or session.closed or session.send is None:
            self.pushes["dropped"] += 1  # closed or reclaimed: the client's deadline makes it relay
            return None
        if type(step) is not int or not session.last_step < step <= session.last_step + PUSH_STEP_WINDOW \
                or position != session.end:
            self.pushes["stale"] += 1  # the client has already sent a later step itself, or a forgery
            return None
        if session.pushes >= MAX_PUSHES_PER_SESSION or len(self._tasks) >= MAX_PUSH_TASKS_PER_SESSION * \
                self.config.max_sessions:
            self.pushes["dropped"] += 1
            return None
        return session

    async def _pushed(self, session: Session, msg: wire.Message, slots: asyncio.Semaphore) -> None:
        received = time.perf_counter()
        step = msg.fields["step"]
        self.pushes["received"] += 1
        try:
            try:
                reply = await self._chained_step(session, msg)
            except BadRequest as e:  # the pushing peer's fault, not the client's: drop it, the client relays
                self._count(e)
                self.pushes["rejected"] += 1
                logger.info("pushed step %d of session %s refused: %s", step, session.id, e)
                return
            except SwarmError as e:
                self._count(e)
                reply = wire.error_message(e, step=step)
            except Exception as e:  # boundary: a bug in one pushed step is reported to its client
                logger.exception("pushed step of session %s failed", session.id)
                self._count(SwarmError())
                reply = wire.error_message(SwarmError(f"internal error: {type(e).__name__}"), step=step)
        finally:
            slots.release()  # compute is done: a client slow to read holds no slot of the push stream
            session.pushes -= 1
        if await session.send(reply) and reply.type == wire.OUTPUT:
            self.metrics.step_replied(time.perf_counter() - received)

    def _open(self, fields: dict[str, Any]) -> Session:
        span = self._check_target(fields)
        max_length = _int(fields, "max_length", 1, self.config.max_length)
        batch = _int(fields, "batch", 1, self.config.max_batch)
        dtype = fields.get("dtype")
        if dtype not in WIRE_FLOATS:
            raise BadRequest(f"'dtype' must be one of {WIRE_FLOATS}, got {dtype!r}")
        session = self.sessions.open(span, batch, max_length, dtype, time.monotonic())
        session.cache = self.blocks.new_cache(batch, max_length, span)
        session.blocks = self.blocks
        self.metrics.opened()
        logger.debug("opened session %s: blocks %s, batch %d, max length %d", session.id, span, batch, max_length)
        return session

    async def _step(self, session: Session, msg: wire.Message) -> wire.Message:
        step = _int(msg.fields, "step", 0, 2**62)
        position = _int(msg.fields, "position", 0, session.max_length - 1)
        hidden, mask = self._hidden(msg, session.dtype, session.batch)
        # one-token steps may share a forward with other sessions' (`_compute_batch`); longer ones run alone
        key = (id(session.blocks), session.span, session.dtype) if hidden.shape[1] == 1 else None
        out, compute_ms, length, shared = await self.runtime.run(self._compute_step, session, hidden, mask, position,
                                                         timeout=self.config.step_timeout,
                                                         batch=(key, self._compute_batch, session.id, hidden.shape[0]))
        session.steps += 1
        self.metrics.stepped(hidden.shape[0] * hidden.shape[1], compute_ms / 1e3)
        if self.capacity is not None and shared == 1 and hidden.shape[0] == 1 and hidden.shape[1] == 1:
            self.capacity.observe(compute_ms, len(session.span))  # a batch-1 decode step: the announced speed
        return wire.Message(wire.OUTPUT, {"step": step, "position": position, "length": length,
                                          "compute_ms": round(compute_ms, 3)}, (wire.blob_of(out),))

    def _compute_step(self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None,
                      position: int) -> tuple[torch.Tensor, float, int, int]:
        """(output, compute ms, cache length, sessions that shared the forward: 1)."""
        cache, blocks = session.cache, session.blocks  # read once: the event loop drops them if it closes
        self._check_compute(session, hidden)
        started = time.perf_counter()
        out = blocks(hidden, cache, position, mask)
        return out.to(getattr(torch, session.dtype)), (time.perf_counter() - started) * 1e3, cache.length, 1

    def _check_compute(self, session: Session, hidden: torch.Tensor) -> None:
        if session.closed:
            raise UnknownSession(f"session {session.id} was closed")
        if not torch.isfinite(hidden).all():
            raise BadRequest("hidden states contain NaN or infinity")

    def _compute_batch(self, items: list[tuple[Session, torch.Tensor, torch.Tensor | None, int]]) -> list[Any]:
        """One-token steps of several sessions (`_compute_step`'s arguments each), on the compute thread.

        Steps at their cache's end share one forward; a step that rolls back runs alone; a bad step fails
        alone. Per item: (output, compute_ms, length) or the item's error. compute_ms of a shared forward
        is the whole forward's time, the same for every session in it.
        """
        results: list[Any] = [None] * len(items)
        shared: list[tuple[int, Any]] = []  # (item, its cache), read once: a session may close meanwhile
        blocks = None  # one batch key: the same blocks for every item
        for i, (session, hidden, mask, position) in enumerate(items):
            try:
                cache = session.cache
                blocks = session.blocks if session.blocks is not None else blocks
                self._check_compute(session, hidden)
                if position == cache.length:
                    blocks.check_step(hidden, cache, position, mask)
                    shared.append((i, cache))
                else:
                    results[i] = self._compute_step(session, hidden, mask, position)
            except Exception as e:  # boundary: one item's error goes to its own session only
                results[i] = e
        for group in _similar_lengths(shared):
            if len(group) == 1:
                try:
                    results[group[0][0]] = self._compute_step(*items[group[0][0]])
                except Exception as e:  # boundary: as above
                    results[group[0][0]] = e
                continue
            started = time.perf_counter()
            try:
                outs = blocks.decode_batch([(cache, items[i][1], items[i][2]) for i, cache in group])
            except Exception as e:  # boundary: every session of a failed forward gets its error; caches untouched
                for i, _ in group:
                    results[i] = e
                continue
            compute_ms = (time.perf_counter() - started) * 1e3
            self.metrics.batched(len(group))
            for (i, cache), out in zip(group, outs):
                results[i] = (out.to(getattr(torch, items[i][0].dtype)), compute_ms, cache.length, len(group))
        return results

    # ---- stateless forward ----

    async def serve_forward(self, stream: Stream) -> None:
        async def handle(msg: wire.Message) -> wire.Message:
            if msg.type != wire.FORWARD:
                raise BadRequest(f"expected a 'forward' message, got {msg.type!r}")
            span = self._check_target(msg.fields)
            hidden, mask = self._hidden(msg, None, self.config.max_batch)
            if hidden.shape[1] > self.config.max_length:
                raise BadRequest(f"sequences of {hidden.shape[1]} tokens exceed the limit of {self.config.max_length}")
            out, compute_ms = await self.runtime.run(self._compute_forward, span, hidden, mask,
                                                     timeout=self.config.step_timeout)
            self.metrics.forwarded(hidden.shape[0] * hidden.shape[1], compute_ms / 1e3)
            return wire.Message(wire.OUTPUT, {"compute_ms": round(compute_ms, 3)}, (wire.blob_of(out),))

        await self._one_request(stream, handle)

    def _compute_forward(self, span: Span, hidden: torch.Tensor, mask: torch.Tensor | None):
        if not torch.isfinite(hidden).all():
            raise BadRequest("hidden states contain NaN or infinity")
        started = time.perf_counter()
        out = self.blocks(hidden, None, 0, mask, span=span)
        return out.to(hidden.dtype), (time.perf_counter() - started) * 1e3

    # ---- info ----

    def info(self) -> dict[str, Any]:
        return {"peer": self.served.peer, "model": self.served.model_id, "start": self.served.span.start,
                "end": self.served.span.end, "version": self.served.version, "dtype": self.config.dtype,
                "hidden_size": self.hidden_size, "sessions": len(self.sessions.sessions),
                "max_sessions": self.config.max_sessions, "cache_tokens": self.sessions.cache_tokens,
                "cache_tokens_left": self.sessions.tokens_left, "max_length": self.config.max_length,
                "max_batch": self.config.max_batch, "queued": self.runtime.queued,
                "throughput": self.served.throughput, "prefill_tps": self.served.prefill_tps,
                "block_ms": None if self.capacity is None else round(self.capacity.decode_ms, 4),
                "draining": len(self.sessions_on(None)), "moves": self.moves,
                "errors": dict(self.errors), "wire_bytes": wire.traffic(),
                "pushes": {**self.pushes, **(self.pusher.stats() if self.pusher is not None else {})}}

    async def serve_info(self, stream: Stream) -> None:
        async def handle(msg: wire.Message) -> wire.Message:
            if msg.type != wire.INFO:
                raise BadRequest(f"expected an 'info' message, got {msg.type!r}")
            return wire.Message(wire.INFO, self.info())

        await self._one_request(stream, handle)

    async def _one_request(self, stream: Stream, handle) -> None:
        try:
            msg = await self._receive(stream, self.config.step_timeout)
        except (EOFError, asyncio.TimeoutError):
            return
        except ProtocolError as e:
            self._count(e)
            await self._send(stream, wire.error_message(e))
            return
        await self._answer(stream, handle, msg)
