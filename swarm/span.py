"""Spans: half-open ranges `[start, end)` of a model's blocks (decoder layers)."""

from __future__ import annotations

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


def split_evenly(num_blocks: int, parts: int) -> list[Span]:
    """Cut `[0, num_blocks)` into `parts` contiguous spans whose sizes differ by at most one."""
    if not 1 <= parts <= num_blocks:
        raise BadRequest(f"cannot split {num_blocks} blocks into {parts} spans")
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return [Span(a, b) for a, b in zip(bounds, bounds[1:])]
