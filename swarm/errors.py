"""Typed errors of the swarm. Every error a user or a remote party can cause has a class here.

Each class carries a stable `code` string: later, errors cross the wire as that code, so a client
knows whether to reroute (busy, out of cache, not serving) or give up (bad request).
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error this project raises on purpose."""

    code = "internal"


class BadRequest(SwarmError):
    """The input is malformed: wrong shape, dtype, position, size, or an unknown session."""

    code = "bad_request"


class UnsupportedModel(SwarmError):
    """The checkpoint's architecture cannot be split into blocks by this software."""

    code = "unsupported_model"


class CheckpointError(SwarmError):
    """The checkpoint on disk is missing files or tensors, or does not match its config."""

    code = "bad_checkpoint"


class OutOfCache(SwarmError):
    """A session asked for more attention cache than is free, or stepped past its max length."""

    code = "out_of_cache"


class Busy(SwarmError):
    """The peer is at its session limit or its queue is full: try another peer or later."""

    code = "busy"


class NotServing(SwarmError):
    """The peer does not serve this model or these blocks (any more)."""

    code = "not_serving"


class UnknownSession(SwarmError):
    """The session was never opened on this stream, or was closed or reclaimed while idle."""

    code = "unknown_session"


class StepTimeout(SwarmError):
    """A step did not finish within the peer's step timeout."""

    code = "timeout"


class ConfigError(SwarmError):
    """A command-line option or configuration value is invalid."""

    code = "bad_config"


class SwarmUnreachable(SwarmError):
    """None of the initial peers answered: the swarm cannot be joined from here."""

    code = "unreachable"


class ConnectionLost(SwarmError):
    """The stream to a peer closed or broke before a reply came: the peer is gone or dropped us."""

    code = "connection_lost"


class ProtocolError(SwarmError):
    """A message is malformed or incomplete at the wire level (framing, header, part counts, sizes)."""

    code = "protocol"


class NoRoute(SwarmError):
    """Some blocks of the model have no live peer that can take the request; names the blocks."""

    code = "no_route"

    def __init__(self, message: str = "", missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = missing


ERROR_CLASSES = {cls.code: cls for cls in (SwarmError, BadRequest, UnsupportedModel, CheckpointError, OutOfCache,
                                           Busy, NotServing, UnknownSession, StepTimeout, ConnectionLost,
                                           ProtocolError, ConfigError, SwarmUnreachable, NoRoute)}


def error_from_code(code: str, message: str) -> SwarmError:
    """Rebuild a typed error received from a remote party; unknown codes become `SwarmError` (internal)."""
    return ERROR_CLASSES.get(code, SwarmError)(message)
