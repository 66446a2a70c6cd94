"""Typed errors of the swarm. Every error a user or a remote party can cause has a class here.

Each class carries a stable `code` string (errors cross the wire as that code) and `retryable`: whether
another peer may succeed where this one failed, because the request itself was fine (busy, out of
cache, not serving, a lost connection: reroute) or not (a bad request: give up).
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class of every error this project raises on purpose."""

    code = "internal"
    retryable = True  # an internal error of one peer: another may not have it
    remote = False  # received from another party (`error_from_code`), not raised here


class BadRequest(SwarmError):
    """The input is malformed: wrong shape, dtype, position, size, or an unknown session."""

    code = "bad_request"
    retryable = False


class UnsupportedModel(SwarmError):
    """The checkpoint's architecture cannot be split into blocks by this software."""

    code = "unsupported_model"
    retryable = False


class CheckpointError(SwarmError):
    """The checkpoint on disk is missing files or tensors, or does not match its config."""

    code = "bad_checkpoint"
    retryable = False


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
    retryable = False


class SwarmUnreachable(SwarmError):
    """None of the initial peers answered: the swarm cannot be joined from here."""

    code = "unreachable"
    retryable = False


class ConnectionLost(SwarmError):
    """The stream to a peer closed or broke before a reply came: the peer is gone or dropped us."""

    code = "connection_lost"


class ProtocolError(SwarmError):
    """A message is malformed or incomplete at the wire level (framing, header, part counts, sizes)."""

    code = "protocol"


class ChainMismatch(SwarmError):
    """A hop computed on input other than the output the previous hop returned to the client: the push
    between them was altered (or the previous hop lied to one of them). A failure of the previous hop."""

    code = "chain_mismatch"


class WrongOutput(SwarmError):
    """A peer's output is not what its blocks can produce for the input sent (non-finite, absurdly large,
    or degenerate: zeros, constant rows, norms far below the model's range): it computed something else.
    Another peer may compute it right; the liar is avoided for long."""

    code = "wrong_output"


class Rewound(SwarmError):
    """A session's outputs from `position` on were found wrong (a lying peer, now replaced): the session was
    rolled back there, and its caller goes on from `position` (the tokens after it are recomputed)."""

    code = "rewound"
    retryable = False

    def __init__(self, message: str = "", position: int = 0):
        super().__init__(message)
        self.position = position


class Unchecked(SwarmError):
    """The route has blocks that no other peer can check, and the client was told to refuse unchecked outputs
    (`--require-checked`)."""

    code = "unchecked"
    retryable = False


class NoRoute(SwarmError):
    """Some blocks of the model have no live peer that can take the request; names the blocks."""

    code = "no_route"
    retryable = False

    def __init__(self, message: str = "", missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = missing


class WeightsUnavailable(SwarmError):
    """No peer delivered a weight file with the right sha256: names the file and what each holder did (the
    caller takes it from the model hub instead)."""

    code = "weights_unavailable"
    retryable = False

    def __init__(self, message: str = "", sha256: str = "", outcomes: dict[str, str] | None = None):
        super().__init__(message)
        self.sha256 = sha256
        self.outcomes = dict(outcomes or {})


ERROR_CLASSES = {cls.code: cls for cls in (SwarmError, BadRequest, UnsupportedModel, CheckpointError, OutOfCache,
                                           Busy, NotServing, UnknownSession, StepTimeout, ConnectionLost,
                                           ProtocolError, ConfigError, SwarmUnreachable, ChainMismatch,
                                           WrongOutput, Rewound, NoRoute, WeightsUnavailable)}


def error_from_code(code: str, message: str) -> SwarmError:
    """Rebuild a typed error received from a remote party (`remote` is True on it); unknown codes become
    `SwarmError` (internal)."""
    err = ERROR_CLASSES.get(code, SwarmError)(message)
    err.remote = True
    return err
