"""What the health page shows, as plain data: per model, its peers and the blocks nobody serves.

`build_snapshot` is a pure function of the directory records, the results of pinging the peers, the
models to show and the clock; `Snapshot.to_json` is the JSON document of `GET /api/v1/swarm` (schema
in docs/monitor.md) and `gauges` the figures of `/metrics`. What the monitor remembers of each model
between reads (`ModelMemory`) is updated by `list_models` before the pings, ranked by `keep_models`
(which models to ping and show), and updated again by `learn` after the pings.

Invariants:
- a block is covered only by a peer whose record says `online` and that answered the ping for the
  model and span of its record (`confirms`): liveness is measured, never taken from the record alone;
- a peer whose record says `online` but that did not answer, or answered for another model or span, is
  shown `unreachable`; `joining` peers are not pinged (they answer info calls only once their blocks
  are loaded), nor `offline` ones, and are shown as their record says;
- a model's number of blocks is what most of its confirmed peers announce, never less than the
  largest end among them; records that no live peer backs cannot change it once such a count exists
  (before that, the map is as wide as its records vote, and no block of it can look served);
- every model passed in `models` appears, even with no peer left (then every block is uncovered); a
  model stays `FORGET_AFTER` seconds after its last record; at most `MAX_MODELS` are kept, and one
  with a peer that answered is never dropped for one without (anyone can announce a model).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from swarm.net.records import Announcement
from swarm.net.transport import describe_peer
from swarm.net.view import count_blocks
from swarm.net.messages import Info

SCHEMA_VERSION = 1
FORGET_AFTER = 3600.0  # seconds a model with no record left stays on the page (all red)
MAX_MODELS = 256
STATES = ("online", "joining", "unreachable", "offline")  # as shown; a record's states plus `unreachable`


@dataclass(frozen=True)
class Ping:
    """The answer of one peer to an info call: its round trip, and the reply's fields."""

    latency_ms: float
    info: Info


@dataclass(frozen=True)
class ModelMemory:
    """What the monitor remembers of a model between reads."""

    num_blocks: int  # blocks to draw
    trusted: bool  # whether `num_blocks` came from peers that answered, or only from records so far
    listed_at: float  # last time a record of the model was in the directory
    live_at: float = -math.inf  # last time one of its peers answered for it
    reachable: int = 0  # peers of it that answered in the last read


@dataclass(frozen=True)
class PeerView:
    peer: str
    name: str
    start: int
    end: int
    state: str
    throughput: float  # tokens/s of a batch-1 decode step through the span (measured by the peer, live when it
    # answered, else from its record)
    cache_tokens_left: int  # from the info reply when the peer answered, else from its record
    sessions: int | None  # open sessions, when the peer answered
    queued: int | None  # steps waiting for the peer's compute, when it answered
    version: str
    latency_ms: float | None  # round trip of the info call; None when not pinged or no answer
    record_age_s: float  # seconds since the peer issued its record
    device: str = "cpu"  # device kind, dtype and weight format it computes in (info reply, else record)
    dtype: str = "float32"
    quant: str = "none"
    digest: str | None = None  # which weights exactly (from its record; peers with other weights never share routes)
    reach: str | None = None  # "direct" or "relay": how the peer is reached (from its record)


@dataclass(frozen=True)
class ModelView:
    model: str
    num_blocks: int
    peers: tuple[PeerView, ...]
    serving: tuple[int, ...]  # per block: how many peers cover it
    uncovered: tuple[int, ...]


@dataclass(frozen=True)
class Snapshot:
    taken_at: float | None  # Unix time; None before the first read of the swarm
    models: tuple[ModelView, ...] = ()

    def to_json(self, refresh_interval: float) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "taken_at": self.taken_at, "refresh_interval": refresh_interval,
                "models": [{**asdict(m), "peers": [asdict(p) for p in m.peers], "serving": list(m.serving),
                            "uncovered": list(m.uncovered)} for m in self.models]}

    def gauges(self) -> Iterator[tuple[str, str, float, dict[str, str]]]:
        """(name, help, value, labels) of every swarm-level gauge, for `swarm.metrics.StateCollector`."""
        for m in self.models:
            for state in STATES:
                yield ("swarm_monitor_peers", "peers of the model, by state as the monitor sees it",
                       sum(p.state == state for p in m.peers), {"model": m.model, "state": state})
            yield "swarm_monitor_blocks", "blocks of the model", m.num_blocks, {"model": m.model}
            yield ("swarm_monitor_uncovered_blocks", "blocks of the model that no reachable online peer serves",
                   len(m.uncovered), {"model": m.model})


