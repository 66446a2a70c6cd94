"""Where a span's attention keys and values live: storage allocated ahead, written in place, shared by forks.

Layout (`KVLayout`): token-major. A session of `rows` sequences holds, per row, up to `capacity` tokens; each
token holds every attention layer's keys then values, head after head. A layer's keys for a session's first
L tokens are a strided view `[rows, heads, L, dim]` of that storage (`Rows.keys`): a step writes its new
tokens where they belong (`Rows.write`) and attends over a view; no step copies history.

Memory is counted in blocks of `block_tokens` tokens of one row (`Pool`): a session reserves blocks ahead
(credits, on the event loop, refused before anything is allocated) and takes them as it writes (on the
compute thread). Two storages, one accounting:

- `MappedRows` (Linux, CPU): the blocks are pages of one memory file per pool, mapped in order into one
  address range per session, so a session's history is one contiguous view however its blocks lie. A fork
  maps its source's full blocks (reference counted: held once however many sessions use them) and copies
  only the last partial one; a write into a block another session still holds copies it first (copy on
  write). A block nobody holds gives its memory back to the system at once.
- `TensorRows` (any device): one tensor per session, grown by doubling; a fork copies its prefix.

Invariants:
- `pool.committed` (blocks held by some session, counted once, plus credits) never exceeds `pool.blocks`.
- A row's block table covers at least its written tokens; positions past a session's length are never read.
- A session's address range stays mapped while any view of it is alive (its last view unmaps it), so a
  session closed while a step of it runs never faults; its blocks may already serve another session, whose
  own steps run after that step.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from swarm.errors import BadRequest, OutOfCache, UnknownSession

MIN_BLOCK_TOKENS = 16  # tokens of one row a block holds at least
MAX_BLOCK_TOKENS = 256  # ... and at most: a layout whose pages need more blocks its tokens in tensors instead
FIRST_TENSOR_TOKENS = 256  # a `TensorRows` starts at this many tokens per row (or its capacity), then doubles


@dataclass(frozen=True)
class Part:
    """One attention layer's keys and values within a token (offsets in elements from the token's start)."""

    layer: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    key_offset: int
    value_offset: int


@dataclass(frozen=True)
class KVLayout:
    """What one token of one row holds: every attention layer's keys then values, in `dtype` on `device`."""

    parts: tuple[Part, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, shapes: dict[int, tuple[int, int, int, int]], dtype: torch.dtype, device) -> KVLayout:
        """From each attention layer's (key heads, key dim, value heads, value dim), by global layer index."""
        parts, offset = [], 0
        for layer in sorted(shapes):
            kh, kd, vh, vd = shapes[layer]
            parts.append(Part(layer, kh, kd, vh, vd, offset, offset + kh * kd))
            offset += kh * kd + vh * vd
        return cls(tuple(parts), dtype, torch.device(device))

    @property
    def token_elements(self) -> int:
        return sum(p.key_heads * p.key_dim + p.value_heads * p.value_dim for p in self.parts)

    @property
    def token_bytes(self) -> int:
        """Bytes one token of one row takes: 2 x layers x heads x head dim x the dtype's size, for uniform layers."""
        return self.token_elements * self.dtype.itemsize

    def part(self, layer: int) -> Part:
        for p in self.parts:
            if p.layer == layer:
                return p
        raise KeyError(f"layer {layer} keeps no keys and values in this layout")

    def mappable(self) -> bool:
        """Whether blocks of this layout can be pages of a memory file: Linux, the CPU, and a block size in range."""
        return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and self.device.type == "cpu" \
            and self.token_bytes > 0 and page_block_tokens(self.token_bytes) <= MAX_BLOCK_TOKENS


POOLS: weakref.WeakSet = weakref.WeakSet()  # every pool of this process: `collect_all`


def collect_all() -> None:
    """Free every pool's blocks in limbo (`Pool.collect`): what a compute thread calls between its jobs."""
    for pool in list(POOLS):
        pool.collect()


def page_block_tokens(token_bytes: int) -> int:
    """The fewest tokens (at least `MIN_BLOCK_TOKENS`) whose bytes are a whole number of pages."""
    tokens = MIN_BLOCK_TOKENS
    while (tokens * token_bytes) % mmap.PAGESIZE:
        tokens += MIN_BLOCK_TOKENS
        if tokens > MAX_BLOCK_TOKENS:
            break
    return tokens


