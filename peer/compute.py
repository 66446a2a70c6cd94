"""The peer's compute, in one place: the device and precision, the served blocks, the sessions' caches and
the batching of decode steps. The runtime's worker thread calls it (`Runtime.run`); the servicer only
speaks the protocol. Every device runs this same code: the blocks live on `precision.device`, inputs are
decoded from their wire encoding and moved there, outputs come back encoded in the step's encoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from peer.sessions import ServedSession
from swarm.net import messages, wire
from swarm.model.blocks import SpanBlocks
from swarm.errors import BadRequest, UnknownSession
from swarm.model.precision import Precision
from swarm.span import Span

# A step of many tokens runs as jobs of one chunk each (`Prefill`), so that other sessions' decode steps run
# between them: a long prompt delays them by one chunk at most, not by its whole prefill. Each chunk is sized
# when it runs, by the peer's measured prefill speed (`chunk_tokens`): small while other sessions decode here
# (a decode step waits for one chunk at most), large while none does (a chunk reads every weight once: on the
# demo model's 10 blocks, one CPU thread, 1,024 tokens took 1.77 s in chunks of 16, 1.33 s in 32, 0.98 s in 128).
PREFILL_CHUNK = 128  # tokens of a chunk while no other session decodes (at least), or without a measurement
PREFILL_TURN_S = 0.02  # seconds of compute a chunk takes at most while other sessions decode here ...
MIN_CHUNK = 32  # ... but never fewer tokens than this
PREFILL_SOLO_S = 0.15  # seconds of compute of a chunk while none does (a session that comes waits this long once)
# A stateless forward runs as jobs of at most this many token-rows x blocks each (one row and one block at
# least), so other clients' steps run between them: 0.35 s of one demo-model CPU thread, where an 18.9 MB
# forward through 10 demo blocks takes 14 s whole. Rows and blocks see the same inputs either way (on the
# CPU the output is the same to the bit, measured on the demo model).
FORWARD_JOB_TOKENS = 2048


def chunk_tokens(prefill_tps: float | None, company: bool) -> int:
    """Tokens of the next prefill chunk (a multiple of 16): `PREFILL_TURN_S` of compute at `prefill_tps` tokens/s
    through the span, `MIN_CHUNK` at least, while other sessions decode here (`company`); else `PREFILL_SOLO_S`
    of it, `PREFILL_CHUNK` at least."""
    if not prefill_tps or prefill_tps <= 0:
        return 2 * MIN_CHUNK if company else PREFILL_CHUNK
    if company:
        return max(MIN_CHUNK, int(PREFILL_TURN_S * prefill_tps) // 16 * 16)
    return max(PREFILL_CHUNK, int(PREFILL_SOLO_S * prefill_tps) // 16 * 16)


def decode_inputs(hidden: messages.Hidden, mask: wire.Blob | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's tensors, decoded and checked: finite hidden states, a 0/1 mask."""
    x = hidden.decode()
    if not torch.isfinite(x).all():
        raise BadRequest("hidden states contain NaN or infinity")
    m = None
    if mask is not None:
        m = wire.tensor_of(mask)
        if m.dtype == torch.int64 and not ((m == 0) | (m == 1)).all():
            raise BadRequest("attention mask must hold only 0 and 1")
    return x, m


