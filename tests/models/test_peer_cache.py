"""The peer's cache memory, through its servicer (no network): what sessions and forks commit is counted exactly
(a prefix shared by forks once), a request that does not fit is refused before anything is allocated, idle
sessions go first when room is made, and after thousands of sessions opened, stepped, forked, rolled back and
closed, every block and every byte of memory is back."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest
import torch

from peer.compute import MIN_CHUNK, chunk_tokens
from peer.config import PeerConfig
from peer.metrics import PeerMetrics
from peer.runtime import Runtime
from peer.servicer import Served, Servicer
from peer.sessions import SessionTable
from swarm.errors import BadRequest, OutOfCache, SwarmError
from swarm.model import kv
from swarm.model.blocks import SpanBlocks
from swarm.net import messages
from swarm.span import Span

pytestmark = pytest.mark.models

SPAN = Span(0, 6)
HIDDEN = 64


def resident(pool) -> int:
    return os.fstat(pool.fd).st_blocks * 512 if pool.mapped else 0


def step_message(step: int, position: int, hidden: torch.Tensor) -> messages.Step:
    return messages.Step(step, position, messages.Hidden.encode(hidden, "float32"))


class Peer:
    """A servicer over tiny llama blocks, with a cache budget of `cache_tokens`, run from one event loop."""

    def __init__(self, path: Path, cache_tokens: int, max_sessions: int = 64, share: float = 1.0):
        self.config = PeerConfig(model=path, cache_tokens=cache_tokens, max_sessions=max_sessions, client_share=share)
        self.blocks = SpanBlocks(path, SPAN)
        self.blocks.size_pool(cache_tokens)
        self.pool = self.blocks.pool
        self.table = SessionTable(cache_tokens, max_sessions, share)
        self.runtime = Runtime(between=kv.collect_all)
        self.servicer = Servicer(self.config, Served("peer", "m", SPAN, "v"), self.blocks, self.runtime, self.table,
                                 PeerMetrics())
        self.g = torch.Generator().manual_seed(0)
        self.steps = 0

    def open(self, max_length: int = 256, batch: int = 1, client: str = "c", fork=None, length: int | None = None):
        request = messages.Open("m", SPAN.start, SPAN.end, max_length, batch, fork=fork, fork_length=length)
        return self.servicer._open(request, client) if fork is None else self.servicer._fork(request, client)

    async def step(self, session, position: int, tokens: int):
        self.steps += 1
        x = torch.randn(session.batch, tokens, HIDDEN, generator=self.g)
        return await self.servicer._chained_step(session, step_message(self.steps, position, x))


@pytest.fixture
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def test_the_budget_counts_a_prefix_shared_by_forks_once(llama):
    peer = Peer(llama, cache_tokens=4096)

    async def main():
        source = peer.open()
        await peer.step(source, 0, 100)
        alone = peer.table.reserved
        forks = [await peer.open(fork=source.id, length=100) for _ in range(8)]
        return source, forks, alone

    with peer.runtime:
        source, forks, alone = asyncio.run(main())
    block = peer.pool.block_tokens
    own = 128 // block - 100 // block if peer.pool.mapped else 128 // block  # a fork's blocks past the full ones
    assert peer.table.reserved == alone + 8 * own * block
    assert all(f.cache.length == 100 for f in forks)
    for s in (source, *forks):
        peer.table.close(s.id)
    peer.pool.collect()
    assert (peer.table.reserved, peer.pool.used, peer.pool.reserved, resident(peer.pool)) == (0, 0, 0, 0)


def test_what_does_not_fit_is_refused_before_anything_is_allocated(llama):
    peer = Peer(llama, cache_tokens=512, share=0.25)

    async def main():
        busy = []
        for client in "abcd":  # every client at its share, each session stepped just now: nothing is reclaimable
            s = peer.open(client=client)
            await peer.step(s, 0, 100)
            busy.append(s)
        committed, memory = peer.pool.committed, resident(peer.pool)
        with pytest.raises(OutOfCache, match="more cache tokens needed, 0 of 512 are free"):
            peer.open(client="e")
        with pytest.raises(OutOfCache, match="more cache tokens needed"):
            await peer.open(client="a", fork=busy[0].id, length=100)
        with pytest.raises(OutOfCache, match="batch 1 x length 1024 needs more than this peer's whole cache"):
            peer.open(max_length=1024, client="e")
        assert (peer.pool.committed, resident(peer.pool), len(peer.table.sessions)) == (committed, memory, 4)
        with pytest.raises(BadRequest, match="'fork_length' 101 is past the end of session .* it holds 100"):
            await peer.open(client="a", fork=busy[0].id, length=101)
        with pytest.raises(BadRequest, match="step at position 120 skips past the cache end 100"):
            await peer.step(busy[1], 120, 1)
        return busy

    with peer.runtime:
        busy = asyncio.run(main())
    assert all(not s.closed for s in busy) and len(peer.table.sessions) == 4


def test_idle_sessions_go_first_when_room_is_made(llama):
    peer = Peer(llama, cache_tokens=512, share=0.25)

    async def main():
        over = [peer.open(client="hog") for _ in range(3)]  # over its share, stepping
        idle = peer.open(client="kept")  # a gateway's kept session: silent
        for s in (*over, idle):
            await peer.step(s, 0, 100)
        idle.used_at -= 60.0  # silent for a minute
        return over, idle, peer.open(client="new")

    with peer.runtime:
        over, idle, new = asyncio.run(main())
    assert idle.closed and not any(s.closed for s in over) and not new.closed


def test_thousands_of_sessions_leave_nothing_behind(llama):
    peer = Peer(llama, cache_tokens=2048, max_sessions=12, share=1.0)
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    baseline = resident(peer.pool)

    async def one(op: str, open_sessions: list) -> None:
        if op == "open" or not open_sessions:
            open_sessions.append(peer.open(max_length=rng.choice([64, 200, 512]), batch=rng.choice([1, 1, 2])))
            return
        s = rng.choice(open_sessions)
        if s.closed:
            open_sessions.remove(s)
            return
        length = s.cache.length
        if op == "close":
            peer.table.close(s.id)
            open_sessions.remove(s)
        elif op == "fork" and length:
            open_sessions.append(await peer.open(max_length=s.max_length, batch=s.batch, fork=s.id,
                                                 length=rng.randint(1, length)))
        elif op == "rollback" and length:
            await peer.step(s, rng.randint(0, length - 1), rng.randint(1, 3))
        elif length < s.max_length - 40:
            await peer.step(s, length, rng.choice([1, 1, 1, 5, 17, 40]))

    async def main():
        open_sessions: list = []
        ops = ["open"] * 2 + ["step"] * 6 + ["fork"] * 2 + ["rollback"] * 2 + ["close"] * 3
        for _ in range(3000):
            op = rng.choice(ops)
            try:
                await one(op, open_sessions)
                outcomes[op] = outcomes.get(op, 0) + 1
            except SwarmError as e:  # full, reclaimed meanwhile: typed refusals, counted
                outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
            assert peer.table.reserved <= peer.config.cache_tokens
        for s in list(peer.table.sessions.values()):
            peer.table.close(s.id)

    started = time.monotonic()
    with peer.runtime:
        asyncio.run(main())
    assert outcomes.get("fork", 0) > 100 and outcomes.get("rollback", 0) > 100 and outcomes.get("close", 0) > 300
    assert time.monotonic() - started < 300
    assert (peer.table.reserved, peer.pool.used, peer.pool.reserved) == (0, 0, 0)
    peer.pool.collect()  # what the compute thread does between its jobs (it stopped with the runtime)
    assert resident(peer.pool) == baseline == 0  # every page of keys and values given back to the system


def test_a_session_closed_while_its_step_runs_keeps_its_blocks_until_the_step_is_done(llama):
    """Closing gives the blocks back to the count at once, but they are neither reused nor emptied before the
    compute thread's next turn: a step still running reads what it wrote."""
    blocks = SpanBlocks(llama, SPAN)
    cache = blocks.new_cache(1, 64)
    with torch.inference_mode():
        blocks(torch.randn(1, 20, HIDDEN), cache, 0)
    keys = cache.attention[0].keys.clone()
    held = set(cache.rows.tables[0])
    assert blocks.pool.used == len(held) == 2
    cache.rows.release(later=True)  # as the session table does
    assert blocks.pool.used == 0  # counted free at once
    assert torch.equal(cache.attention[0].keys, keys)  # and still readable
    other = blocks.new_cache(1, 64)
    other.begin(16)  # a new session does not get its blocks before they are collected
    assert not set(other.rows.tables[0]) & held
    blocks.pool.collect()  # what the compute thread does between two jobs
    assert blocks.pool.used == len(other.rows.tables[0]) == 1
    if blocks.pool.mapped:
        assert not cache.attention[0].keys.any()  # emptied: its pages went back to the system


