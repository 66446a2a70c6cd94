"""Where a span's attention keys and values live: storage allocated ahead, written in place, shared by forks.

Layout (`KVLayout`): token-major. A session of `rows` sequences holds, per row, up to `capacity` tokens; each
token holds every attention layer's keys then values, head after head (and, for an indexed attention layer, its
indexer's key after them: a part of one head and no values). A layer's keys for a session's first
L tokens are a strided view `[rows, heads, L, dim]` of that storage (`Rows.keys`): a step writes its new
tokens where they belong (`Rows.write`) and attends over a view; no step copies history.

Memory is counted in blocks of `block_tokens` tokens of one row (`Pool`): a session reserves blocks ahead
(credits, on the event loop, refused before anything is allocated) and takes them as it writes (on the
compute thread). Two storages (`swarm.model.rows`), one accounting:

- `MappedRows` (Linux, CPU): the blocks are pages of one memory file per pool, mapped in order into one
  address range per session, so a session's history is one contiguous view however its blocks lie. A fork
  maps its source's full blocks (reference counted: held once however many sessions use them) and copies
  only the last partial one; a write into a block another session still holds copies it first (copy on
  write). A block nobody holds gives its memory back to the system.
- `TensorRows` (any device): one tensor per session, grown by doubling; a fork copies its prefix.

Invariants:
- `pool.committed` (blocks held by some session, counted once, plus credits) never exceeds `pool.blocks`.
- A session closed while a step of it may run (`release(later=True)`) counts its blocks free at once, but they
  stay as they are, given to nobody, until the compute thread calls `collect` between two jobs: that step
  reads and writes only what it owned.
"""

from __future__ import annotations

import functools
import heapq
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from swarm.errors import OutOfCache
from swarm.model.rows import MappedRows, Rows, TensorRows, punch

MIN_BLOCK_TOKENS = 16  # tokens of one row a block holds at least
MAX_BLOCK_TOKENS = 256  # ... and at most: a layout whose pages need more blocks its tokens in tensors instead


@dataclass(frozen=True)
class Part:
    """One attention layer's keys and values within a token (offsets in elements from the token's start); of
    `name` "indexer", its indexer's keys (one head, no values)."""

    layer: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    key_offset: int
    value_offset: int
    name: str = "kv"


@dataclass(frozen=True)
class KVLayout:
    """What one token of one row holds: every attention layer's keys then values, in `dtype` on `device`."""

    parts: tuple[Part, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, shapes: dict[int, tuple[int, int, int, int]], dtype: torch.dtype, device,
           indexers: dict[int, int] | None = None) -> KVLayout:
        """From each attention layer's (key heads, key dim, value heads, value dim), by global layer index, and
        each indexed layer's indexer key width (`indexers`)."""
        parts, offset = [], 0
        for layer in sorted(shapes):
            kh, kd, vh, vd = shapes[layer]
            parts.append(Part(layer, kh, kd, vh, vd, offset, offset + kh * kd))
            offset += kh * kd + vh * vd
            if indexers and layer in indexers:
                parts.append(Part(layer, 1, indexers[layer], 0, 0, offset, offset + indexers[layer], "indexer"))
                offset += indexers[layer]
        return cls(tuple(parts), dtype, torch.device(device))

    @functools.cached_property
    def token_elements(self) -> int:
        return sum(p.key_heads * p.key_dim + p.value_heads * p.value_dim for p in self.parts)

    @property
    def token_bytes(self) -> int:
        """Bytes one token of one row takes: 2 x layers x heads x head dim x the dtype's size, for uniform layers."""
        return self.token_elements * self.dtype.itemsize

    def part(self, layer: int, name: str = "kv") -> Part:
        for p in self.parts:
            if p.layer == layer and p.name == name:
                return p
        raise KeyError(f"layer {layer} keeps no {'keys and values' if name == 'kv' else name + ' keys'} in this layout")

    def mappable(self) -> bool:
        """Whether blocks of this layout can be pages of a memory file: Linux, the CPU, and a block size in range."""
        return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and self.device.type == "cpu" \
            and self.token_bytes > 0 and page_block_tokens(self.token_bytes) <= MAX_BLOCK_TOKENS


POOLS: weakref.WeakSet = weakref.WeakSet()  # every pool of this process: `collect_all`


def collect_all() -> None:
    """Free every pool's blocks in limbo (`Pool.collect`): what a compute thread calls between its jobs."""
    for pool in list(POOLS):
        pool.collect()


def memory(pools) -> dict[str, int]:
    """`Pool.memory` of `pools` (each once), summed; `token_bytes` the largest."""
    total = {"bytes": 0, "blocks": 0, "shared": 0, "token_bytes": 0}
    for pool in {id(p): p for p in pools}.values():
        for key, value in pool.memory().items():
            total[key] = max(total[key], value) if key == "token_bytes" else total[key] + value
    return total


