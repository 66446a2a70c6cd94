"""Spans: half-open ranges `[start, end)` of a model's blocks (decoder layers).

Invariant: a span starts only at one of its model's *starts* (`span_starts`), the blocks a span may begin at;
every block for most models. Wherever spans are chosen (a peer's placement, its `--blocks`, a client's route
cutting between two peers, a local chain's split) the cut between two spans falls on a start, and a span a
peer serves ends at one or at the model's end, so that the next span can begin where it ends.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from swarm.errors import BadRequest


@dataclass(frozen=True, order=True)
class Span:
    start: int
    end: int

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int)) or not 0 <= self.start < self.end:
            raise BadRequest(f"a span needs integers 0 <= start < end, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}:{self.end})"

    @classmethod
    def parse(cls, text: str) -> Span:
        """Parse `START:END` as written on the command line."""
        parts = text.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise BadRequest(f"expected blocks as START:END (e.g. 0:12), got {text!r}")
        return cls(int(parts[0]), int(parts[1]))

    def check_within(self, num_blocks: int) -> None:
        if self.end > num_blocks:
            raise BadRequest(f"span {self} is outside the model's {num_blocks} blocks [0:{num_blocks})")


def span_starts(config) -> tuple[int, ...]:
    """The blocks a span of the model of `config` may start at: every block but those whose layer takes what
    the layer before it computed, handed over inside the family's own layer loop, never across spans: the
    blocks whose `indexer_types` entry is "shared" (they reuse the tokens the previous block's indexer chose).
    Block 0 always (the head hands it what it takes)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    blocks = int(text.num_hidden_layers)
    kinds = getattr(text, "indexer_types", None)
    kinds = kinds if isinstance(kinds, (list, tuple)) else ()
    return tuple(b for b in range(blocks) if b == 0 or b >= len(kinds) or kinds[b] != "shared")


def check_start(span: Span, starts: Collection[int], num_blocks: int | None = None) -> None:
    """`BadRequest` naming `starts` if `span` starts at a block no span may start at; with `num_blocks` (a span a
    peer serves), also if it is not within the model's blocks or ends elsewhere than at a start or the model's
    end (a span after it could not begin there)."""
    if num_blocks is not None:
        span.check_within(num_blocks)
    if span.start not in starts:
        raise BadRequest(f"blocks {span} start at block {span.start}, which takes what block {span.start - 1} "
                         f"computed inside the model's own layer loop: a span of this model starts at one of the "
                         f"blocks {sorted(starts)}")
    if num_blocks is not None and span.end != num_blocks and span.end not in starts:
        raise BadRequest(f"blocks {span} end before block {span.end}, where no span of this model may start: a "
                         f"span ends at one of the blocks {sorted(starts)} or at the model's end {num_blocks}")


def split_evenly(num_blocks: int, parts: int, starts: Sequence[int] | None = None) -> list[Span]:
    """Cut `[0, num_blocks)` into `parts` contiguous spans whose sizes differ by at most one; with `starts`
    (`span_starts`), cut only there, each cut at the start nearest the even one (the lower on a tie) that
    leaves a start for every later cut. Every block a start: the even cut itself."""
    if not 1 <= parts <= num_blocks:
        raise BadRequest(f"cannot split {num_blocks} blocks into {parts} spans")
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    if starts is not None:
        cuts = sorted(b for b in set(starts) if 0 < b < num_blocks)
        if len(cuts) < parts - 1:
            raise BadRequest(f"cannot split {num_blocks} blocks into {parts} spans: a span of this model starts at "
                             f"one of the blocks {sorted(set(starts))}")
        taken = -1  # index in `cuts` of the previous cut
        for i in range(1, parts):
            room = cuts[taken + 1:len(cuts) - (parts - 1 - i)]
            chosen = min(room, key=lambda b: (abs(b - bounds[i]), b))
            taken = cuts.index(chosen)
            bounds[i] = chosen
    return [Span(a, b) for a, b in zip(bounds, bounds[1:])]