def test_a_fork_that_fails_gives_back_what_was_committed_for_it(tmp_path):
    from family_harness import build

    path = build("granitemoehybrid", tmp_path / "ckpt")
    config = PeerConfig(model=path, cache_tokens=4096)
    blocks = SpanBlocks(path, SPAN)
    table = SessionTable(4096, 64)
    with Runtime(between=kv.collect_all) as runtime:
        servicer = Servicer(config, Served("peer", "m", SPAN, "v"), blocks, runtime, table, PeerMetrics())

        async def main():
            source = servicer._open(messages.Open("m", 0, 6, 256, 1), "c")
            for position, tokens in ((0, 5), (5, 3)):  # step ends at 5 and 8: states kept there only
                x = torch.randn(1, tokens, 64)
                await servicer._chained_step(source, step_message(position + 1, position, x))
            before = (table.reserved, blocks.pool.reserved)
            with pytest.raises(BadRequest, match="recurrent state is kept only at"):
                await servicer._fork(messages.Open("m", 0, 6, 256, 1, fork=source.id, fork_length=6), "c")
            return before

        before = asyncio.run(main())
    assert (table.reserved, blocks.pool.reserved) == before and len(table.sessions) == 1


def test_a_long_step_runs_in_small_chunks_while_others_decode_and_gives_the_output_of_one_forward(llama):
    """A 100-token step: one job while no other session decodes on the peer, chunks of `MIN_CHUNK` while one
    does (its steps run between them); the outputs and the cache are those of the step run whole."""
    peer = Peer(llama, cache_tokens=4096)
    peer.servicer.served.prefill_tps = 1600.0  # 32 tokens in 0.02 s while others decode, 240 in 0.15 s alone
    assert (chunk_tokens(1600.0, company=True), chunk_tokens(1600.0, company=False)) == (MIN_CHUNK, 240)
    x = torch.randn(1, 100, HIDDEN, generator=torch.Generator().manual_seed(1))
    whole_cache = peer.blocks.new_cache(1, 256)
    with torch.inference_mode():
        whole = peer.blocks(x, whole_cache, 0)

    async def main():
        jobs = []
        for company in (False, True):
            decoder, session = peer.open(), peer.open()
            await peer.step(decoder, 0, 4)
            if company:
                await peer.step(decoder, 4, 1)  # a one-token step: the decoder counts as decoding for a while
            assert peer.runtime.decoding(besides=session.id) == company
            before = peer.runtime.jobs_done
            out = messages.Output.from_message(await peer.servicer._chained_step(session, step_message(99, 0, x)))
            jobs.append(peer.runtime.jobs_done - before)
            torch.testing.assert_close(out.hidden.decode(), whole, rtol=1e-5, atol=1e-5)
            assert session.cache.length == 100
        return jobs

    with peer.runtime:
        jobs = asyncio.run(main())
    assert jobs == [1, -(-100 // MIN_CHUNK)]
