"""A session's keys and values in its pool's blocks (`Rows`): the storages `swarm.model.kv.Pool` gives out, and
the operating system's calls the mapped one needs.

- `MappedRows` (Linux, CPU): the blocks are pages of the pool's memory file, mapped in order into one address
  range reserved per session: a history whose blocks lie anywhere is one contiguous view. A fork maps its
  source's full blocks and copies only the last partial one; a write into a block another session holds copies
  it first.
- `TensorRows` (any device): one tensor per session, grown by doubling; a fork copies its prefix.

Invariants:
- A row's block table covers at least its written tokens; positions past a session's length are never read.
- A session's address range stays mapped while any view of it is alive (its last view unmaps it).
- What a storage holds (blocks, credits) goes back to its pool when it is released, or when it is dropped
  without that.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass
import torch

from swarm.errors import BadRequest, OutOfCache, UnknownSession

FIRST_TENSOR_TOKENS = 256  # a `TensorRows` starts at this many tokens per row (or its capacity), then doubles


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


@dataclass
class _Holdings:
    """What a storage holds of its pool: its rows' blocks and its credits (kept apart from the storage, so that
    a storage dropped without `release` still gives them back)."""

    tables: list[list[int]]
    credits: int = 0
    closed: bool = False


def _give_back(pool, holdings: _Holdings, later: bool = False) -> None:
    with pool.lock:
        if holdings.closed:
            return
        holdings.closed = True
        pool.reserved -= holdings.credits
        holdings.credits = 0
        pool._release([b for t in holdings.tables for b in t], later)
        holdings.tables[:] = [[] for _ in holdings.tables]


def punch(fd: int, ids: list[int], block_bytes: int) -> None:
    """Give the memory of blocks `ids` (sorted) of a memory file back to the system: they read as zeros after."""
    for start, count in _runs(ids):
        _c().fallocate(fd, _FALLOC_PUNCH_HOLE, start * block_bytes, count * block_bytes)


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
    """One session's keys and values: `rows` sequences, up to `capacity` tokens each, in the blocks of `pool` (a
    `swarm.model.kv.Pool`); a layer's keys and values are a `swarm.model.kv.Part` of each token."""

    def __init__(self, pool, rows: int, capacity: int):
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
                self.pool._release(ids)  # held by nothing else yet: free again
                self.credits += paid
                self.pool.reserved += paid
                raise
            self.pool._release([old for _, _, old in placed if old is not None])

    def _place(self, row: int, index: int, copy_of: int | None) -> None:
        """Put the row's block `index` in place (its table entry is set); with `copy_of`, holding that block's
        contents (lock held)."""
        raise NotImplementedError

    def keys(self, part, length: int) -> torch.Tensor:
        return self._view(part.key_offset, part.key_heads, part.key_dim, 0, length)

    def values(self, part, length: int) -> torch.Tensor:
        return self._view(part.value_offset, part.value_heads, part.value_dim, 0, length)

    def write(self, part, start: int, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """Keys and values [rows, heads, n, dim] of tokens [start, start + n) (prepared); no values for a part
        that has none."""
        n = keys.shape[-2]
        self._view(part.key_offset, part.key_heads, part.key_dim, start, n).copy_(keys)
        if values is not None:
            self._view(part.value_offset, part.value_heads, part.value_dim, start, n).copy_(values)

    def _view(self, offset: int, heads: int, dim: int, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) of the part at `offset` of every row: `[rows, heads, length, dim]`."""
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

    def __init__(self, pool, rows: int, capacity: int):
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
        self.token, self.row_elements = pool.layout.token_elements, self.row_bytes // self.flat.element_size()

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

    def _view(self, offset: int, heads: int, dim: int, start: int, length: int) -> torch.Tensor:
        token = self.token
        return self.flat.as_strided((self.rows, heads, length, dim), (self.row_elements, dim, token, 1),
                                    offset + start * token)

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
        per = self.row_elements
        return self.flat[row * per:(row + 1) * per]


class TensorRows(Rows):
    """Rows in one tensor `[rows, tokens, token elements]` on the layout's device, grown by doubling (the only
    copies: as many as doublings, not one per step)."""

    def __init__(self, pool, rows: int, capacity: int):
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

    def _view(self, offset: int, heads: int, dim: int, start: int, length: int) -> torch.Tensor:
        if self.data is None:
            layout = self.pool.layout
            return torch.empty(self.rows, heads, 0, dim, dtype=layout.dtype, device=layout.device)
        token = self.data.shape[2]
        return self.data.as_strided((self.rows, heads, length, dim), (self.data.shape[1] * token, dim, token, 1),
                                    self.data.storage_offset() + offset + start * token)

    def fork(self, length: int, capacity: int, credits: int = 0) -> TensorRows:
        new = TensorRows(self.pool, self.rows, capacity)
        new.credits = credits
        if length:
            new.prepare(0, length)
            if self.data is not None:  # none: a span that keeps no keys or values (recurrent layers only)
                new.data[:, :length] = self.data[:, :length]
        return new

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()
