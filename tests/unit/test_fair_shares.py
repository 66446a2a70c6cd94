"""Fair shares of one peer: cache committed as sessions grow, reclaiming by client holdings and idle time, the
figure announced for new clients, and compute taken in turns by clients (`peer.sessions`, `peer.runtime`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from peer.compute import FORWARD_JOB_TOKENS, forward_parts
from peer.config import PeerConfig
from peer.runtime import Batch, ClientSlots, Runtime
from peer.sessions import GROW_TOKENS, SessionTable
from swarm.errors import Busy, ConfigError, OutOfCache, UnknownSession
from swarm.span import Span
from runtime_gate import WAIT, Gate

pytestmark = pytest.mark.unit

SPAN = Span(0, 2)
ENC = ("float32",)
HOG, HONEST, THIRD = "hog", "honest", "third"


def table(cache_tokens: int = 1024, max_sessions: int = 8, share: float = 0.25, **kw) -> SessionTable:
    return SessionTable(cache_tokens, max_sessions, share=share, reclaim_idle=5.0, **kw)


def filled(t: SessionTable, client: str, length: int, now: float, batch: int = 1):
    """A session of `client` that has run `length` tokens, its last step at `now`."""
    s = t.open(SPAN, batch, 512, ENC, now, client)
    t.grow(s, length, now)
    return s


# ---- identities that cost nothing ----

def test_identities_that_took_every_slot_at_their_share_lose_their_excess_to_a_newcomer():
    """4 identities hold all 64 slots (16 each, their 25% share) and keep them busy: a newcomer still opens one, by
    reclaiming a session of one of them; to refuse it, as many identities as slots must hold one each."""
    t = table(cache_tokens=64 * 1024, max_sessions=64)
    sybils = [f"sybil{i}" for i in range(4)]
    for sybil in sybils:
        for _ in range(16):
            t.open(SPAN, 1, 64, ENC, 0.0, sybil)
    with pytest.raises(Busy):  # one of them opening a 17th: over its share
        t.open(SPAN, 1, 64, ENC, 0.0, sybils[0])
    mine = t.open(SPAN, 1, 64, ENC, 1.0, HONEST)
    _, count = t.held()
    assert mine.id in t.sessions and count[HONEST] == 1 and sorted(count[s] for s in sybils) == [15, 16, 16, 16]
    crowd = table(cache_tokens=8 * 1024, max_sessions=8)
    for i in range(8):
        crowd.open(SPAN, 1, 64, ENC, 0.0, f"sybil{i}")
    with pytest.raises(Busy, match="its share is 1"):
        crowd.open(SPAN, 1, 64, ENC, 1.0, HONEST)


# ---- committed as used ----

def test_a_long_max_length_with_a_short_prompt_holds_a_chunk():
    t = table(cache_tokens=8192)
    s = t.open(SPAN, 2, 4096, ENC, 0.0, HONEST)
    assert s.reserved == 2 * GROW_TOKENS and t.tokens_left == 8192 - 2 * GROW_TOKENS
    t.grow(s, 20, 0.0)  # a prompt within the chunk: nothing more
    assert s.reserved == 2 * GROW_TOKENS
    t.grow(s, GROW_TOKENS + 1, 0.0)  # in whole chunks
    assert s.room == 2 * GROW_TOKENS
    t.grow(s, 3 * GROW_TOKENS - 5, 0.0)
    assert s.room == 3 * GROW_TOKENS
    t.grow(s, 10**6, 0.0)  # never past the session's max length
    assert s.room == 4096 and t.tokens_left == 0
    assert table().open(SPAN, 1, 100, ENC, 0.0, HONEST).room == 100  # a short session: its max length


def test_a_closed_session_does_not_grow():
    t = table()
    s = t.open(SPAN, 1, 512, ENC, 0.0, HONEST)
    filled(t, HOG, 512, 0.0)
    t.close(s.id, "was closed for the test")
    t.grow(s, 1000, 9.0)
    assert (s.room, t.tokens_left, len(t.sessions)) == (GROW_TOKENS, 512, 1) and s.why == "was closed for the test"


def test_a_session_named_with_a_client_is_found_only_for_that_client():
    t = table()
    mine = t.open(SPAN, 1, 512, ENC, 0.0, HONEST)
    assert t.get(mine.id, HONEST) is mine and t.get(mine.id) is mine
    answers = []
    for sid, client in ((mine.id, HOG), ("s99-" + "ab" * 12, HONEST)):
        with pytest.raises(UnknownSession) as e:
            t.get(sid, client)
        answers.append(str(e.value).replace(sid, "ID"))
    assert answers[0] == answers[1]  # another client's session reads as one that does not exist


# ---- reclaiming ----

def test_a_client_over_its_share_loses_its_sessions_to_a_client_within_its_share():
    t = table()
    hog = [filled(t, HOG, 256, now=float(i)) for i in range(4)]  # the whole cache, every session stepped lately
    assert t.tokens_left == 0
    with pytest.raises(OutOfCache, match="none can be reclaimed .this client holds 1024, its share is 256"):
        t.open(SPAN, 1, 512, ENC, 4.0, HOG)  # over its share: only what is free or idle
    honest = t.open(SPAN, 1, 512, ENC, 4.0, HONEST)  # busy or not, the hog's longest idle session goes
    assert [s.closed for s in hog] == [True, False, False, False] and honest.reserved == GROW_TOKENS
    assert hog[0].why.startswith("was reclaimed for another session") and t.tokens_left == GROW_TOKENS
    with pytest.raises(UnknownSession):
        t.get(hog[0].id)
    t.grow(honest, 256, 4.0)  # within its share: what is free
    assert t.tokens_left == 0 and not hog[1].closed
    with pytest.raises(OutOfCache):
        t.grow(honest, 300, 4.0)  # beyond its share, and nothing is idle
    t.grow(honest, 300, 10.0)  # ... until the hog's sessions are idle: its longest idle goes
    assert [s.closed for s in hog] == [True, True, False, False] and honest.room == 3 * GROW_TOKENS


def test_idle_sessions_are_reclaimed_from_the_largest_holder_first():
    t = table(share=0.5)
    a = [filled(t, "a", 256, now=4.0), filled(t, "a", 256, now=3.0)]
    b = filled(t, "b", 256, now=-10.0)
    for _ in range(2):
        assert t.open(SPAN, 1, 512, ENC, 5.0, "new").reserved == GROW_TOKENS  # what is free: nobody loses
    assert t.tokens_left == 0 and not any(s.closed for s in (*a, b))
    a[1].inflight = 1  # a step in flight: not idle, however long ago the last one began
    t.open(SPAN, 2, 512, ENC, 9.0, "new")
    assert [a[0].closed, a[1].closed, b.closed] == [True, False, False]  # "a" holds the most; b waited longer
    t.open(SPAN, 1, 512, ENC, 9.0, "new")
    assert b.closed and not a[1].closed


def test_nothing_is_reclaimed_unless_that_makes_room():
    t = table()
    idle = [filled(t, "a", 128, now=0.0) for _ in range(2)]
    busy = filled(t, "b", 256, now=9.0)
    rest = [filled(t, HONEST, 256, now=9.0), filled(t, THIRD, 256, now=9.0)]
    assert t.tokens_left == 0
    with pytest.raises(OutOfCache, match="384 more cache tokens needed"):
        t.open(SPAN, 3, 128, ENC, 10.0, "new")  # the idle sessions hold 256
    assert not any(s.closed for s in (*idle, busy, *rest))
    t.open(SPAN, 2, 128, ENC, 10.0, "new")
    assert all(s.closed for s in idle) and not any(s.closed for s in (busy, *rest))


def test_a_growing_session_never_reclaims_itself():
    t = table(cache_tokens=512)
    idle = [filled(t, HOG, 128, now=0.0) for _ in range(2)]
    mine = filled(t, HOG, 128, now=0.0)  # idle too
    t.grow(mine, 256, 10.0)  # what is free
    assert not any(s.closed for s in idle)
    t.grow(mine, 384, 10.0)  # one chunk: its own client's other idle session
    assert sum(s.closed for s in idle) == 1
    t.grow(mine, 512, 10.0)
    assert all(s.closed for s in idle) and mine.room == 512 and t.tokens_left == 0
    t.close(t.open(SPAN, 1, 512, ENC, 10.0, HOG).id)  # an open may take an idle session, itself included
    assert mine.closed


def test_session_slots_are_shared_the_same_way():
    t = table(cache_tokens=10**6, max_sessions=8)
    hog = [t.open(SPAN, 1, 64, ENC, 4.0 + i / 2, HOG) for i in range(8)]
    with pytest.raises(Busy, match="none can be reclaimed .this client holds 8, its share is 2"):
        t.open(SPAN, 1, 64, ENC, 8.0, HOG)
    t.open(SPAN, 1, 64, ENC, 8.0, HONEST)
    t.open(SPAN, 1, 64, ENC, 8.0, HONEST)
    assert [s.closed for s in hog] == [True, True] + [False] * 6  # the longest idle
    with pytest.raises(Busy):
        t.open(SPAN, 1, 64, ENC, 8.0, HONEST)  # a third is beyond its share
    assert len(t.sessions) == 8


# ---- figures ----

def test_available_is_what_a_client_could_get_and_releases_are_signalled():
    released = []
    t = table(on_release=lambda: released.append(True))
    assert t.available(None, 0.0) == 1024
    hog = [filled(t, HOG, 256, now=0.0) for _ in range(4)]
    assert t.tokens_left == 0
    assert t.available(None, 0.0) == 256  # a new client: its share, from the hog
    assert t.available(HOG, 0.0) == 0  # the hog: nothing is free or idle
    assert t.available(None, 10.0) == t.available(HOG, 10.0) == 1024  # everything is idle
    for s in hog:
        t.close(s.id)
    assert released == [True] * 4 and t.available(None, 0.0) == 1024


# ---- compute in turns ----

def test_a_client_with_long_jobs_queued_does_not_hold_back_another():
    gate, order = Gate(), []

    def job(name):
        time.sleep(0.005)
        order.append(name)

    async def main(rt):
        running = asyncio.create_task(rt.run(gate, client=HOG))
        await gate.wait_started()
        hog = [asyncio.create_task(rt.run(job, f"hog{i}", client=HOG)) for i in range(3)]
        await asyncio.sleep(0.01)
        honest = [asyncio.create_task(rt.run(job, f"honest{i}", client=HONEST)) for i in range(2)]
        anonymous = asyncio.create_task(rt.run(job, "peer"))
        await asyncio.sleep(0.2)  # the hog's first job holds the worker a while: it is charged for it
        gate.release.set()
        await asyncio.gather(running, *hog, *honest, anonymous)

    with Runtime() as rt:
        asyncio.run(main(rt))
    assert order == ["honest0", "peer", "honest1", "hog0", "hog1", "hog2"]


def test_a_light_client_waits_for_one_job_however_many_clients_flood():
    """A session's step beside flooding clients (each always has a job queued): it comes back at the level of
    the client served last, less the credit, so it runs right after the job running, not after one job of
    every flooder at that level (which it did when a returning client started exactly at that level)."""
    flooders = [f"stranger{i}" for i in range(6)]
    order = []

    def job(name, seconds):
        time.sleep(seconds)
        order.append(name)

    async def main(rt):
        for _ in range(2):  # the flooders are charged alike, and the honest client for its short step
            await asyncio.gather(*(rt.run(job, c, 0.01, client=c) for c in flooders))
            await rt.run(job, HONEST, 0.001, client=HONEST)
        gate = Gate()
        running = asyncio.create_task(rt.run(gate, client=flooders[0]))  # a flooder's job holds the worker
        await gate.wait_started()
        jobs = [asyncio.create_task(rt.run(job, c, 0.001, client=c)) for c in flooders]
        await asyncio.sleep(0.01)
        jobs.append(asyncio.create_task(rt.run(job, HONEST, 0.001, client=HONEST)))
        await asyncio.sleep(0.01)
        order.clear()
        gate.release.set()
        await asyncio.gather(running, *jobs)

    with Runtime() as rt:
        asyncio.run(main(rt))
    assert order[0] == HONEST


def test_idle_time_is_made_up_for_only_up_to_the_credit():
    """A client back from idling starts `idle_credit` below the client served last, whatever it used before;
    a client above that floor keeps its figure between its jobs (a flooder's parts gain nothing)."""
    async def main(rt):
        await rt.run(time.sleep, 0.001, client=HONEST)  # then idle while the hog works
        for _ in range(10):
            await rt.run(time.sleep, 0.02, client=HOG)
        assert HONEST not in rt._used  # at the floor or below: forgotten
        hog = rt._used[HOG]
        gate = Gate()
        running = asyncio.create_task(rt.run(gate, client=THIRD))
        await gate.wait_started()
        jobs = [asyncio.create_task(rt.run(time.sleep, 0.001, client=c)) for c in (HONEST, HOG)]
        await asyncio.sleep(0.01)
        assert rt._used[HONEST] == pytest.approx(rt._served - 0.05)
        assert rt._used[HOG] == hog  # above the floor: its own figure, no credit
        gate.release.set()
        await asyncio.gather(running, *jobs)

    with Runtime(idle_credit=0.05) as rt:
        asyncio.run(main(rt))


def test_batches_gather_across_clients_and_charge_each_by_rows():
    gate, calls = Gate(), []

    def batch(items):
        calls.append([name for name, in items])
        return [name for name, in items]

    async def main(rt):
        held = asyncio.create_task(rt.run(gate))
        await gate.wait_started()
        jobs = [asyncio.create_task(rt.run(str, name, batch=Batch("k", batch, name, rows), client=client))
                for name, client, rows in (("a", HOG, 3), ("b", HONEST, 1))]
        await asyncio.sleep(0.01)
        gate.release.set()
        await held
        return await asyncio.gather(*jobs)

    with Runtime() as rt:
        assert asyncio.run(main(rt)) == ["a", "b"]
        used = {client: figure - rt._floor for client, figure in rt._used.items()}  # both started at the floor
    assert calls == [["a", "b"]]
    assert used[HOG] == pytest.approx(3 * used[HONEST])


def test_a_large_forward_is_cut_into_short_jobs_each_row_group_through_every_block():
    assert forward_parts(1, 64, Span(0, 10)) == [(slice(0, 1), Span(0, 10))]  # small: one job
    assert forward_parts(2, 100, Span(0, 30)) == [(slice(0, 2), Span(b, b + 10)) for b in (0, 10, 20)]
    assert forward_parts(8, 512, Span(0, 6)) == [(slice(r, r + 4), Span(b, b + 1)) for r in (0, 4) for b in range(6)]
    parts = forward_parts(4, 2048, Span(0, 10))  # the 18.9 MB forward of the demo model: 40 jobs of one row x block
    assert len(parts) == 40 and parts[9] == (slice(0, 1), Span(9, 10)) and parts[10] == (slice(1, 2), Span(0, 1))
    assert forward_parts(3, 4096, Span(3, 5))[:2] == [(slice(0, 1), Span(3, 4)), (slice(0, 1), Span(4, 5))]
    for rows, tokens, span in ((4, 2048, Span(0, 10)), (3, 700, Span(2, 9)), (8, 1, Span(0, 4096))):
        parts = forward_parts(rows, tokens, span)
        assert all((p.stop - p.start) * tokens * len(b) <= max(FORWARD_JOB_TOKENS, tokens) for p, b in parts)


def test_client_slots_queue_one_clients_excess_and_not_the_others():
    async def main():
        slots = ClientSlots(1, "forwards")
        entered = []

        async def hold(client, seconds, timeout=WAIT):
            async with slots.hold(client, timeout):
                entered.append(client)
                await asyncio.sleep(seconds)

        first = asyncio.create_task(hold(HOG, 0.2))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(hold(HOG, 0))
        await asyncio.sleep(0.01)
        await hold(HONEST, 0)  # not behind the hog's
        assert entered == [HOG, HONEST]
        with pytest.raises(Busy, match="already has 1 forwards in progress"):
            await hold(HOG, 0, timeout=0.01)
        await asyncio.gather(first, second)
        assert entered == [HOG, HONEST, HOG] and slots._clients == {}

    asyncio.run(main())


def test_fair_share_options_are_checked():
    with pytest.raises(ConfigError, match="--client-share"):
        PeerConfig(model=Path("m"), client_share=1.5)
    with pytest.raises(ConfigError, match="--reclaim-idle, --client-forwards"):
        PeerConfig(model=Path("m"), reclaim_idle=0, client_forwards=0)
