"""The swarm as its announcements show it: which peer serves which blocks, online or claimed.

Pure functions over the records found under each block (`swarm.net.discovery`): `servers` is what placement
counts (what each peer serves or will soon serve), `online` what clients route by; and over the directory's
records: `count_blocks` (a model's number of blocks as its records vote) and `models` (every model listed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarm.net.records import Announcement
from swarm.span import Span

SERVING = ("joining", "online")


@dataclass(frozen=True)
class Server:
    """One peer's announced service: the span and the tokens/s it adds to each of its blocks."""

    peer: str
    span: Span
    throughput: float
    state: str = "online"
    since: float = 0.0
    max_blocks: int | None = None  # blocks its memory holds, if announced

    @property
    def speed(self) -> float:
        """Tokens/s it would pass serving one block: its throughput times its span's length."""
        return self.throughput * len(self.span)


def servers(announcements: Mapping[int, Iterable[Announcement]], num_blocks: int,
            exclude: Iterable[str] = ()) -> list[Server]:
    """What each peer serves or will soon serve, block by block, from the records found under each block.

    Per (peer, block) the newest record found there decides, so a peer that moves has its new span
    (joining, then online) and the rest of its old one (online until it announces it offline) each
    counted where it is stored. One `Server` per peer and contiguous run of blocks with the same record."""
    skip = set(exclude)
    newest: dict[tuple[str, int], Announcement] = {}
    for block, anns in announcements.items():
        if not 0 <= block < num_blocks:
            continue
        for ann in anns:
            key = (ann.peer, block)
            if ann.peer not in skip and ann.start <= block < ann.end and (key not in newest or ann.seq > newest[key].seq):
                newest[key] = ann
    runs: dict[tuple[str, int], list[int]] = {}
    for (peer, block), ann in newest.items():
        if ann.state in SERVING:
            runs.setdefault((peer, ann.seq), []).append(block)
    out = []
    for (peer, seq), blocks in sorted(runs.items()):
        ann = newest[(peer, blocks[0])]
        blocks.sort()
        start = blocks[0]
        for a, b in zip(blocks, blocks[1:] + [None]):
            if b != a + 1:
                out.append(Server(peer, Span(start, a + 1), float(ann.throughput), ann.state,
                                  ann.since or ann.issued_at, ann.max_blocks))
                start = b
    return out


def online(announcements: Mapping[int, Iterable[Announcement]]) -> dict[str, Announcement]:
    """Each peer's newest online record, unless under one of that span's blocks its newest record is a
    newer offline one (it left those blocks).

    What clients route by: a moving peer keeps its old span online while its new one is `joining`, its
    new span wins once online, and the blocks it left are announced offline under their own keys."""
    newest_online: dict[str, Announcement] = {}
    newest_at: dict[tuple[str, int], Announcement] = {}
    for block, anns in announcements.items():
        for ann in anns:
            if ann.state == "online" and (ann.peer not in newest_online or ann.seq > newest_online[ann.peer].seq):
                newest_online[ann.peer] = ann
            key = (ann.peer, block)
            if key not in newest_at or ann.seq > newest_at[key].seq:
                newest_at[key] = ann
    out = {}
    for peer, ann in newest_online.items():
        left = [newest_at.get((peer, b)) for b in ann.span]
        if not any(r is not None and r.state == "offline" and r.seq > ann.seq for r in left):
            out[peer] = ann
    return out


def count_blocks(anns: Sequence[Announcement]) -> int:
    """The number of blocks most of `anns` (directory records of one model) announce (a tie: the larger), never
    less than their largest end."""
    votes = Counter(a.num_blocks for a in anns)
    return max(max(votes.items(), key=lambda kv: (kv[1], kv[0]))[0], max(a.end for a in anns))


def models(anns: Sequence[Announcement]) -> dict[str, int]:
    """Every model the directory's records list (any state), by id, with its number of blocks as they vote."""
    listed: dict[str, list[Announcement]] = {}
    for ann in anns:
        listed.setdefault(ann.model, []).append(ann)
    return {model: count_blocks(its) for model, its in sorted(listed.items())}
