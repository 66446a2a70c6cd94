"""The partial file of one download (`DEST.part`): its bytes so far, who sent each range, and their sha256,
kept as bytes are appended. Its methods block on the disk: callers on an event loop run them in a thread.

Invariants: `length` is the file's length on disk; `sources` cover `[0, length)` in order, without gaps
(a source of None: bytes an earlier run left); `hasher` holds the sha256 of those bytes, except between a
`replace` and the `rehash` that must follow it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from swarm.net.identity import PeerId

HASH_BLOCK = 8 * 2**20  # bytes read at a time when hashing a file on disk


class PartialFile:
    """`DEST.part` of a file of `size` bytes, opened (created if missing) for reading and writing."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.length = os.fstat(self.fd).st_size
        self.sources: list[tuple[int, int, PeerId | None]] = []
        self.hasher = hashlib.sha256()

    def load(self) -> None:
        """Take what an earlier run left; more than the file's size is thrown away."""
        if self.length > self.size:
            self.reset()
        self.hasher = self._hash(self.length)
        self.sources = [(0, self.length, None)] if self.length else []

    def _hash(self, length: int):
        hasher = hashlib.sha256()
        for offset in range(0, length, HASH_BLOCK):
            hasher.update(os.pread(self.fd, min(HASH_BLOCK, length - offset), offset))
        return hasher

    def append(self, data: bytes | bytearray, source: PeerId) -> None:
        """Write `data` at the end, sent by `source`, and hash it."""
        os.pwrite(self.fd, data, self.length)
        self.hasher.update(data)
        start, self.length = self.length, self.length + len(data)
        if self.sources and self.sources[-1][2] == source and self.sources[-1][1] == start:
            self.sources[-1] = (self.sources[-1][0], self.length, source)
        else:
            self.sources.append((start, self.length, source))

    def replace(self, offset: int, data: bytes | bytearray) -> set[PeerId | None]:
        """Overwrite [offset, offset + len(data)) with `data`; the sources of the bytes that differed."""
        old = os.pread(self.fd, len(data), offset)
        differed = set()
        for start, end, source in self.sources:
            lo, hi = max(start, offset), min(end, offset + len(data))
            if lo < hi and old[lo - offset:hi - offset] != data[lo - offset:hi - offset]:
                differed.add(source)
        if differed:
            os.pwrite(self.fd, data, offset)
        return differed

    def rehash(self, source: PeerId) -> None:
        """Every byte now comes from `source` (after `replace`): hash the whole file again."""
        self.hasher = self._hash(self.length)
        self.sources = [(0, self.length, source)]

    def reset(self) -> None:
        os.ftruncate(self.fd, 0)
        self.length, self.sources, self.hasher = 0, [], hashlib.sha256()

    def finish(self, dest: Path) -> None:
        """The file is whole and verified: put it in place atomically."""
        os.fsync(self.fd)
        os.replace(self.path, dest)

    def close(self) -> None:
        """Close the file; an empty partial file is removed (a whole one was renamed already)."""
        os.close(self.fd)
        if self.length == 0 and self.path.exists():
            self.path.unlink()
