"""Talking to one peer: open a session and step it, a stateless forward, an info call.

The lowest layer of the client SDK. Every reply is checked (`swarm.calls.exchange`): an ERROR
message becomes its typed error (so callers can tell "reroute" from "give up"), and an output whose
step id or shape does not match the request is a `ProtocolError`, never silently used. The info call
is `swarm.calls.info`, re-exported here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import torch

from swarm import wire
from swarm.calls import MAX_REPLY_BYTES, exchange, info, raise_if_error
from swarm.errors import ConnectionLost, ProtocolError, StepTimeout
from swarm.span import Span
from swarm.transport import Node, Stream

__all__ = ["PeerSession", "forward", "info"]

MAX_STALE_REPLIES = 8  # replies to earlier steps skipped while waiting for one step's output


def _tensors(hidden: torch.Tensor, mask: torch.Tensor | None) -> tuple[wire.Blob, ...]:
    return (wire.blob_of(hidden),) + ((wire.blob_of(mask),) if mask is not None else ())


class PeerSession:
    """An inference session with one peer over one stream: `async with await PeerSession.open(...)`."""

    def __init__(self, stream: Stream, opened: dict[str, Any], dtype: torch.dtype, timeout: float):
        self.stream, self.opened, self.dtype, self.timeout = stream, opened, dtype, timeout
        self.id: str = opened["session"]
        self.span = Span(opened["start"], opened["end"])
        self._steps = itertools.count()
        self.last_compute_ms = 0.0
        self.pushed = False  # whether the last output was also pushed on to the next peer

    @classmethod
    async def open(cls, node: Node, peer: str, model: str, span: Span, *, max_length: int, batch: int = 1,
                   dtype: torch.dtype = torch.float32, timeout: float = 30.0) -> PeerSession:
        stream = await node.open(peer, wire.SESSION_PROTOCOL)
        try:
            reply = await exchange(stream, wire.Message(wire.OPEN, {
                "model": model, "start": span.start, "end": span.end, "max_length": max_length, "batch": batch,
                "dtype": str(dtype).removeprefix("torch.")}), timeout)
            if reply.type != wire.OPENED or not isinstance(reply.fields.get("session"), str):
                raise ProtocolError(f"peer {peer} answered 'open' with {reply.type!r}")
        except BaseException:
            await stream.aclose()
            raise
        return cls(stream, reply.fields, dtype, timeout)

    async def step(self, hidden: torch.Tensor, position: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run `hidden` [batch, tokens, hidden] at `position` (below the cache length: roll back first)."""
        step = await self.send(hidden, position, attention_mask)
        return await self.receive(step, tuple(hidden.shape), self.timeout)

    def reserve(self) -> int:
        """A step id for a step that another peer will push into this session."""
        return next(self._steps)

    async def send(self, hidden: torch.Tensor, position: int, attention_mask: torch.Tensor | None = None, *,
                   step: int | None = None, chain: list[dict] | None = None) -> int:
        """Send a step without waiting for its output; its step id. With `chain` ({peer, session, step} of
        the hops after this one), the peer pushes its output on to the next of them."""
        step = next(self._steps) if step is None else step
        fields = {"step": step, "position": position, **({"next": chain} if chain else {})}
        try:
            await wire.write_message(self.stream.writer, wire.Message(wire.STEP, fields, _tensors(
                hidden.to(self.dtype), attention_mask)))
        except (ConnectionError, OSError) as e:
            raise ConnectionLost(f"peer {self.stream.remote} closed the stream ({type(e).__name__})") from None
        return step

    async def receive(self, step: int, shape: tuple[int, ...], timeout: float) -> torch.Tensor:
        """The output of step `step`, expected of `shape`. Replies to earlier steps (a pushed step that
        arrived after the client relayed it) are skipped; an ERROR for this step is raised as its typed error."""
        deadline = time.monotonic() + timeout
        for _ in range(MAX_STALE_REPLIES + 1):
            try:
                reply = await asyncio.wait_for(wire.read_message(self.stream.reader, MAX_REPLY_BYTES),
                                               max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # before OSError: on 3.11 it is the builtin TimeoutError
                raise StepTimeout(f"peer {self.stream.remote} sent no output for step {step} within "
                                  f"{timeout:.1f} s") from None
            except (EOFError, ConnectionError, OSError):
                raise ConnectionLost(f"peer {self.stream.remote} closed the stream without a reply") from None
            got = reply.fields.get("step")
            if type(got) is int and got < step:
                continue
            raise_if_error(reply)
            if reply.type != wire.OUTPUT or got != step or len(reply.tensors) != 1:
                raise ProtocolError(f"peer {self.stream.remote} answered step {step} with {reply.type!r} "
                                    f"for step {got!r}")
            out = wire.tensor_of(reply.tensors[0])
            if tuple(out.shape) != tuple(shape):
                raise ProtocolError(f"peer {self.stream.remote} returned shape {list(out.shape)} for {list(shape)}")
            self.last_compute_ms = float(reply.fields.get("compute_ms", 0.0))
            self.pushed = reply.fields.get("pushed") is True
            return out
        raise ProtocolError(f"peer {self.stream.remote} sent more than {MAX_STALE_REPLIES} stale replies")

    async def close(self) -> None:
        try:
            await wire.write_message(self.stream.writer, wire.Message(wire.CLOSE))
        except (ConnectionError, OSError):
            pass  # the peer is gone: nothing to close
        await self.stream.aclose()

    async def __aenter__(self) -> PeerSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def forward(node: Node, peer: str, model: str, span: Span, hidden: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, timeout: float = 60.0) -> torch.Tensor:
    """A stateless forward of whole sequences through `span` on `peer`."""
    stream = await node.open(peer, wire.FORWARD_PROTOCOL)
    try:
        reply = await exchange(stream, wire.Message(wire.FORWARD, {"model": model, "start": span.start,
                                                                   "end": span.end},
                                                    _tensors(hidden, attention_mask)), timeout)
    finally:
        await stream.aclose()
    if reply.type != wire.OUTPUT or len(reply.tensors) != 1:
        raise ProtocolError(f"peer {peer} answered 'forward' with {reply.type!r}")
    out = wire.tensor_of(reply.tensors[0])
    if out.shape != hidden.shape:
        raise ProtocolError(f"peer {peer} returned shape {list(out.shape)} for {list(hidden.shape)}")
    return out
