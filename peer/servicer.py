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
from peer.sessions import Session, SessionTable
from swarm import wire
from swarm.blocks import SpanBlocks
from swarm.errors import BadRequest, NotServing, ProtocolError, SwarmError, UnknownSession
from swarm.span import Span
from swarm.transport import Stream, describe_peer

logger = logging.getLogger(__name__)

WIRE_FLOATS = ("float32", "float16", "bfloat16")


def _int(fields: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = fields.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


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
        self.errors: dict[str, int] = {}

    # ---- shared checks ----

    def _check_target(self, fields: dict[str, Any]) -> Span:
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
        size = self.blocks.hidden_size
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

    async def _answer(self, stream: Stream, handle, msg: wire.Message) -> bool:
        """Run `handle(msg)` and send its reply or its error; False if the stream must end."""
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
        if not await self._send(stream, reply):
            logger.debug("%s went away before the reply to %s", describe_peer(stream.remote), msg.type)
            return False  # a client that left is not an error of ours
        if msg.type == wire.STEP and reply.type == wire.OUTPUT:
            self.metrics.step_replied(time.perf_counter() - received)
        return keep

    # ---- session protocol ----

    async def serve_session(self, stream: Stream) -> None:
        session: Session | None = None
        reclaimed = False  # the session went idle: its cache is freed, the next message learns why

        async def handle(msg: wire.Message) -> wire.Message:
            nonlocal session
            if msg.type == wire.OPEN:
                if session is not None:
                    raise BadRequest("a session is already open on this stream")
                session = self._open(msg.fields)
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
                return await self._step(self.sessions.get(session.id), msg)
            raise BadRequest(f"unexpected message {msg.type!r} in a session")

        try:
            while True:
                try:
                    msg = await self._receive(stream, self.config.idle_timeout)
                except asyncio.TimeoutError:
                    if session is None or reclaimed:
                        return  # silent twice over (or never opened): drop the stream
                    logger.info("session %s idle for %.0f s: cache reclaimed", session.id, self.config.idle_timeout)
                    self.sessions.close(session.id)
                    reclaimed = True
                    continue
                except EOFError:
                    return
                except ProtocolError as e:
                    self._count(e)
                    await self._send(stream, wire.error_message(e))
                    return
                if msg.type == wire.CLOSE:
                    return
                if not await self._answer(stream, handle, msg):
                    return
        finally:
            if session is not None:
                self.sessions.close(session.id)

    def _open(self, fields: dict[str, Any]) -> Session:
        span = self._check_target(fields)
        max_length = _int(fields, "max_length", 1, self.config.max_length)
        batch = _int(fields, "batch", 1, self.config.max_batch)
        dtype = fields.get("dtype")
        if dtype not in WIRE_FLOATS:
            raise BadRequest(f"'dtype' must be one of {WIRE_FLOATS}, got {dtype!r}")
        session = self.sessions.open(span, batch, max_length, dtype, time.monotonic())
        session.cache = self.blocks.new_cache(batch, max_length, span)
        self.metrics.opened()
        logger.debug("opened session %s: blocks %s, batch %d, max length %d", session.id, span, batch, max_length)
        return session

    async def _step(self, session: Session, msg: wire.Message) -> wire.Message:
        step = _int(msg.fields, "step", 0, 2**62)
        position = _int(msg.fields, "position", 0, session.max_length - 1)
        hidden, mask = self._hidden(msg, session.dtype, session.batch)
        out, compute_ms, length = await self.runtime.run(self._compute_step, session, hidden, mask, position,
                                                         timeout=self.config.step_timeout)
        session.steps += 1
        self.metrics.stepped(hidden.shape[0] * hidden.shape[1], compute_ms / 1e3)
        return wire.Message(wire.OUTPUT, {"step": step, "position": position, "length": length,
                                          "compute_ms": round(compute_ms, 3)}, (wire.blob_of(out),))

    def _compute_step(self, session: Session, hidden: torch.Tensor, mask: torch.Tensor | None,
                      position: int) -> tuple[torch.Tensor, float, int]:
        if session.closed:
            raise UnknownSession(f"session {session.id} was closed")
        if not torch.isfinite(hidden).all():
            raise BadRequest("hidden states contain NaN or infinity")
        started = time.perf_counter()
        out = self.blocks(hidden, session.cache, position, mask)
        return out.to(getattr(torch, session.dtype)), (time.perf_counter() - started) * 1e3, session.cache.length

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
                "hidden_size": self.blocks.hidden_size, "sessions": len(self.sessions.sessions),
                "max_sessions": self.config.max_sessions, "cache_tokens": self.sessions.cache_tokens,
                "cache_tokens_left": self.sessions.tokens_left, "max_length": self.config.max_length,
                "max_batch": self.config.max_batch, "queued": self.runtime.queued,
                "throughput": self.served.throughput, "prefill_tps": self.served.prefill_tps,
                "errors": dict(self.errors)}

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
