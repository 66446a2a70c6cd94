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