class Compute:
    """What runs on the compute thread. `blocks` is the active span's (replaced by `activate` on a move);
    a session keeps the blocks it opened with."""

    def __init__(self, precision: Precision, blocks: SpanBlocks | None, on_batch=None):
        self.precision, self.blocks = precision, blocks
        self.on_batch = on_batch  # called with the size of each shared forward (metrics)

    def open(self, session: ServedSession, batch: int, max_length: int, span: Span) -> None:
        """Give a new session its cache on the active blocks, in the rows the session table made for it."""
        session.cache = self.blocks.new_cache(batch, max_length, span, session.rows)
        session.blocks = self.blocks

    # ---- on the compute thread ----

    def step(self, session: ServedSession, step: messages.Step) -> tuple[messages.Hidden, float, int, int]:
        """(output in the step's encoding, compute ms, cache length, sessions that shared the forward: 1)."""
        cache, blocks = session.cache, session.blocks  # read once: the event loop drops them if it closes
        self._check_open(session)
        hidden, mask = decode_inputs(step.hidden, step.mask)
        started = time.perf_counter()
        out = blocks(hidden, cache, step.position, mask)
        ms = (time.perf_counter() - started) * 1e3
        return messages.Hidden.encode(out, step.hidden.encoding), ms, cache.length, 1

    def fork(self, session: ServedSession, source: ServedSession, length: int) -> None:
        """Make `session`'s cache hold positions [0, `length`) of `source`'s, and run it on the same blocks: as
        `source` is when the job runs, after its steps queued before it (`SpanCache.fork`: the full blocks shared,
        the rest paid with what the session table committed to `session`)."""
        cache = source.cache  # read once: the event loop drops it if the source closes
        self._check_open(source)
        self._check_open(session)
        if length > cache.length:
            raise BadRequest(f"'fork_length' {length} is past the end of session {source.id}: it holds {cache.length} "
                             "positions")
        committed = session.rows
        credits = committed.take_credits()
        try:
            session.cache = cache.fork(length, session.max_length, credits)
        except BaseException:
            committed.return_credits(credits)  # the session still holds them: its close gives them back
            raise
        session.rows, session.blocks = session.cache.rows, source.blocks
        committed.release()
        if session.closed:  # closed meanwhile: what the fork holds goes back too
            session.rows.release(later=True)

    def prefill(self, session: ServedSession, step: messages.Step, chunk: Callable[[], int]) -> Prefill:
        """A step of many tokens as jobs of `chunk()` tokens each, sized as each runs (`Prefill`)."""
        return Prefill(self, session, step, chunk)

    def batch(self, items: list[tuple[ServedSession, messages.Step]]) -> list[Any]:
        """One-token steps of several sessions (`step`'s arguments each).

        Steps at their cache's end share one forward, however different their lengths (each attends over its
        own history: `SpanBlocks.decode_batch`); a step that rolls back runs alone; a bad step fails alone.
        Per item: `step`'s result or the item's error. compute_ms of a shared forward is the whole forward's
        time, the same for every session in it.
        """
        results: list[Any] = [None] * len(items)
        shared: list[tuple[int, Any]] = []  # (item, its cache), read once: a session may close meanwhile
        inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        blocks = None  # one batch key: the same blocks for every item
        for i, (session, step) in enumerate(items):
            try:
                cache = session.cache
                blocks = session.blocks if session.blocks is not None else blocks
                self._check_open(session)
                if step.position == cache.length:
                    inputs[i] = decode_inputs(step.hidden, step.mask)
                    blocks.check_step(inputs[i][0], cache, step.position, inputs[i][1])
                    shared.append((i, cache))
                else:
                    results[i] = self.step(session, step)
            except Exception as e:  # boundary: one item's error goes to its own session only
                results[i] = e
        if len(shared) == 1:
            try:
                results[shared[0][0]] = self.step(*items[shared[0][0]])
            except Exception as e:  # boundary: as above
                results[shared[0][0]] = e
        elif shared:
            started = time.perf_counter()
            try:
                outs = blocks.decode_batch([(cache, *inputs[i]) for i, cache in shared])
            except Exception as e:  # boundary: every session of a failed forward gets its error; caches untouched
                return [e if r is None else r for r in results]
            compute_ms = (time.perf_counter() - started) * 1e3
            ran = sum(1 for out in outs if not isinstance(out, BaseException))
            if self.on_batch is not None and ran > 1:
                self.on_batch(ran)
            for (i, cache), out in zip(shared, outs):
                results[i] = out if isinstance(out, BaseException) else (
                    messages.Hidden.encode(out, items[i][1].hidden.encoding), compute_ms, cache.length, ran)
        return results

    def forward(self, span: Span, forward: messages.Forward) -> Forward:
        """A stateless forward of whole sequences through `span` of the active blocks, in parts."""
        return Forward(self.blocks, forward, span, forward_parts(*forward.hidden.shape[:2], span))

    @staticmethod
    def _check_open(session: ServedSession) -> None:
        if session.closed:
            raise UnknownSession(f"session {session.id} was closed")


