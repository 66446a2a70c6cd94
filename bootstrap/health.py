"""What the health page shows, as plain data: per model, its peers and the blocks nobody serves.

`build_snapshot` is a pure function of the directory records, the results of pinging the peers, the
models to show (`remember_models`) and the clock; `Snapshot.to_json` is the JSON document of
`GET /api/v1/swarm` (schema in docs/monitor.md) and `gauges` the figures of `/metrics`.

Invariants:
- a block is covered only by a peer whose record says `online` and that answered the ping: liveness is
  measured, never taken from the record alone;
- a peer whose record says `online` but that did not answer the ping is shown `unreachable`;
  `joining` peers are not pinged (they answer info calls only once their blocks are loaded), nor
  `offline` ones, and are shown as their record says;
- every model passed in `models` appears, even with no peer left (then every block is uncovered); a
  model stays `FORGET_AFTER` seconds after its last record, and `MAX_MODELS` at most are kept (anyone
  can announce a model);
- a model's number of blocks is what most of its peers announce, so one peer cannot widen the map.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarm.records import Announcement
from swarm.transport import describe_peer

SCHEMA_VERSION = 1
FORGET_AFTER = 3600.0  # seconds a model with no record left stays on the page (all red)
MAX_MODELS = 256
STATES = ("online", "joining", "unreachable", "offline")  # as shown; a record's states plus `unreachable`


@dataclass(frozen=True)
class Ping:
    """The answer of one peer to an info call: its round trip, and the reply's fields."""

    latency_ms: float
    info: Mapping[str, Any]


@dataclass(frozen=True)
class PeerView:
    peer: str
    name: str
    start: int
    end: int
    state: str
    throughput: float  # tokens/s of a batch-1 decode step through the span (self-reported)
    cache_tokens_left: int  # from the info reply when the peer answered, else from its record
    sessions: int | None  # open sessions, when the peer answered
    version: str
    latency_ms: float | None  # round trip of the info call; None when not pinged or no answer
    record_age_s: float  # seconds since the peer issued its record


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


def _as_int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def peer_view(ann: Announcement, ping: Ping | None, now: float) -> PeerView:
    if ann.state in ("joining", "offline"):
        state = ann.state
    else:
        state = "online" if ping is not None else "unreachable"
    info = ping.info if ping is not None else {}
    cache_left = _as_int(info.get("cache_tokens_left"))
    return PeerView(ann.peer, describe_peer(ann.peer), ann.start, ann.end, state, ann.throughput,
                    ann.cache_tokens_left if cache_left is None else cache_left, _as_int(info.get("sessions")),
                    ann.version, round(ping.latency_ms, 2) if ping is not None else None,
                    round(max(0.0, now - ann.issued_at), 1))


def model_view(model: str, num_blocks: int, peers: Sequence[PeerView]) -> ModelView:
    serving = [0] * num_blocks
    for p in peers:
        if p.state == "online":
            for block in range(p.start, min(p.end, num_blocks)):
                serving[block] += 1
    return ModelView(model, num_blocks, tuple(sorted(peers, key=lambda p: (p.start, p.end, p.peer))), tuple(serving),
                     tuple(b for b, n in enumerate(serving) if n == 0))


def remember_models(seen: Mapping[str, tuple[int, float]], anns: Sequence[Announcement],
                    now: float) -> dict[str, tuple[int, float]]:
    """`seen` (model id -> (number of blocks, last time listed)) updated with the models of `anns`,
    models older than `FORGET_AFTER` dropped, the `MAX_MODELS` most recently listed kept."""
    votes: dict[str, Counter] = {}
    for ann in anns:
        votes.setdefault(ann.model, Counter())[ann.num_blocks] += 1
    updated = dict(seen)
    for model, counts in votes.items():
        updated[model] = (max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0], now)
    recent = sorted(((m, v) for m, v in updated.items() if now - v[1] <= FORGET_AFTER), key=lambda mv: -mv[1][1])
    return dict(recent[:MAX_MODELS])


def build_snapshot(anns: Sequence[Announcement], pings: Mapping[str, Ping], models: Mapping[str, int],
                   now: float) -> Snapshot:
    """The snapshot of `models` (model id -> number of blocks): the peers announced in `anns` (directory
    records, one per peer) with their ping results (`pings`, by peer id; absent: no answer or not pinged)."""
    views = []
    for model, num_blocks in sorted(models.items()):
        peers = [peer_view(a, pings.get(a.peer), now) for a in anns if a.model == model]
        views.append(model_view(model, num_blocks, peers))
    return Snapshot(now, tuple(views))
