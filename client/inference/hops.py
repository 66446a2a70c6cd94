"""Per-hop pieces of a session's route (`client.inference.route`): a link (a hop of the route and the
session there), what was sent into a hop (for exact replay onto a new peer), whether a hop's peer became
slow, and the free sanity check of a hop's output (`implausible`). Synchronous, no network."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from client.inference.peer_session import PeerSession
from client.inference.routing import Hop
from swarm.errors import BadRequest, WrongOutput
from swarm.net.transport import describe_peer

IDLE_REOPEN_S = 30.0  # a link silent this long may find its stream dropped by the peer: reopen it there first
RECLAIMABLE_S = 5.0  # a peer may reclaim a session silent this long for another (peers' --reclaim-idle default)


def reclaimed(reason: str, idle_s: float) -> bool:
    """Whether a failure after `idle_s` seconds of silence is the peer ending a session we left idle rather than
    a fault: the session unknown after `RECLAIMABLE_S`, or the stream gone after `IDLE_REOPEN_S`. A session
    a peer forgets sooner is its fault: answering `unknown_session` to a busy session would otherwise force a
    replay of its whole history each time, for free."""
    return (reason == "unknown_session" and idle_s >= RECLAIMABLE_S) or \
        (reason == "connection_lost" and idle_s >= IDLE_REOPEN_S)
MAX_GROWTH = 1e5  # a span's output vector is at most this many times its input's norm (plus 1); real blocks grow
# activations by up to a few thousand times (the massive activations of a sequence's first positions)
MAX_SHRINK = 1e-3  # a span's output spread (below the model's floor) is at least this fraction of its input's
DEFAULT_EPS = 1e-6  # the norm epsilon assumed for callers that have no config (Llama 3, Qwen, Gemma use it)
NORM_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def output_floor(config=None) -> float:
    """The spread (standard deviation over the hidden dimension) below which a hidden vector is degenerate
    for this model: sqrt(eps) of its normalization layers. Every block and the LM head begin with a norm
    that divides by sqrt(mean(x^2) + eps) (RMSNorm) or sqrt(var(x) + eps) (LayerNorm): a vector whose
    spread is below sqrt(eps) is mostly epsilon to them, and a constant vector (spread 0) carries nothing
    LayerNorm can see. `config`: the model's (its text config is read where nested); None: `DEFAULT_EPS`."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key in NORM_EPS_KEYS:
        eps = getattr(text, key, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0:
            return float(eps) ** 0.5
    return DEFAULT_EPS ** 0.5


def check_plausible(hop: Hop, x: torch.Tensor, out: torch.Tensor, floor: float = DEFAULT_EPS ** 0.5) -> None:
    """`WrongOutput` if the hop's output is not one its blocks can produce (`implausible`)."""
    why = implausible(x, out, floor)
    if why is not None:
        raise WrongOutput(f"peer {describe_peer(hop.peer)} returned wrong outputs for blocks {hop.span}: {why}")


def plausible(x: torch.Tensor, out: torch.Tensor, floor: float = DEFAULT_EPS ** 0.5) -> bool:
    return implausible(x, out, floor) is None


def implausible(x: torch.Tensor, out: torch.Tensor, floor: float = DEFAULT_EPS ** 0.5) -> str | None:
    """Why a hop's output `out` cannot be what blocks compute from `x` (both [batch, tokens, hidden]); None if
    it can. A free check on every step, row by row (one row: one position's hidden vector):

    - every value finite, and no row's norm above `MAX_GROWTH` times its input's (plus 1);
    - no row degenerate: its spread (std over the hidden dimension) below `floor` (`output_floor`: sqrt of
      the model's norm epsilon) and also below `MAX_SHRINK` times its input's spread. All zeros and constant
      rows have spread 0. Both bounds must fail, so an input that is degenerate itself (a zero embedding of
      a padding token, whose honest output is zeros too) is never held against the peer.

    Margins measured on honest outputs of every span [a:b) (float32, prompts and greedy decode steps):
    the demo model (SmolLM2-135M, eps 1e-5) keeps every row's spread at least 378 times the floor and at
    least 0.138 of its input's (so 138 times `MAX_SHRINK`), and grows it 11,400 times at most; the tiny
    families of `tests/tiny_models.py` and eight of `tests/family_harness.py` (gpt_neox, falcon, olmo2,
    starcoder2, stablelm, gemma2, granite, cohere: RMSNorm and LayerNorm alike) keep every row above 980
    times at least one of the two bounds. It catches absurd outputs, not subtle ones (`client.inference.verify`
    does)."""
    if not bool(torch.isfinite(out).all()):
        return "non-finite values"
    x, out = x.float(), out.float()
    if not bool((out.norm(dim=-1) <= MAX_GROWTH * (x.norm(dim=-1) + 1)).all()):
        return f"norms over {MAX_GROWTH:g} times their input's"
    spread = out.std(dim=-1, unbiased=False)
    degenerate = (spread < floor) & (spread < MAX_SHRINK * x.std(dim=-1, unbiased=False))
    if bool(degenerate.any()):
        return (f"{int(degenerate.sum())} of {degenerate.numel()} hidden vectors degenerate (zeros or constant: "
                f"spread under {floor:.2g}, the model's floor, and under {MAX_SHRINK:g} of their input's)")
    return None


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
    answered_at: float = field(default_factory=time.monotonic)  # its session last opened or answered a step
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