def page_block_tokens(token_bytes: int) -> int:
    """The fewest tokens (at least `MIN_BLOCK_TOKENS`) whose bytes are a whole number of pages."""
    tokens = MIN_BLOCK_TOKENS
    while (tokens * token_bytes) % mmap.PAGESIZE:
        tokens += MIN_BLOCK_TOKENS
        if tokens > MAX_BLOCK_TOKENS:
            break
    return tokens


class Pool:
    """`blocks` blocks of `block_tokens` tokens of one row each, counted for every session of one layout:
    reference counts, free blocks (lowest first, so a session's blocks tend to lie in order) and credits
    (blocks promised to sessions that have not taken them yet). With `mapped`, the blocks are pages of one
    memory file that `MappedRows` maps; otherwise they are only counted and `TensorRows` holds the memory."""

    def __init__(self, layout: KVLayout, tokens: int, mapped: bool | None = None, block_tokens: int | None = None):
        """`block_tokens` (only for a pool that is not mapped): the counting unit, `MIN_BLOCK_TOKENS` by default."""
        if tokens < 1:
            raise ValueError("a cache pool holds at least one token")
        self.layout = layout
        self.mapped = layout.mappable() if mapped is None else mapped and layout.mappable()
        self.block_tokens = page_block_tokens(layout.token_bytes) if self.mapped else block_tokens or MIN_BLOCK_TOKENS
        self.block_bytes = self.block_tokens * layout.token_bytes
        self.blocks = -(-tokens // self.block_tokens)
        self._free = list(range(self.blocks))  # a heap
        self._limbo: list[int] = []  # blocks no session holds, not free until `collect` (a step may still read them)
        self._refs = [0] * self.blocks
        self.reserved = 0  # credits outstanding
        self.lock = threading.RLock()  # also taken by a storage given back when dropped
        self.fd = -1
        if self.mapped:
            self.fd = os.memfd_create("swarm-kv", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.blocks * self.block_bytes)  # no memory until a page is written
            weakref.finalize(self, os.close, self.fd)
        POOLS.add(self)

    @property
    def used(self) -> int:
        """Blocks some session holds (a shared block once)."""
        return self.blocks - len(self._free) - len(self._limbo)

    @property
    def committed(self) -> int:
        return self.used + self.reserved

    @property
    def available(self) -> int:
        """Blocks neither held nor promised."""
        return self.blocks - self.committed

    def blocks_for(self, tokens: int) -> int:
        return -(-max(tokens, 0) // self.block_tokens)

    def reserve(self, n: int) -> bool:
        """Promise `n` blocks to a session (event loop); False, promising nothing, if they are not there."""
        with self.lock:
            if n > self.available:
                return False
            self.reserved += n
            return True

    def unreserve(self, n: int) -> None:
        with self.lock:
            self.reserved -= n

    def _take(self, n: int, credits: int) -> list[int]:
        """`n` free blocks (lock held), paid with up to `credits` credits first; `OutOfCache` taking nothing."""
        paid = min(n, credits)
        if n - paid > self.available or n > len(self._free):
            raise OutOfCache(f"the cache is full: {n} blocks of {self.block_tokens} tokens needed, "
                             f"{self.available} of {self.blocks} free")
        self.reserved -= paid
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def _retain(self, ids) -> None:
        for i in ids:
            self._refs[i] += 1

    def _release(self, ids, later: bool = False) -> None:
        """Drop one hold of each block (lock held); those nobody holds any more are free, or with `later` in limbo
        until `collect`: counted as free, but neither given out nor emptied before then."""
        freed = []
        for i in ids:
            self._refs[i] -= 1
            if not self._refs[i]:
                freed.append(i)
        if later:
            self._limbo.extend(freed)
        else:
            self._free_all(freed)

    def _free_all(self, ids: list[int]) -> None:
        for i in ids:
            heapq.heappush(self._free, i)
        if self.mapped:
            punch(self.fd, sorted(ids), self.block_bytes)  # the memory goes back to the system

    def collect(self) -> None:
        """Free the blocks in limbo: call it where no step can read them (between two jobs of the compute thread)."""
        if not self._limbo:  # nothing closed since (a close racing this is collected before the next job)
            return
        with self.lock:
            limbo, self._limbo = self._limbo, []
            self._free_all(limbo)

    def shared(self, block: int) -> bool:
        return self._refs[block] > 1

    def memory(self) -> dict[str, int]:
        """What the pool holds now: bytes of memory (the pages written, for a mapped pool; the blocks' worth of
        bytes otherwise), blocks held, blocks held by more than one session."""
        with self.lock:
            shared = sum(1 for r in self._refs if r > 1)
            used = self.used
        held = os.fstat(self.fd).st_blocks * 512 if self.mapped else used * self.block_bytes
        return {"bytes": held, "blocks": used, "shared": shared, "token_bytes": self.layout.token_bytes}

    def rows(self, rows: int, capacity: int) -> Rows:
        """An empty storage of `rows` sequences of up to `capacity` tokens in this pool."""
        return (MappedRows if self.mapped else TensorRows)(self, rows, capacity)
