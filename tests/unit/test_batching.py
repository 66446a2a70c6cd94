"""The compute runtime's batching rules, with plain functions for jobs: which queued jobs share a call,
in what order jobs run, and how results and errors reach each caller.

Every test first holds the worker with a gate job, queues the jobs under test, then releases it, so the
queue's content when the worker looks at it is exact.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from peer.runtime import Batch, Runtime
from swarm.errors import Busy, StepTimeout
from runtime_gate import Gate, WAIT

pytestmark = pytest.mark.unit


class Recorder:
    """Alone: `alone(x)` -> ('alone', x). Batched: `together([(x,), ...])` -> [('batch', x), ...]; both logged."""

    def __init__(self, fail: set = frozenset(), delay: float = 0.0):
        self.log: list[tuple] = []
        self.fail, self.delay = fail, delay

    def alone(self, x):
        self.log.append(("alone", x))
        return ("alone", x)

    def together(self, items):
        xs = [x for (x,) in items]
        self.log.append(("batch", *xs))
        time.sleep(self.delay)
        return [ValueError(f"bad {x}") if x in self.fail else ("batch", x) for x in xs]


async def held(rt: Runtime, jobs):
    """Hold the worker, queue `jobs` (coroutine factories) in order, release; their results or errors."""
    gate = Gate()
    running = asyncio.create_task(rt.run(gate))
    await gate.wait_started()
    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(job()))
        await asyncio.sleep(0)  # let it enter the queue, in this order
    gate.release.set()
    await running
    return await asyncio.gather(*tasks, return_exceptions=True)


def batchable(rt: Runtime, rec: Recorder, x, owner, key="k", rows: int = 1):
    return lambda: rt.run(rec.alone, x, batch=Batch(key, rec.together, owner, rows))


def plain(rt: Runtime, rec: Recorder, x):
    return lambda: rt.run(rec.alone, x)


def test_pending_jobs_of_one_key_share_one_call():
    rec = Recorder()
    with Runtime() as rt:
        results = asyncio.run(held(rt, [batchable(rt, rec, x, owner=x) for x in "abcd"]))
        assert (rt.batches_run, rt.batched_jobs, rt.jobs_done) == (1, 4, 5)
    assert rec.log == [("batch", "a", "b", "c", "d")]
    assert results == [("batch", x) for x in "abcd"]  # each caller gets its own result


def test_a_batch_of_one_runs_as_a_plain_job():
    rec = Recorder()

    async def main(rt):
        return await batchable(rt, rec, "a", owner="a")()

    with Runtime() as rt:
        assert asyncio.run(main(rt)) == ("alone", "a")
        assert rt.batches_run == 0
    assert rec.log == [("alone", "a")]


def test_keys_do_not_mix_and_tuples_are_batches():
    rec = Recorder()
    with Runtime() as rt:
        jobs = [batchable(rt, rec, "a1", "a", key="x"), batchable(rt, rec, "b1", "b", key="y"),
                lambda: rt.run(rec.alone, "c1", batch=("x", rec.together, "c")),
                batchable(rt, rec, "d1", "d", key="y")]
        asyncio.run(held(rt, jobs))
    assert rec.log == [("batch", "a1", "c1"), ("batch", "b1", "d1")]


def test_jobs_of_one_session_never_share_a_batch_and_keep_their_order():
    rec = Recorder()
    with Runtime() as rt:
        jobs = [batchable(rt, rec, "a1", "a"), batchable(rt, rec, "b1", "b"), batchable(rt, rec, "a2", "a"),
                batchable(rt, rec, "c1", "c"), batchable(rt, rec, "a3", "a"), batchable(rt, rec, "b2", "b")]
        asyncio.run(held(rt, jobs))
    assert rec.log == [("batch", "a1", "b1", "c1"), ("batch", "a2", "b2"), ("alone", "a3")]


def test_a_job_never_overtakes_an_unbatched_job_of_its_session():
    rec = Recorder()
    with Runtime() as rt:
        jobs = [batchable(rt, rec, "b1", "b"),
                lambda: rt.run(rec.alone, "a-prefill", batch=(None, rec.together, "a")),  # never batched
                batchable(rt, rec, "a1", "a"), batchable(rt, rec, "c1", "c")]
        asyncio.run(held(rt, jobs))
    assert rec.log == [("batch", "b1", "c1"), ("alone", "a-prefill"), ("alone", "a1")]


def test_plain_jobs_keep_fifo_order():
    rec = Recorder()
    with Runtime() as rt:
        jobs = [plain(rt, rec, "p1"), batchable(rt, rec, "a1", "a"), plain(rt, rec, "p2"),
                batchable(rt, rec, "b1", "b"), plain(rt, rec, "p3")]
        asyncio.run(held(rt, jobs))
    # b1 rides with a1 ahead of p2: by one batch, never more; the plain jobs stay in order
    assert rec.log == [("alone", "p1"), ("batch", "a1", "b1"), ("alone", "p2"), ("alone", "p3")]


def test_batch_rows_are_bounded():
    rec = Recorder()
    with Runtime(max_batch_rows=4) as rt:
        jobs = [batchable(rt, rec, "a", "a", rows=2), batchable(rt, rec, "b", "b", rows=3),
                batchable(rt, rec, "c", "c", rows=2), batchable(rt, rec, "d", "d", rows=1),
                batchable(rt, rec, "e", "e", rows=5)]
        asyncio.run(held(rt, jobs))
    # e is larger than a batch: it still runs, alone
    assert rec.log == [("batch", "a", "c"), ("batch", "b", "d"), ("alone", "e")]


def test_a_cancelled_job_is_skipped_before_the_batch_is_built():
    rec = Recorder()

    async def give_up():
        with pytest.raises(StepTimeout):
            await rt.run(rec.alone, "late", timeout=0.01, batch=Batch("k", rec.together, "late"))
        return "gave up"

    with Runtime() as rt:
        gate = Gate()

        async def main():
            running = asyncio.create_task(rt.run(gate))
            await gate.wait_started()
            first = asyncio.create_task(batchable(rt, rec, "a", "a")())
            assert await give_up() == "gave up"  # timed out while queued
            second = asyncio.create_task(batchable(rt, rec, "b", "b")())
            await asyncio.sleep(0)
            gate.release.set()
            await running
            return await first, await second

        assert asyncio.run(main()) == (("batch", "a"), ("batch", "b"))
    assert rec.log == [("batch", "a", "b")]


def test_an_error_of_one_item_fails_only_that_item():
    rec = Recorder(fail={"b"})
    with Runtime() as rt:
        results = asyncio.run(held(rt, [batchable(rt, rec, x, owner=x) for x in "abc"]))
    assert results[0] == ("batch", "a") and results[2] == ("batch", "c")
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad b"


def test_a_failing_batch_function_fails_each_job_and_the_runtime_goes_on():
    error = RuntimeError("the forward broke")

    def broken(items):
        raise error

    def wrong_count(items):
        return [1]

    async def main(rt):
        first = await held(rt, [lambda o=o: rt.run(str, o, batch=("k", broken, o)) for o in "ab"])
        second = await held(rt, [lambda o=o: rt.run(str, o, batch=("k", wrong_count, o)) for o in "ab"])
        return first, second, await rt.run(str, "after")

    with Runtime() as rt:
        first, second, after = asyncio.run(main(rt))
    assert first == [error, error]
    assert all(isinstance(r, RuntimeError) and "1 results for 2 jobs" in str(r) for r in second)
    assert after == "after"


def test_full_queue_is_busy_at_once_for_batchable_jobs():
    rec = Recorder()
    gate = Gate()

    async def main(rt):
        running = asyncio.create_task(rt.run(gate))
        await gate.wait_started()
        queued = [asyncio.create_task(batchable(rt, rec, x, x)()) for x in "ab"]
        await asyncio.sleep(0)
        assert rt.queued == 2
        try:
            with pytest.raises(Busy, match="queue is full"):
                await asyncio.wait_for(batchable(rt, rec, "c", "c")(), WAIT)
        finally:
            gate.release.set()
        await running
        return await asyncio.gather(*queued)

    with Runtime(max_queue=2) as rt:
        assert asyncio.run(main(rt)) == [("batch", "a"), ("batch", "b")]
        assert rt.queued == 0


# ---- continuous batching: waiting for the last batch's sessions only while every core is busy ----

async def batched_a1_b1(rt: Runtime, rec) -> None:
    """Sessions a and b share a batch (a1, b1); later jobs take no time."""
    await held(rt, [batchable(rt, rec, "a1", "a"), batchable(rt, rec, "b1", "b")])
    rec.delay = 0.0


def test_the_next_job_never_waits_for_the_owners_of_the_last_batch_while_a_core_is_free():
    rec = Recorder(delay=0.4)

    async def main(rt):
        await batched_a1_b1(rt, rec)
        started = time.monotonic()
        first = await batchable(rt, rec, "a2", "a")()  # b's next step is not there yet: a runs at once
        took = time.monotonic() - started
        second = await batchable(rt, rec, "b2", "b")()
        return first, second, took

    with Runtime(company_wait=5.0, cores_busy=lambda: False) as rt:
        first, second, took = asyncio.run(main(rt))
    assert (first, second) == (("alone", "a2"), ("alone", "b2"))
    assert took < 0.15
    assert rec.log == [("batch", "a1", "b1"), ("alone", "a2"), ("alone", "b2")]


def test_while_every_core_is_busy_the_next_job_waits_for_the_last_batch_a_bounded_time():
    rec = Recorder(delay=0.1)

    async def main(rt):
        await batched_a1_b1(rt, rec)
        first = asyncio.create_task(batchable(rt, rec, "a2", "a")())
        await asyncio.sleep(0.03)  # b's next step comes a little later, as over a network
        second = asyncio.create_task(batchable(rt, rec, "b2", "b")())
        together = (await first, await second)
        started = time.monotonic()
        alone = await batchable(rt, rec, "a3", "a")()  # b is gone: a waits once, at most `company_wait`
        return together, alone, time.monotonic() - started

    with Runtime(company_wait=0.2, cores_busy=lambda: True) as rt:
        together, alone, took = asyncio.run(main(rt))
    assert together == (("batch", "a2"), ("batch", "b2")) and alone == ("alone", "a3")
    assert 0.15 <= took < 1.0
    assert rec.log == [("batch", "a1", "b1"), ("batch", "a2", "b2"), ("alone", "a3")]


def test_other_work_is_never_held_back_by_waiting_for_company():
    rec = Recorder(delay=0.1)

    async def main(rt):
        await batched_a1_b1(rt, rec)
        started = time.monotonic()
        waiting = asyncio.create_task(batchable(rt, rec, "a2", "a")())
        await asyncio.sleep(0.01)
        other = await plain(rt, rec, "p")()  # ends the wait for b
        return await waiting, other, time.monotonic() - started

    with Runtime(company_wait=5.0, cores_busy=lambda: True) as rt:
        waited, other, took = asyncio.run(main(rt))
    assert (waited, other) == (("alone", "a2"), ("alone", "p"))
    assert took < 1.0
    assert rec.log[-2:] == [("alone", "a2"), ("alone", "p")]


def test_the_cores_are_busy_when_more_threads_are_ready_than_cores(tmp_path):
    from swarm import machine

    loadavg = tmp_path / "loadavg"
    for running, busy in ((1, False), (machine.CORES, False), (machine.CORES + 1, True)):
        loadavg.write_text(f"0.50 0.40 0.30 {running}/300 12345\n")
        assert machine.cores_busy(str(loadavg)) is busy  # this thread is one of the running
    loadavg.write_text("garbage")
    assert machine.cores_busy(str(loadavg)) is False
    assert machine.cores_busy(str(tmp_path / "missing")) is False


def test_a_long_steps_chunks_make_way_for_the_other_sessions_steps():
    rec = Recorder()

    def chunk(x, owner):
        return lambda: rt.run(rec.alone, x, batch=Batch(None, None, owner, later=True))

    with Runtime(cores_busy=lambda: False) as rt:
        asyncio.run(held(rt, [chunk("p1", "long"), batchable(rt, rec, "a", "a"), chunk("p2", "long"),
                              batchable(rt, rec, "b", "b"), plain(rt, rec, "c")]))
    # the decode steps of other sessions (and the plain job) before the chunks; the chunks keep their order
    assert rec.log == [("batch", "a", "b"), ("alone", "c"), ("alone", "p1"), ("alone", "p2")]


def test_a_batch_waits_only_for_the_sessions_whose_next_steps_are_due_within_milliseconds():
    """Each session's gap (from its result to its next step) is measured; a turn waits for the sessions of the
    last batch due within `COMPANY_SOON`, not for those due later."""
    from peer.runtime import COMPANY_SOON

    async def rounds(rt, rec, lag: float, n: int):
        await held(rt, [batchable(rt, rec, "a", "a"), batchable(rt, rec, "b", "b")])  # they start together

        async def session(owner, delay):
            for i in range(n):
                await asyncio.sleep(delay)  # the client's turnaround: none for a, `lag` for b
                await batchable(rt, rec, f"{owner}{i}", owner)()

        await asyncio.gather(session("a", 0.0), session("b", lag))

    for lag, together in ((COMPANY_SOON / 3, True), (COMPANY_SOON * 20, False)):
        rec = Recorder(delay=0.01)
        with Runtime(cores_busy=lambda: False) as rt:
            asyncio.run(rounds(rt, rec, lag, 6))
        shared = sum(1 for entry in rec.log[2:] if entry[0] == "batch")  # after the gaps were first measured
        assert (shared >= 4) if together else (shared == 0), (lag, rec.log)