def confirms(ann: Announcement, ping: Ping | None) -> bool:
    """Whether `ping` answered for what `ann` announces: the info reply names its model and span."""
    if ping is None:
        return False
    return (ping.info.model, ping.info.start, ping.info.end) == (ann.model, ann.start, ann.end)


def peer_view(ann: Announcement, ping: Ping | None, now: float) -> PeerView:
    if ann.state in ("joining", "offline"):
        state = ann.state
    else:
        state = "online" if confirms(ann, ping) else "unreachable"
    dtype, quant = ann.weights
    if state != "online":
        return PeerView(ann.peer, describe_peer(ann.peer), ann.start, ann.end, state, ann.throughput,
                        ann.cache_tokens_left, None, None, ann.version, None, round(max(0.0, now - ann.issued_at), 1),
                        ann.device or "cpu", dtype, quant, ann.digest, ann.reach)
    info = ping.info  # checked by its decode: types and ranges
    return PeerView(ann.peer, describe_peer(ann.peer), ann.start, ann.end, state, info.throughput,
                    info.cache_tokens_left, info.sessions, info.queued, ann.version, round(ping.latency_ms, 2),
                    round(max(0.0, now - ann.issued_at), 1), info.device, info.dtype, info.quant, ann.digest,
                    ann.reach)


def model_view(model: str, num_blocks: int, peers: Sequence[PeerView]) -> ModelView:
    serving = [0] * num_blocks
    for p in peers:
        if p.state == "online":
            for block in range(p.start, min(p.end, num_blocks)):
                serving[block] += 1
    return ModelView(model, num_blocks, tuple(sorted(peers, key=lambda p: (p.start, p.end, p.peer))), tuple(serving),
                     tuple(b for b, n in enumerate(serving) if n == 0))


def list_models(seen: Mapping[str, ModelMemory], anns: Sequence[Announcement],
                now: float) -> dict[str, ModelMemory]:
    """`seen` updated with the models listed in `anns` (directory records), before any ping: a model
    without a trusted count takes what its records vote for; models older than `FORGET_AFTER` are dropped."""
    listed: dict[str, list[Announcement]] = {}
    for ann in anns:
        listed.setdefault(ann.model, []).append(ann)
    updated = dict(seen)
    for model, its in listed.items():
        known = updated.get(model, ModelMemory(0, False, now))
        updated[model] = replace(known, num_blocks=known.num_blocks if known.trusted else count_blocks(its),
                                 listed_at=now)
    return {m: v for m, v in updated.items() if now - v.listed_at <= FORGET_AFTER}


def keep_models(seen: Mapping[str, ModelMemory], rng: random.Random) -> list[str]:
    """The `MAX_MODELS` models to ping and show, best first: by the peers of each that answered in the last
    read (so one with a live peer is never dropped for one without), then the last time one answered,
    then the last time it was listed. Ties are broken at random, so a new model is reached even among
    more than `MAX_MODELS` models whose peers never answer."""
    return sorted(seen, key=lambda m: (seen[m].reachable, seen[m].live_at, seen[m].listed_at, rng.random()),
                  reverse=True)[:MAX_MODELS]


def learn(seen: Mapping[str, ModelMemory], kept: Sequence[str], anns: Sequence[Announcement],
          pings: Mapping[str, Ping], now: float) -> dict[str, ModelMemory]:
    """What to remember after a read: for each kept model, its peers that answered for it, and the number
    of blocks they vote for. Models neither kept nor listed now are forgotten, so memory stays bounded."""
    confirmed: dict[str, list[Announcement]] = {}
    for ann in anns:
        if ann.state == "online" and confirms(ann, pings.get(ann.peer)):
            confirmed.setdefault(ann.model, []).append(ann)
    listed = {a.model for a in anns}
    updated = {m: v for m, v in seen.items() if m in kept or m in listed}
    for model in kept:
        live = confirmed.get(model, [])
        updated[model] = replace(seen[model], num_blocks=count_blocks(live), trusted=True, live_at=now,
                                 reachable=len(live)) if live else replace(seen[model], reachable=0)
    return updated


def build_snapshot(anns: Sequence[Announcement], pings: Mapping[str, Ping], models: Mapping[str, int],
                   now: float) -> Snapshot:
    """The snapshot of `models` (model id -> number of blocks): the peers announced in `anns` (directory
    records, one per peer) with their ping results (`pings`, by peer id; absent: no answer or not pinged)."""
    views = []
    for model, num_blocks in sorted(models.items()):
        peers = [peer_view(a, pings.get(a.peer), now) for a in anns if a.model == model]
        views.append(model_view(model, num_blocks, peers))
    return Snapshot(now, tuple(views))
