"""The peer's network side: decodes requests, checks them, submits compute, encodes replies.

One error policy for every protocol: a `SwarmError` becomes an ERROR message with its code and the
stream goes on (a session survives a bad step: its cache is untouched); a framing error
(`ProtocolError`) is answered, then the stream is closed, since the byte stream cannot be trusted
any more; anything else is logged and answered as `internal`. Nothing a client sends can stop the
peer from serving others. Events and their timings go to `PeerMetrics`; errors are counted in `_count`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

from peer.compute import Compute, chunk_tokens
from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.push import Pusher
from peer.pushed import PushedSteps
from peer.runtime import Batch, ClientSlots, Runtime
from peer.sessions import ServedSession, SessionTable
from swarm.net import messages, wire
from swarm.model import kv
from swarm.model.blocks import SpanBlocks
from swarm.errors import BadRequest, Busy, NotServing, ProtocolError, SwarmError, UnknownSession
from swarm.net.integrity import input_digest
from swarm.model.precision import Precision
from swarm.span import Span
from swarm.net.transport import Stream, describe_peer

logger = logging.getLogger(__name__)



def check_chain(chain: tuple[messages.ChainHop, ...] | None, own_id: str) -> tuple[messages.ChainHop, ...] | None:
    """A step's `next`, checked beyond its form: each peer at most once and never this peer, so a chain
    cannot loop and one request costs every named peer at most one step."""
    if chain is None:
        return None
    seen = {own_id}
    for hop in chain:
        if hop.peer in seen:
            raise BadRequest(f"'next' names peer {describe_peer(hop.peer)} twice, or this peer itself")
        seen.add(hop.peer)
    return chain


@dataclass
class Served:
    peer: str
    model_id: str
    span: Span
    version: str
    throughput: float = 0.0
    prefill_tps: float = 0.0
    digest: str | None = None  # which weights (swarm.weights.digest); requests naming others are refused


class Servicer:
    def __init__(self, config: PeerConfig, served: Served, blocks: SpanBlocks, runtime: Runtime,
                 sessions: SessionTable, metrics: PeerMetrics, precision: Precision | None = None):
        self.config, self.served, self.runtime, self.sessions = config, served, runtime, sessions
        self.metrics = metrics
        self.precision = precision or blocks.precision
        self.compute = Compute(self.precision, blocks, on_batch=metrics.batched)
        self.hidden_size = blocks.hidden_size  # the model's: the same whatever span is served, also mid-move
        self.errors: dict[str, int] = {}
        self.pusher: Pusher | None = None  # set by the server once its node runs
        self.pushed = PushedSteps(self)  # steps the previous peer of a client's route pushes here
        self.capacity = None  # peer.capacity.Capacity, set by the server: follows the real decode steps
        self.moves = 0  # spans this peer moved to since it started
        self.moving = False  # loading a new span after dropping the old one: nothing new is accepted
        self.forwards = ClientSlots(config.client_forwards, "forwards")  # per client, in compute or queued

    # ---- the served span ----

    @property
    def blocks(self) -> SpanBlocks | None:
        return self.compute.blocks

    @blocks.setter
    def blocks(self, blocks: SpanBlocks | None) -> None:
        self.compute.blocks = blocks

    def activate(self, blocks: SpanBlocks, span: Span) -> None:
        """Serve `blocks` for `span` from now on: new sessions and forwards use them; sessions already open
        keep running on the blocks they opened with until they close (a moving peer drains its old span)."""
        self.blocks, self.served.span = blocks, span

    def sessions_on(self, blocks: SpanBlocks | None) -> list[ServedSession]:
        """Open sessions running on `blocks` (None: on any blocks but the active ones)."""
        return [s for s in self.sessions.sessions.values()
                if (s.blocks is blocks if blocks is not None else s.blocks is not self.blocks)]

    # ---- shared checks ----

    def _check_target(self, model: str, start: int, end: int, digest: str | None = None) -> Span:
        if self.moving:
            raise NotServing(f"this peer is moving to blocks {self.served.span} and serves nothing new until they "
                             "load; try another peer")
        if model != self.served.model_id:
            raise NotServing(f"this peer serves model {self.served.model_id!r}, not {model!r}")
        if digest is not None and self.served.digest is not None and digest != self.served.digest:
            raise NotServing(f"this peer serves other weights of {model!r} ({self.served.digest[:12]}), not "
                             f"{digest[:12]}")
        span = Span(start, end)
        if not (self.served.span.start <= start and end <= self.served.span.end):
            raise NotServing(f"blocks {span} are not within the served blocks {self.served.span}")
        return span

    def _check_hidden(self, hidden: messages.Hidden, encodings: tuple[str, ...], batch_max: int) -> None:
        if hidden.encoding not in encodings:
            raise BadRequest(f"hidden states must be encoded as {' or '.join(encodings)}, got {hidden.encoding}")
        size, shape = self.hidden_size, hidden.shape
        if shape[2] != size or not 1 <= shape[0] <= batch_max or shape[1] < 1:
            raise BadRequest(f"hidden states must be [batch <= {batch_max}, tokens >= 1, {size}], got {list(shape)}")

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
            reply = messages.Error.of(e, msg.fields.get("step")).to_message()
            keep = not isinstance(e, (ProtocolError, UnknownSession))
        except Exception as e:  # boundary: a bug in one request is reported, the peer keeps serving
            logger.exception("request %s from %s failed", msg.type, describe_peer(stream.remote))
            self._count(SwarmError())
            reply = messages.Error.of(SwarmError(f"internal error: {type(e).__name__}")).to_message()
        if not await (send(reply) if send is not None else self._send(stream, reply)):
            logger.debug("%s went away before the reply to %s", describe_peer(stream.remote), msg.type)
            return False  # a client that left is not an error of ours
        if msg.type == wire.STEP and reply.type == wire.OUTPUT:
            self.metrics.step_replied(time.perf_counter() - received)
        return keep

    # ---- session protocol ----

    def guarded(self, handler):
        """`handler` for streams of peers not on `--block-peers`; a blocked peer is answered `not_serving`."""
        async def serve(stream: Stream) -> None:
            if stream.remote in self.config.block_peers:
                self._count(NotServing())
                # its first message is read first: closing a stream with unread input would lose the answer
                with contextlib.suppress(Exception):
                    await self._receive(stream, 5.0)
                await self._send(stream, messages.Error.of(NotServing("this peer does not serve you")).to_message())
                return
            await handler(stream)

        return serve

    async def serve_session(self, stream: Stream) -> None:
        session: ServedSession | None = None  # once closed (idle, reclaimed, drained) the next message learns why
        lock = asyncio.Lock()  # replies come from this handler and from steps pushed into the session

        async def send(msg: wire.Message) -> bool:
            async with lock:
                return await self._send(stream, msg)

        async def handle(msg: wire.Message) -> wire.Message:
            nonlocal session
            if msg.type == wire.OPEN:
                if session is not None:
                    raise BadRequest("a session is already open on this stream")
                request = messages.Open.from_message(msg)
                session = self._open(request, stream.remote) if request.fork is None else \
                    await self._fork(request, stream.remote)
                self.metrics.opened()
                session.send = send
                return messages.Opened(session.id, session.span.start, session.span.end, session.batch,
                                   session.max_length, session.encodings,
                                   self.sessions.available(session.client, time.monotonic()),
                                   self.precision.dtype, self.precision.quant,
                                   self.precision.device_kind, session.push_key,
                                   request.fork_length).to_message()
            if msg.type == wire.STEP:
                if session is None:
                    raise UnknownSession("no session is open on this stream: send 'open' first")
                if session.closed:
                    raise UnknownSession(f"session {session.id} {session.why}; open a new one")
                return await self._chained_step(session, messages.Step.from_message(msg))
            raise BadRequest(f"unexpected message {msg.type!r} in a session")

        # A read is never cancelled midway (that would tear a message): it waits while steps pushed by
        # peers keep the session busy, and the idle clock counts from the last step of either kind.
        read: asyncio.Future | None = None
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(wire.read_message(stream.reader, self.config.max_request_bytes))
                wait = self.config.idle_timeout
                if session is not None and not session.closed and not session.inflight:
                    wait = max(0.0, session.used_at + self.config.idle_timeout - time.monotonic())
                done, _ = await asyncio.wait({read}, timeout=wait)
                if not done:
                    if session is None or session.closed:
                        return  # silent twice over (or never opened): drop the stream
                    if session.idle_for(time.monotonic()) < self.config.idle_timeout:
                        continue
                    logger.info("session %s idle for %.0f s: cache reclaimed", session.id, self.config.idle_timeout)
                    self.sessions.close(session.id, f"was idle for more than {self.config.idle_timeout:.0f} s and "
                                        "its cache was reclaimed")
                    continue
                finished, read = read, None
                try:
                    msg = finished.result()
                except EOFError:
                    return
                except ProtocolError as e:
                    self._count(e)
                    await send(messages.Error.of(e).to_message())
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

    async def _chained_step(self, session: ServedSession, step: messages.Step) -> wire.Message:
        """A step from the session's client or pushed by the previous peer. With `next` (the rest of the
        client's route), the output is pushed on to the next peer before the reply says whether it left."""
        chain = check_chain(step.next, self.served.peer)
        # the client's own steps are never refused for their id: a push cannot lock the client out
        session.last_step = max(session.last_step, step.step)
        session.end = step.position + step.hidden.shape[1]
        session.used_at = time.monotonic()
        output = await self._step(session, step)
        if chain is not None:
            reason = await self._push(step, output, chain)
            output = dataclasses.replace(output, pushed=reason is None, push_error=reason)
        return output.to_message()

    async def _push(self, step: messages.Step, output: messages.Output, chain: tuple[messages.ChainHop, ...]) -> str | None:
        if self.pusher is None or not self.config.push:
            return "disabled"
        first, rest = chain[0], chain[1:]
        if first.peer in self.config.block_peers:
            return "blocked"
        # the output, in the step's encoding, and the step's attention mask if it had one
        push = messages.Push(first.session, first.step, first.tag, step.position, output.hidden, step.mask,
                             rest or None)
        return await self.pusher.push(first.peer, push.to_message())

    # ---- push protocol: steps from the previous peer of a client's route (`peer.pushed`) ----

    async def serve_push(self, stream: Stream) -> None:
        await self.pushed.serve(stream)

    def _check_request(self, request: messages.Open) -> Span:
        span = self._check_target(request.model, request.start, request.end, request.digest)
        if request.max_length > self.config.max_length:
            raise BadRequest(f"'max_length' must be an integer in [1, {self.config.max_length}], got "
                             f"{request.max_length}")
        if request.batch > self.config.max_batch:
            raise BadRequest(f"'batch' must be an integer in [1, {self.config.max_batch}], got {request.batch}")
        return span

    def _open(self, request: messages.Open, client: str = "") -> ServedSession:
        """A new session of `client` (the stream's authenticated peer), its cache committed as it grows."""
        span = self._check_request(request)
        session = self.sessions.open(span, request.batch, request.max_length, request.encodings, time.monotonic(),
                                     client, self.blocks.pool)
        self.compute.open(session, request.batch, request.max_length, span)
        logger.debug("opened session %s: blocks %s, batch %d, max length %d, %s on the wire", session.id, span,
                     request.batch, request.max_length, "/".join(request.encodings))
        return session

    async def _fork(self, request: messages.Open, client: str) -> ServedSession:
        """`_open`'s session, its cache a copy of positions [0, fork_length) of `client`'s session `request.fork`
        here, made by the compute thread after the source's steps queued before it. A prefix shared by several
        sessions is computed once. Refused (nothing left open): a source that is not this client's open
        session; another span or batch; positions it does not hold; the cache it would need."""
        span, length = self._check_request(request), request.fork_length
        source = self.sessions.get(request.fork, client)
        if source.span != span or source.batch != request.batch:
            raise BadRequest(f"session {source.id} holds blocks {source.span} for batch {source.batch}: a fork of it "
                             f"must ask for the same, not blocks {span} for batch {request.batch}")
        if source.blocks is not self.blocks:
            raise NotServing(f"session {source.id} runs on blocks this peer has moved away from; open a new session")
        if length > source.end:  # checked again by the compute thread, after the source's steps queued before
            raise BadRequest(f"'fork_length' {length} is past the end of session {source.id}: it holds {source.end} "
                             "positions")
        source.inflight += 1  # busy while copied: never reclaimed to make room for its own fork
        try:
            # what the fork holds beyond the source's full blocks is committed now, before anything is allocated
            session = self.sessions.open(span, request.batch, request.max_length, request.encodings, time.monotonic(),
                                         client, source.rows.pool, shared=length)
            try:
                await self.runtime.run(self.compute.fork, session, source, length, timeout=self.config.step_timeout,
                                       batch=Batch(None, None, source.id), client=client)  # owner: after its steps
                if session.closed:
                    raise UnknownSession(f"session {session.id} {session.why}; open a new one")
            except BaseException:
                self.sessions.close(session.id, "was refused")
                raise
        finally:
            source.inflight -= 1
            source.used_at = time.monotonic()
        session.end = length
        self.metrics.forked(session.batch * length)
        return session

    async def _step(self, session: ServedSession, step: messages.Step) -> messages.Output:
        if step.position >= session.max_length:
            raise BadRequest(f"'position' must be an integer in [0, {session.max_length - 1}], got {step.position}")
        self._check_hidden(step.hidden, session.encodings, session.batch)
        batch, tokens = step.hidden.shape[:2]
        self.sessions.grow(session, step.position + tokens, time.monotonic())  # OutOfCache: the client fails over
        # one-token steps may share a forward with other sessions' (`Compute.batch`); longer ones run alone, a long
        # one in chunks with other sessions' steps between them
        key = (id(session.blocks), session.span, step.hidden.encoding) if tokens == 1 else None
        # recurrent blocks keep a snapshot per step end: their prompts run whole, not one snapshot per chunk
        chunk = tokens if session.blocks.recurrent else chunk_tokens(self.served.prefill_tps, company=True)
        session.inflight += 1
        try:
            if tokens > chunk:
                out, compute_ms, length, shared = await self._prefill(session, step)
            else:
                out, compute_ms, length, shared = await self.runtime.run(
                    self.compute.step, session, step, timeout=self.config.step_timeout,
                    batch=(key, self.compute.batch, session.id, batch), client=session.client)
        finally:
            session.inflight -= 1
            session.used_at = time.monotonic()
        session.steps += 1
        self.metrics.stepped(batch * tokens, compute_ms / 1e3)
        if self.capacity is not None and shared == 1 and batch == 1 and tokens == 1:
            self.capacity.observe(compute_ms, len(session.span))  # a batch-1 decode step: the announced speed
        return messages.Output(out, compute_ms, step.step, step.position, length,
                               input=input_digest(step.position, step.hidden, step.mask))

    async def _prefill(self, session: ServedSession, step: messages.Step):
        """A long step as one compute job per chunk (`Compute.prefill`), in the session's fair turn, within one step
        timeout in all; small chunks while other sessions decode here, large ones while none does."""
        def chunk() -> int:
            return chunk_tokens(self.served.prefill_tps, company=self.runtime.decoding(besides=session.id))

        job, deadline = self.compute.prefill(session, step, chunk), time.monotonic() + self.config.step_timeout
        result = None
        for _ in range(job.tokens):  # a part runs one token at least
            result = await self.runtime.run(job.run, timeout=max(0.0, deadline - time.monotonic()),
                                            batch=Batch(None, None, session.id, later=True), client=session.client)
            if result is not None:
                break
        return result

    # ---- stateless forward ----

    async def serve_forward(self, stream: Stream) -> None:
        async def handle(msg: wire.Message) -> wire.Message:
            request = messages.Forward.from_message(msg)
            span = self._check_target(request.model, request.start, request.end, request.digest)
            self._check_hidden(request.hidden, messages.ENCODINGS, self.config.max_batch)
            batch, tokens = request.hidden.shape[:2]
            if tokens > self.config.max_length:
                raise BadRequest(f"sequences of {tokens} tokens exceed the limit of {self.config.max_length}")
            job, deadline = self.compute.forward(span, request), time.monotonic() + self.config.step_timeout
            for part in range(len(job.parts)):  # one job per part: other clients' steps run in between
                result = await self.runtime.run(job.run, part, timeout=max(0.0, deadline - time.monotonic()),
                                                client=stream.remote)
            out, compute_ms = result
            self.metrics.forwarded(batch * tokens, compute_ms / 1e3)
            return messages.Output(out, compute_ms).to_message()

        # the request is read only in the client's turn: its other forwards' bytes wait on the network
        try:
            async with self.forwards.hold(stream.remote, self.config.step_timeout):
                await self._one_request(stream, handle)
        except Busy as e:
            self._count(e)
            await self._send(stream, messages.Error.of(e).to_message())

    # ---- info ----

    def info(self) -> messages.Info:
        return messages.Info(
            self.served.peer, self.served.model_id, self.served.span.start, self.served.span.end, self.served.version,
            self.precision.dtype, self.precision.quant, self.precision.device_kind, self.hidden_size,
            len(self.sessions.sessions), self.config.max_sessions, self.sessions.cache_tokens,
            self.sessions.tokens_left, self.config.max_length, self.config.max_batch, self.runtime.queued,
            self.served.throughput, self.served.prefill_tps,
            None if self.capacity is None else round(self.capacity.decode_ms, 4), len(self.sessions_on(None)),
            self.moves, dict(self.errors), wire.traffic(),
            {**self.pushed.counts, **(self.pusher.stats() if self.pusher is not None else {})})

    def cache_memory(self) -> dict[str, int]:
        """The memory of the cache pools the active blocks and the open sessions use (`swarm.model.kv.memory`)."""
        pools = [s.rows.pool for s in self.sessions.sessions.values() if s.rows is not None]
        return kv.memory(pools + ([self.blocks.pool] if self.blocks is not None else []))

    async def serve_info(self, stream: Stream) -> None:
        async def handle(msg: wire.Message) -> wire.Message:
            messages.InfoRequest.from_message(msg)
            return self.info().to_message()

        await self._one_request(stream, handle)

    async def _one_request(self, stream: Stream, handle) -> None:
        try:
            msg = await self._receive(stream, self.config.step_timeout)
        except (EOFError, asyncio.TimeoutError):
            return
        except ProtocolError as e:
            self._count(e)
            await self._send(stream, messages.Error.of(e).to_message())
            return
        await self._answer(stream, handle, msg)