# ---- the operating system's calls the memory file needs (Linux) ----

_MAP_FIXED, _MAP_NORESERVE, _PROT_NONE = 0x10, 0x4000, 0
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _libc = libc
    return _libc


def _check_map(address: int | None, what: str) -> int:
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OutOfCache(f"could not map {what}: {os.strerror(err)} (the system's address or mapping limits)")
    return address


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

    def _refs_clear(self, ids) -> None:
        for i in ids:
            self._refs[i] = 0

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
            for start, count in _runs(sorted(ids)):  # the memory goes back to the system
                _c().fallocate(self.fd, _FALLOC_PUNCH_HOLE, start * self.block_bytes, count * self.block_bytes)

    def collect(self) -> None:
        """Free the blocks in limbo: call it where no step can read them (between two jobs of the compute thread)."""
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


@dataclass
class _Holdings:
    """What a storage holds of its pool: its rows' blocks and its credits (kept apart from the storage, so that
    a storage dropped without `release` still gives them back)."""

    tables: list[list[int]]
    credits: int = 0
    closed: bool = False


def _give_back(pool: Pool, holdings: _Holdings, later: bool = False) -> None:
    with pool.lock:
        if holdings.closed:
            return
        holdings.closed = True
        pool.reserved -= holdings.credits
        holdings.credits = 0
        pool._release([b for t in holdings.tables for b in t], later)
        holdings.tables[:] = [[] for _ in holdings.tables]


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as (first, count) runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(a, n) for a, n in runs]


