"""Per-hop pieces of a session's route (`client.inference.route`): a link (a hop of the route and the
session there), what was sent into a hop (for exact replay onto a new peer), whether a hop's peer became
slow, and the free sanity check of a hop's output. Synchronous, no network."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from client.inference.peer_session import PeerSession
from client.inference.routing import Hop
from swarm.errors import BadRequest, ProtocolError

IDLE_REOPEN_S = 30.0  # a link silent this long may find its stream dropped by the peer: reopen it there first
MAX_GROWTH = 1e5  # a span's output vector is at most this many times its input's norm (plus 1); real blocks grow
# activations by up to a few thousand times (the massive activations of a sequence's first positions)


def check_plausible(hop: Hop, x: torch.Tensor, out: torch.Tensor) -> None:
    if not plausible(x, out):
        raise ProtocolError(f"peer {hop.peer} returned implausible hidden states for blocks {hop.span} (non-finite, "
                            "or norms far beyond what blocks produce)")


def plausible(x: torch.Tensor, out: torch.Tensor) -> bool:
    """A free sanity check of a hop's output against its input, on every step: finite, and no vector's norm
    far beyond what blocks can produce. It catches absurd outputs, not subtle ones (`client.inference.verify` does)."""
    if not bool(torch.isfinite(out).all()):
        return False
    return bool((out.float().norm(dim=-1) <= MAX_GROWTH * (x.float().norm(dim=-1) + 1)).all())


class SlowDetector:
    """Flags a peer whose decode steps became slow: the median of its last `steps` decode steps is above
    `factor` times (and `floor_ms` more than) its usual latency, the median of its recent normal steps.
    A median, so one stray pause never counts, while a peer slow most of the time does."""

    def __init__(self, factor: float = 4.0, steps: int = 3, warmup: int = 5, floor_ms: float = 50.0):
        self.factor, self.steps, self.warmup, self.floor_ms = factor, steps, warmup, floor_ms
        self.normal: deque[float] = deque(maxlen=16)
        self.recent: deque[float] = deque(maxlen=steps)

    def observe(self, ms: float, tokens: int) -> bool:
        """Record one step; True while the peer counts as slow."""
        if tokens != 1:
            return False
        if len(self.normal) < self.warmup:
            self.normal.append(ms)
            return False
        usual = statistics.median(self.normal)
        limit = max(self.factor * usual, usual + self.floor_ms)
        self.recent.append(ms)
        if ms <= limit:
            self.normal.append(ms)
        return len(self.recent) == self.steps and statistics.median(self.recent) > limit


def step_mask(kept: torch.Tensor | None, given: torch.Tensor | None, batch: int, position: int,
              tokens: int) -> torch.Tensor | None:
    """The attention mask of a step of `tokens` at `position` over positions [0, position + tokens): the
    caller's (`given`), else the session's (`kept`) extended with ones; None while everything is attended."""
    total = position + tokens
    if given is None:
        if kept is None:
            return None
        return torch.cat([kept[:, :position], torch.ones(batch, tokens, dtype=kept.dtype)], dim=1)
    if given.shape != (batch, total):
        raise BadRequest(f"attention mask must be [{batch}, {total}], got {list(given.shape)}")
    return None if bool(given.all()) and kept is None else given


class Inputs:
    """The hidden states sent into one hop, positions [0, length), in a buffer that grows by doubling (up
    to the session's max length): appending a token copies that token only, not the whole history. Held in
    float32, which holds the values of every wire encoding exactly."""

    def __init__(self, x: torch.Tensor, max_length: int):
        self.max_length = max_length
        self.buf = x.new_empty(x.shape[0], min(max(2 * x.shape[1], 16), max_length), x.shape[2],
                               dtype=torch.float32)
        self.length = 0
        self.append(x)

    def view(self) -> torch.Tensor:
        return self.buf[:, :self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def append(self, x: torch.Tensor) -> None:
        end = self.length + x.shape[1]
        if end > self.buf.shape[1]:
            grown = self.buf.new_empty(self.buf.shape[0], min(max(end, 2 * self.buf.shape[1]), self.max_length),
                                       self.buf.shape[2])
            grown[:, :self.length] = self.buf[:, :self.length]
            self.buf = grown
        self.buf[:, self.length:end] = x
        self.length = end


@dataclass
class Link:
    """One hop of the live route and its open session (None until first used)."""

    hop: Hop
    session: PeerSession | None = None
    detector: SlowDetector = field(default_factory=SlowDetector)
    slow: bool = False
    used_at: float = field(default_factory=time.monotonic)  # last step sent or session opened
    used_before: float = field(default_factory=time.monotonic)  # used_at before the last step was sent
    reopened: bool = False  # already reopened once on the same peer (its session had expired)
    assumed_ms: float = 0.0  # a decode step's time through the hop (delay and compute, load included) its
    # route assumed when chosen
    claimed: bool = False  # counted in the client's load at its peer until released


@dataclass(frozen=True)
class Failover:
    blocks: str
    failed_peer: str
    reason: str
    new_hops: tuple[str, ...]
    stall_s: float  # from sending the step that failed to its output from the new peers