def forward_parts(rows: int, tokens: int, span: Span) -> list[tuple[slice, Span]]:
    """The jobs of a stateless forward: (rows, blocks) of at most `FORWARD_JOB_TOKENS` token-rows x blocks
    each (one row and one block at least); each row group runs through all of `span` before the next."""
    if rows * tokens * len(span) <= FORWARD_JOB_TOKENS:
        return [(slice(0, rows), span)]
    per = max(1, min(rows, FORWARD_JOB_TOKENS // tokens))
    depth = max(1, FORWARD_JOB_TOKENS // (per * tokens))
    return [(slice(r, min(r + per, rows)), Span(b, min(b + depth, span.end)))
            for r in range(0, rows, per) for b in range(span.start, span.end, depth)]


class Forward:
    """A stateless forward through `span` as a series of `parts` (`forward_parts`), each run by `run(i)`, in
    order, as one job of the compute thread; the last returns the output in the request's encoding and the
    compute ms of all parts. It keeps the blocks it started on (a moving peer replaces the active ones)."""

    def __init__(self, blocks: SpanBlocks, request: messages.Forward, span: Span, parts: list[tuple[slice, Span]]):
        self.blocks, self.request, self.span, self.parts = blocks, request, span, parts
        self.inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.hidden: torch.Tensor | None = None  # the running row group's
        self.done: list[torch.Tensor] = []  # outputs of the row groups before it
        self.ms = 0.0

    def run(self, i: int) -> tuple[messages.Hidden, float] | None:
        if self.inputs is None:
            self.inputs = decode_inputs(self.request.hidden, self.request.mask)
        (x, mask), (rows, run) = self.inputs, self.parts[i]
        if run.start == self.span.start:
            self.hidden = x[rows]
        started = time.perf_counter()
        self.hidden = self.blocks(self.hidden, None, 0, None if mask is None else mask[rows], span=run)
        self.ms += (time.perf_counter() - started) * 1e3
        if run.end == self.span.end:
            self.done.append(self.hidden)
        if i < len(self.parts) - 1:
            return None
        return messages.Hidden.encode(torch.cat(self.done), self.request.hidden.encoding), self.ms


class Prefill:
    """A step of many tokens run as parts, each by `run()` as one job of the compute thread, in order, of `chunk()`
    tokens (called as the part runs: the peer's load decides); the last returns what `Compute.step` returns for
    the whole step, the others None. The session's cache advances part by part: a part that fails leaves it at
    the end of the parts before it (the client's next step at the step's position rolls it back)."""

    def __init__(self, compute: Compute, session: ServedSession, step: messages.Step, chunk: Callable[[], int]):
        self.compute, self.session, self.step, self.chunk = compute, session, step, chunk
        self.tokens, self.done = step.hidden.shape[1], 0
        self.inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.outs: list[torch.Tensor] = []
        self.ms = 0.0

    def run(self) -> tuple[messages.Hidden, float, int, int] | None:
        session, step = self.session, self.step
        cache, blocks = session.cache, session.blocks  # read once: the event loop drops them if it closes
        self.compute._check_open(session)
        if self.inputs is None:
            self.inputs = decode_inputs(step.hidden, step.mask)
        (x, mask), a = self.inputs, self.done
        b = min(self.tokens, a + max(1, self.chunk()))
        started = time.perf_counter()
        self.outs.append(blocks(x[:, a:b], cache, step.position + a,
                                None if mask is None else mask[:, :step.position + b]))
        self.ms += (time.perf_counter() - started) * 1e3
        self.done = b
        if b < self.tokens:
            return None
        return messages.Hidden.encode(torch.cat(self.outs, dim=1), step.hidden.encoding), self.ms, cache.length, 1