class Rows:
    """One session's keys and values: `rows` sequences, up to `capacity` tokens each, in `pool`'s blocks."""

    def __init__(self, pool: Pool, rows: int, capacity: int):
        self.pool, self.rows, self.capacity = pool, rows, capacity
        self.holdings = _Holdings([[] for _ in range(rows)])
        # given back by `release`, or when the storage is dropped without it (a session of a test, a local chain)
        self._give_back = weakref.finalize(self, _give_back, pool, self.holdings)

    @property
    def tables(self) -> list[list[int]]:
        """Per row: its blocks, in token order."""
        return self.holdings.tables

    @property
    def credits(self) -> int:
        return self.holdings.credits

    @credits.setter
    def credits(self, value: int) -> None:
        self.holdings.credits = value

    @property
    def closed(self) -> bool:
        return self.holdings.closed

    # ---- accounting (event loop) ----

    @property
    def held(self) -> int:
        """Blocks this session's rows cover, with credits: what it would cost if it held nothing shared."""
        return sum(len(t) for t in self.tables) + self.credits

    def exclusive(self) -> int:
        """Blocks closing this session would free (those no other session holds), with its credits."""
        with self.pool.lock:
            return sum(1 for t in self.tables for b in t if not self.pool.shared(b)) + self.credits

    def need(self, tokens: int) -> int:
        """Blocks more it takes for `tokens` tokens per row to be covered by blocks or credits."""
        with self.pool.lock:
            return max(0, self.rows * self.pool.blocks_for(min(tokens, self.capacity)) - self.held)

    def reserve(self, tokens: int) -> bool:
        """Make sure `tokens` tokens per row are covered by blocks or credits; False (nothing promised) if the pool
        cannot."""
        return self.promise(self.need(tokens))

    def promise(self, blocks: int) -> bool:
        """`blocks` more credits from the pool; False (nothing promised) if it has not that many free."""
        with self.pool.lock:
            if blocks <= 0:
                return True
            if self.closed or blocks > self.pool.available:
                return False
            self.pool.reserved += blocks
            self.credits += blocks
            return True

    def release(self, later: bool = False) -> None:
        """Give every block and credit back (the session closed). With `later` (a compute thread may be running a
        step of it), its blocks stay as they are until the pool's next `collect`; views already taken stay
        readable either way."""
        if later:
            self._give_back.detach()
            _give_back(self.pool, self.holdings, later=True)
        else:
            self._give_back()

    def return_credits(self, credits: int) -> None:
        """Credits taken from this storage (`take_credits`) and not used, back to it."""
        with self.pool.lock:
            if self.closed:
                self.pool.reserved -= credits
            else:
                self.credits += credits

    def take_credits(self) -> int:
        """This storage's credits, handed over (to the storage of a fork made for the same session)."""
        with self.pool.lock:
            credits, self.credits = self.credits, 0
            return credits

    def blocks(self) -> set[int]:
        """The blocks this storage's rows hold (a snapshot)."""
        with self.pool.lock:
            return {b for t in self.tables for b in t}

    # ---- storage (compute thread) ----

    def prepare(self, start: int, end: int) -> None:
        """Make tokens [start, end) of every row writable by this session alone: blocks taken (credits first),
        shared blocks copied. `OutOfCache`, changing nothing that was written, if the pool is out of blocks."""
        if end > self.capacity:
            raise BadRequest(f"a step to {end} tokens exceeds the session's {self.capacity}")
        with self.pool.lock:
            if self.closed:  # closed while its step waited: it may not write any more
                raise UnknownSession("the session was closed and its cache given back")
            first, last = start // self.pool.block_tokens, self.pool.blocks_for(end)
            new = sum(max(0, last - len(t)) for t in self.tables)
            copies = [(r, j) for r, t in enumerate(self.tables) for j in range(first, min(last, len(t)))
                      if self.pool.shared(t[j])]
            ids = self.pool._take(new + len(copies), self.credits)
            paid = min(self.credits, new + len(copies))
            self.credits -= paid
            placed: list[tuple[int, int, int | None]] = []  # (row, index, the block it replaced)
            try:
                taken = iter(ids)
                for r, t in enumerate(self.tables):
                    while len(t) < last:
                        t.append(next(taken))
                        placed.append((r, len(t) - 1, None))
                        self._place(r, len(t) - 1, None)
                for r, j in copies:
                    old, self.tables[r][j] = self.tables[r][j], next(taken)
                    placed.append((r, j, old))
                    self._place(r, j, old)
            except BaseException:  # a mapping failed: every block back where it was, nothing taken
                for r, j, old in reversed(placed):
                    if old is None:
                        self.tables[r].pop()
                    else:
                        self.tables[r][j] = old
                        with contextlib.suppress(Exception):
                            self._place(r, j, None)
                self.pool._free_all(ids)
                self.pool._refs_clear(ids)
                self.credits += paid
                self.pool.reserved += paid
                raise
            for _, _, old in placed:
                if old is not None:
                    self.pool._release([old])

    def _place(self, row: int, index: int, copy_of: int | None) -> None:
        """Put the row's block `index` in place (its table entry is set); with `copy_of`, holding that block's
        contents (lock held)."""
        raise NotImplementedError

    def keys(self, part: Part, length: int) -> torch.Tensor:
        return self._view(part.key_offset, part.key_heads, part.key_dim, length)

    def values(self, part: Part, length: int) -> torch.Tensor:
        return self._view(part.value_offset, part.value_heads, part.value_dim, length)

    def write(self, part: Part, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values [rows, heads, n, dim] of tokens [start, start + n) (prepared)."""
        end = start + keys.shape[-2]
        self.keys(part, end)[:, :, start:] = keys
        self.values(part, end)[:, :, start:] = values

    def _view(self, offset: int, heads: int, dim: int, length: int) -> torch.Tensor:
        raise NotImplementedError

    def fork(self, length: int, capacity: int, credits: int = 0) -> Rows:
        """A new storage holding tokens [0, `length`) of this one, for up to `capacity` tokens, paid with
        `credits` (already reserved) first."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of the blocks this session covers (a shared block counted in full)."""
        return sum(len(t) for t in self.tables) * self.pool.block_bytes


class MappedRows(Rows):
    """Rows whose blocks are pages of the pool's memory file, mapped in order into one address range."""

    def __init__(self, pool: Pool, rows: int, capacity: int):
        super().__init__(pool, rows, capacity)
        self.row_blocks = pool.blocks_for(capacity)
        self.row_bytes = self.row_blocks * pool.block_bytes
        size = rows * self.row_bytes
        c = _c()
        self.address = _check_map(c.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS |
                                         _MAP_NORESERVE, -1, 0), f"{size} bytes of address space")
        buffer = type("Range", (ctypes.c_char * size,), {}).from_address(self.address)
        weakref.finalize(buffer, c.munmap, self.address, size)  # once no view of it is left
        self.flat = torch.frombuffer(buffer, dtype=pool.layout.dtype)  # reserved only: mapped block by block

    def _place(self, row: int, index: int, copy_of: int | None) -> None:
        pool, block = self.pool, self.tables[row][index]
        at = self.address + row * self.row_bytes + index * pool.block_bytes
        if copy_of is not None:  # the new block gets the old one's contents before it takes its place
            scratch = _check_map(_c().mmap(None, pool.block_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                                           pool.fd, block * pool.block_bytes), "a block")
            ctypes.memmove(scratch, at, pool.block_bytes)
            _c().munmap(scratch, pool.block_bytes)
        _check_map(_c().mmap(at, pool.block_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                             pool.fd, block * pool.block_bytes), "a block")

    def _view(self, offset: int, heads: int, dim: int, length: int) -> torch.Tensor:
        token = self.pool.layout.token_elements
        return self.flat.as_strided((self.rows, heads, length, dim), (self.row_bytes // self.flat.element_size(),
                                                                      dim, token, 1), offset)

    def fork(self, length: int, capacity: int, credits: int = 0) -> MappedRows:
        new = MappedRows(self.pool, self.rows, capacity)
        new.credits = credits
        full, partial = divmod(length, self.pool.block_tokens)
        with self.pool.lock:
            if self.closed:
                raise UnknownSession("the source session was closed and its cache given back")
            shared = [t[:full] for t in self.tables]
            for r, blocks in enumerate(shared):
                self.pool._retain(blocks)
                new.tables[r] = list(blocks)
                for j in range(full):
                    new._place(r, j, None)
        if partial:
            try:
                new.prepare(full * self.pool.block_tokens, length)  # its own last block ...
            except BaseException:
                new.release()
                raise
            token = self.pool.layout.token_elements
            for r in range(self.rows):  # ... holding the source's tokens there
                at = full * self.pool.block_tokens * token
                new._row(r)[at:at + partial * token] = self._row(r)[at:at + partial * token]
        return new

    def _row(self, row: int) -> torch.Tensor:
        per = self.row_bytes // self.flat.element_size()
        return self.flat[row * per:(row + 1) * per]


