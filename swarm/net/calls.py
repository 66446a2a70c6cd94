"""One checked request and reply with a peer, and the info call built on it. Torch-free, so the
bootstrap's health monitor can ping peers too.

Every reply is checked: an ERROR message becomes its typed error (so callers can tell "reroute" from
"give up"), a stream that ends or stays silent becomes `ConnectionLost` or `StepTimeout`, and a
reply of the wrong type is a `ProtocolError`, never silently used.
"""

from __future__ import annotations

import asyncio

from swarm.net import messages, wire
from swarm.errors import BadRequest, ConnectionLost, ProtocolError, StepTimeout, error_from_code
from swarm.net.transport import Node, Stream

MAX_REPLY_BYTES = 1 << 30  # tensor bytes of a session or forward reply (hidden states)


def decode_reply(cls, reply: wire.Message, peer: object, what: str):
    """`reply` as a `cls` message (`swarm.net.messages`); a reply of another type or a malformed one is a
    `ProtocolError` on our side (the peer's fault), never a `BadRequest`."""
    if reply.type != cls.TYPE:
        raise ProtocolError(f"peer {peer} answered {what!r} with {reply.type!r}")
    try:
        return cls.from_message(reply)
    except BadRequest as e:
        raise ProtocolError(f"peer {peer} answered {what!r} with a malformed reply: {e}") from None


def raise_if_error(msg: wire.Message) -> None:
    if msg.type == wire.ERROR:
        err = decode_reply(messages.Error, msg, "?", "a request")
        raise error_from_code(err.code, err.message)


async def exchange(stream: Stream, msg: wire.Message, timeout: float,
                   max_tensor_bytes: int = MAX_REPLY_BYTES) -> wire.Message:
    """Send `msg`, read one reply within `timeout` seconds; an ERROR reply is raised as its typed error.

    A reply declaring more than `max_tensor_bytes` of tensors is a `ProtocolError`, before any is read."""
    try:
        await wire.write_message(stream.writer, msg)
    except (ConnectionError, OSError) as e:
        raise ConnectionLost(f"peer {stream.remote} closed the stream ({type(e).__name__})") from None
    return await receive(stream, timeout, max_tensor_bytes)


async def receive(stream: Stream, timeout: float, max_tensor_bytes: int = MAX_REPLY_BYTES) -> wire.Message:
    """The next message within `timeout` seconds; an ERROR message is raised as its typed error."""
    try:
        reply = await asyncio.wait_for(wire.read_message(stream.reader, max_tensor_bytes), timeout)
    except asyncio.TimeoutError:  # before OSError: on 3.11 it is the builtin TimeoutError, an OSError
        raise StepTimeout(f"peer {stream.remote} sent no reply within {timeout:.1f} s") from None
    except (EOFError, ConnectionError, OSError):
        raise ConnectionLost(f"peer {stream.remote} closed the stream without a reply") from None
    raise_if_error(reply)
    return reply


async def info(node: Node, peer: str, timeout: float = 10.0) -> messages.Info:
    """The peer's `info` reply: what it serves, how it computes and how loaded it is (docs/protocol.md)."""
    stream = await node.open(peer, wire.INFO_PROTOCOL)
    try:
        # an info reply carries no tensor: an untrusted peer must not make us buffer any (the monitor pings all)
        reply = await exchange(stream, messages.InfoRequest().to_message(), timeout, max_tensor_bytes=0)
    finally:
        await stream.aclose()
    return decode_reply(messages.Info, reply, peer, "info")
