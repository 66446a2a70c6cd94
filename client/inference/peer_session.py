"""Talking to one peer: open a session and step it, a stateless forward, an info call.

The lowest layer of the client SDK. Every reply is checked (`swarm.net.calls.exchange`): an ERROR
message becomes its typed error (so callers can tell "reroute" from "give up"), and an output whose
step id or shape does not match the request is a `ProtocolError`, never silently used. A session
step's output names what the peer computed on (`swarm.net.integrity.input_digest`): for a step the client
sent, it must be what was sent (else `ProtocolError`); for a step another peer pushed, the caller says
what it must be (the previous hop's output), else `ChainMismatch`. The info call is `swarm.net.calls.info`,
re-exported here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import torch

from swarm.net import messages, wire
from swarm.net.calls import MAX_REPLY_BYTES, decode_reply, exchange, info, raise_if_error
from swarm.errors import BadRequest, ChainMismatch, ConnectionLost, ProtocolError, StepTimeout
from swarm.net.integrity import input_digest, push_tag
from swarm.span import Span
from swarm.net.transport import Node, Stream

__all__ = ["PeerSession", "forward", "info"]

MAX_STALE_REPLIES = 8  # replies to earlier steps skipped while waiting for one step's output
MAX_SENT = 64  # digests of sent steps kept until their output arrives


def _mask(mask: torch.Tensor | None) -> wire.Blob | None:
    return None if mask is None else wire.blob_of(mask)


class PeerSession:
    """An inference session with one peer over one stream: `async with await PeerSession.open(...)`."""

    def __init__(self, stream: Stream, opened: messages.Opened, timeout: float):
        self.stream, self.opened, self.timeout = stream, opened, timeout
        self.id: str = opened.session
        self.span = Span(opened.start, opened.end)
        self._steps = itertools.count()
        self._sent: dict[int, str] = {}  # step id -> digest of what we sent, until its output arrives
        self.last_compute_ms = 0.0
        self.pushed = False  # whether the last output was also pushed on to the next peer
        self.last_output: messages.Output | None = None  # as received: its hidden states are what was pushed on

    @classmethod
    async def open(cls, node: Node, peer: str, model: str, span: Span, *, max_length: int, batch: int = 1,
                   encodings: tuple[str, ...] = ("float32",), timeout: float = 30.0,
                   digest: str | None = None, fork: tuple[str, int] | None = None) -> PeerSession:
        """Open a session whose steps may use any of `encodings` (`swarm.net.messages.ENCODINGS`). With `fork`
        (the `id` of another session of this client at this peer, and a length), its cache starts as a copy of
        that session's first `length` positions: its first step is at `length`."""
        fork_id, fork_length = fork if fork is not None else (None, None)
        stream = await node.open(peer, wire.SESSION_PROTOCOL)
        try:
            request = messages.Open(model, span.start, span.end, max_length, batch, tuple(encodings), digest,
                                    fork=fork_id, fork_length=fork_length)
            reply = await exchange(stream, request.to_message(), timeout)
            opened = decode_reply(messages.Opened, reply, peer, "open")
            if fork_length is not None and opened.forked != fork_length:  # an older peer: an empty session
                raise BadRequest(f"peer {peer} opened session {opened.session} without copying {fork_id}: it cannot "
                                 "fork sessions")
        except BaseException:
            await stream.aclose()
            raise
        return cls(stream, opened, timeout)

    async def step(self, hidden: torch.Tensor, position: int, attention_mask: torch.Tensor | None = None,
                   encoding: str = "float32", digest: str | None = None) -> torch.Tensor:
        """Run `hidden` [batch, tokens, hidden] at `position` (below the cache length: roll back first)."""
        step = await self.send(hidden, position, attention_mask, encoding=encoding)
        return await self.receive(step, tuple(hidden.shape), self.timeout)

    def reserve(self) -> int:
        """A step id for a step that another peer will push into this session."""
        return next(self._steps)

    def chain_hop(self, sender: str) -> messages.ChainHop:
        """This session as a later hop of a chained step that peer `sender` pushes into it."""
        step = self.reserve()
        return messages.ChainHop(self.stream.remote, self.id, step,
                                 push_tag(self.opened.push_key, self.id, step, sender))

    async def send(self, hidden: torch.Tensor, position: int, attention_mask: torch.Tensor | None = None, *,
                   step: int | None = None, chain: list[messages.ChainHop] | None = None,
                   encoding: str = "float32") -> int:
        """Send a step without waiting for its output; its step id. With `chain` (the hops after this one),
        the peer pushes its output on to the next of them. The peer decodes `swarm.net.hidden.round_trip(hidden,
        encoding)`; its output comes back in the same encoding."""
        step = next(self._steps) if step is None else step
        msg = messages.Step(step, position, messages.Hidden.encode(hidden, encoding), _mask(attention_mask),
                        tuple(chain) if chain else None)
        if len(self._sent) >= MAX_SENT:
            self._sent.pop(next(iter(self._sent)))
        self._sent[step] = input_digest(position, msg.hidden, msg.mask)
        try:
            await wire.write_message(self.stream.writer, msg.to_message())
        except (ConnectionError, OSError) as e:
            raise ConnectionLost(f"peer {self.stream.remote} closed the stream ({type(e).__name__})") from None
        return step

    async def receive(self, step: int, shape: tuple[int, ...], timeout: float,
                      expected_input: str | None = None) -> torch.Tensor:
        """The output of step `step`, expected of `shape`, decoded. Replies to earlier steps (a pushed step that
        arrived after the client relayed it) are skipped; an ERROR for this step is raised as its typed error.
        `expected_input`: the digest of what a pushed step must have computed on."""
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
            if reply.type != wire.OUTPUT or got != step:
                raise ProtocolError(f"peer {self.stream.remote} answered step {step} with {reply.type!r} "
                                    f"for step {got!r}")
            output, out = _output(reply, self.stream.remote, shape)
            self._check_input(step, output.input, expected_input)
            self.last_output = output
            self.last_compute_ms = output.compute_ms
            self.pushed = output.pushed is True
            return out
        raise ProtocolError(f"peer {self.stream.remote} sent more than {MAX_STALE_REPLIES} stale replies")

    def _check_input(self, step: int, got: str | None, expected: str | None) -> None:
        sent = self._sent.pop(step, None)
        if got is None:
            raise ProtocolError(f"peer {self.stream.remote} did not say what step {step} computed on")
        if sent is not None and got != sent:
            raise ProtocolError(f"peer {self.stream.remote} says step {step} computed on other input than was sent")
        if sent is None and expected is not None and got != expected:
            raise ChainMismatch(f"peer {self.stream.remote} computed step {step} on other input than the previous "
                                "hop's output")

    async def close(self) -> None:
        try:
            await wire.write_message(self.stream.writer, messages.Close().to_message())
        except (ConnectionError, OSError):
            pass  # the peer is gone: nothing to close
        await self.stream.aclose()

    async def __aenter__(self) -> PeerSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _output(reply: wire.Message, peer: str, shape: tuple[int, ...]) -> tuple[messages.Output, torch.Tensor]:
    """The reply as an output of `shape`, and its hidden states decoded; a `ProtocolError` if malformed."""
    output = decode_reply(messages.Output, reply, peer, "a step")
    if tuple(output.hidden.shape) != tuple(shape):
        raise ProtocolError(f"peer {peer} returned shape {list(output.hidden.shape)} for {list(shape)}")
    try:
        return output, output.hidden.decode()
    except BadRequest as e:
        raise ProtocolError(f"peer {peer} sent a malformed output: {e}") from None


async def forward(node: Node, peer: str, model: str, span: Span, hidden: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, timeout: float = 60.0,
                  encoding: str = "float32", digest: str | None = None) -> torch.Tensor:
    """A stateless forward of whole sequences through `span` on `peer`."""
    stream = await node.open(peer, wire.FORWARD_PROTOCOL)
    try:
        request = messages.Forward(model, span.start, span.end, messages.Hidden.encode(hidden, encoding),
                                   _mask(attention_mask), digest)
        reply = await exchange(stream, request.to_message(), timeout)
    finally:
        await stream.aclose()
    if reply.type != wire.OUTPUT:
        raise ProtocolError(f"peer {peer} answered 'forward' with {reply.type!r}")
    return _output(reply, peer, tuple(hidden.shape))[1]