class TensorRows(Rows):
    """Rows in one tensor `[rows, tokens, token elements]` on the layout's device, grown by doubling (the only
    copies: as many as doublings, not one per step)."""

    def __init__(self, pool: Pool, rows: int, capacity: int):
        super().__init__(pool, rows, capacity)
        self.data: torch.Tensor | None = None
        self.written = 0  # tokens per row that hold data (what a growth copies)

    def prepare(self, start: int, end: int) -> None:
        super().prepare(start, end)
        size = 0 if self.data is None else self.data.shape[1]
        if end > size:
            grown = min(self.capacity, max(end, 2 * size, FIRST_TENSOR_TOKENS))
            layout = self.pool.layout
            data = torch.empty(self.rows, grown, layout.token_elements, dtype=layout.dtype, device=layout.device)
            if self.data is not None and self.written:
                data[:, :self.written] = self.data[:, :self.written]
            self.data = data
        self.written = max(min(self.written, start), end)

    def _place(self, row: int, index: int, copy_of: int | None) -> None:
        pass  # the tensor holds the memory; blocks only count it

    def _view(self, offset: int, heads: int, dim: int, length: int) -> torch.Tensor:
        if self.data is None:
            layout = self.pool.layout
            return torch.empty(self.rows, heads, 0, dim, dtype=layout.dtype, device=layout.device)
        token = self.data.shape[2]
        return self.data.as_strided((self.rows, heads, length, dim), (self.data.shape[1] * token, dim, token, 1),
                                    self.data.storage_offset() + offset)

    def fork(self, length: int, capacity: int, credits: int = 0) -> TensorRows:
        new = TensorRows(self.pool, self.rows, capacity)
        new.credits = credits
        if length:
            new.prepare(0, length)
            new.data[:, :length] = self.data[:, :length]
        return new

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()
