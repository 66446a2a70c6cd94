"""The peer's compute: one worker thread owns the blocks and runs jobs one after another.

The event loop never computes; it submits a job and awaits its future. Invariants:
- only the worker thread touches the blocks and session caches while a job runs;
- the queue is bounded: a full queue is `Busy` at once, never a long wait;
- a job whose caller gave up (timeout, disconnect) before it started is skipped, and never joins a batch.

Batching: a job may carry a `Batch` (a key, a batch function, its owner, its rows). When the worker takes
a batchable job from the head of the queue, it also takes every other queued job with the same key, at
most one per owner, until `max_batch_rows` rows, and calls the batch function once with all their
argument tuples; it returns one result or exception per job, and each job's future is settled alone.
A batch of one runs as a plain job (`fn(*args)`). A `Batch` with key None is never batched; it only
names the job's owner.

Continuous batching: a batch is whatever is queued when the worker takes its head job, with one refinement,
for what is already on its way. Sessions that decode together through a chain of peers spread along it (each
peer computes whichever steps are there) rather than moving as one block while the other peers idle; but a
session's next step is often due a few milliseconds after its last result went out (its client turns it
around, or the previous peer pushes the outputs of its own batch one after another), and a turn that started
at the first of them would split the batch for good. So the runtime measures, per session, how long after its
result its next step comes (`gap`), and the worker about to run a batch waits for the sessions of its key whose
results went out and whose next steps are due within `COMPANY_SOON` (0.01 s; a session not measured yet is due
at once, one long overdue is not waited for), no longer, and never while other work is queued. Sessions due
later (elsewhere on their route) are not waited for. While every core of the machine has other work
(`swarm.machine.cores_busy`: peers sharing a machine), it waits for all the sessions of the key's last batch,
`company_wait` at most: the time it waits is computed by others, and a larger batch
costs less per token. Measured on the demo model, 8 users through 3 peers on 2 cores: 1.7 steps per forward
without waiting, 3.4 with it, 35 and 45 tokens/s; 8 sessions on one peer: 4.8 steps per forward without, 7.4
with it.

Fair order across clients: every job names its client (the authenticated peer that asked for it; None
for the peer's own work). The worker takes the oldest job of the client that has used the least compute,
counted in seconds of the worker's time (a shared call is split by rows). A client that starts queueing
again keeps its own figure, but no lower than `idle_credit` seconds below the figure of the client served
last (a new client starts there): idle time is saved up to that much only. The credit is what keeps a light
client ahead: started exactly at that figure, a session that decodes between the jobs of flooding clients
was charged its own step on top of it and came after every flooder at that level, one job of each per step
(measured with jobs of 50 ms and steps of 1 ms: 2.8 jobs' wait with 4 flooders, 5.8 with 8; now 0.8). So
other clients' long forwards and prefills make a client that uses less than its share wait for at most the
one job already running, however many clients send them (each identity is a client: fresh ones come in with
the same credit).
Among one client's jobs, and among jobs that name no client, order is FIFO, but for the chunks of a long step
(`Batch.later`): the client's jobs of other owners queued after one go first; a job that joins a batch
moves ahead of the jobs it skips by that one batch, never more. Jobs of one owner (session) keep their
order: a job never joins a batch while an older job of its owner is still queued, and two jobs of one
owner never share a batch.

`ClientSlots` bounds what one client may have in progress at once (the servicer's forwards): the rest wait
their turn outside the queue, so one client cannot fill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from swarm import machine
from swarm.errors import Busy, StepTimeout

logger = logging.getLogger(__name__)

# Rows (sum of the sessions' batch sizes) in one batched call at most: 8 full sessions at the default
# --max-batch of 8. A batch's time grows with its rows, and every step in it waits for the whole batch.
MAX_BATCH_ROWS = 64
COMPANY_SOON = 0.01  # a session's next step due within this many seconds is waited for (docstring), no later
DECODING_S = 0.5  # a session whose last one-token step ended this recently counts as decoding (`decoding`)
GAP_WEIGHT = 0.5  # weight of the last measured gap in a session's figure
MAX_FOLLOWED = 4096  # sessions whose gaps are followed at most (the least recent half is forgotten beyond)
IDLE_TICK = 0.5  # seconds between calls of `between` while the worker has nothing to do
# Seconds of compute a client that starts queueing again may be behind the client served last: more than a
# demo-model decode step through 30 blocks on one thread (0.05 s), so a session's step never waits behind a
# flooder's; at most this much of another client's idle time is ever made up for.
IDLE_CREDIT = 0.25


class Batch(NamedTuple):
    """How a job may share one call with others: jobs with equal `key` run as `fn([args, ...])`, which
    returns a sequence with one result or one exception (instance) per job, in order. A plain tuple
    `(key, fn, owner[, rows])` is accepted wherever a `Batch` is."""

    key: Hashable | None  # None: never batched
    fn: Callable[[list[tuple]], Sequence[Any]]
    owner: Hashable  # jobs of the same owner (session) keep their order and never share a call
    rows: int = 1  # what the job adds to a batch's rows (`max_batch_rows`)
    later: bool = False  # a chunk of a long step: its client's other owners' queued jobs may go first


class _Job:
    __slots__ = ("fn", "args", "future", "loop", "batch", "client")

    def __init__(self, fn, args, future, loop, batch, client):
        self.fn, self.args, self.future, self.loop, self.batch = fn, args, future, loop, batch
        self.client = client

    @property
    def rows(self) -> int:
        return self.batch.rows if self.batch is not None else 1


class ClientSlots:
    """At most `limit` holders per client at once (`hold`); the others wait in order, `Busy` after `timeout`.
    Only clients holding or waiting are remembered."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what = limit, what
        self._clients: dict[Hashable, list] = {}  # client -> [its semaphore, holders and waiters]

    @contextlib.asynccontextmanager
    async def hold(self, client: Hashable, timeout: float):
        entry = self._clients.setdefault(client, [asyncio.Semaphore(self.limit), 0])
        entry[1] += 1
        try:
            try:
                await asyncio.wait_for(entry[0].acquire(), timeout)
            except asyncio.TimeoutError:
                raise Busy(f"this client already has {self.limit} {self.what} in progress here and waited "
                           f"{timeout:.0f} s for one to finish; try another peer") from None
            try:
                yield
            finally:
                entry[0].release()
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._clients[client]


class Runtime:
    def __init__(self, max_queue: int = 256, name: str = "compute", max_batch_rows: int = MAX_BATCH_ROWS,
                 idle_credit: float = IDLE_CREDIT, company_wait: float = machine.COMPANY_WAIT,
                 cores_busy: Callable[[], bool] = machine.cores_busy, between: Callable[[], None] | None = None):
        """`between`: called on the worker thread before each job and, while idle, every `IDLE_TICK` seconds (no
        job runs then: the peer frees there the cache blocks of sessions closed meanwhile)."""
        self.max_queue, self.max_batch_rows = max_queue, max_batch_rows
        self.company_wait, self.cores_busy = company_wait, cores_busy
        self.between = between
        self.idle_credit = idle_credit
        self._jobs: deque[_Job] = deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.jobs_done = 0
        self.batches_run = 0  # calls of a batch function with more than one job
        self.batched_jobs = 0  # jobs settled by those calls
        self._used: dict[Hashable, float] = {}  # per client: seconds of compute, counted as the docstring says
        self._served = 0.0  # the figure of the client whose job the worker took last
        self._last: dict[Hashable, frozenset] = {}  # per key: the owners its last call ran
        self._settled: dict[Hashable, tuple] = {}  # per owner: when its last batched job's result went out, its key
        self._gap: dict[Hashable, float] = {}  # per owner: how long after that its next job comes (a moving mean)

    def __enter__(self) -> Runtime:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._ready:
            self._stopping = True  # the jobs already queued still run
            self._ready.notify()
        self._thread.join(timeout=30)

    def decoding(self, besides: Hashable = None, within: float = DECODING_S) -> bool:
        """Whether a session other than `besides` decodes here: a batchable step of it is queued, or its last
        one ended within `within` seconds (its next is probably on its way)."""
        now = time.monotonic()
        with self._ready:
            return any(job.batch is not None and job.batch.key is not None and job.batch.owner != besides
                       for job in self._jobs) or \
                any(owner != besides and now - settled <= within for owner, (settled, _) in self._settled.items())

    @property
    def queued(self) -> int:
        return len(self._jobs)

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                  batch: Batch | tuple | None = None, client: Hashable = None) -> Any:
        """Run `fn(*args)` on the worker thread, or, with `batch`, possibly together with other jobs as
        `batch.fn([args, ...])`, in `client`'s fair turn; Busy if the queue is full, StepTimeout after
        `timeout`."""
        batch = Batch(*batch) if batch is not None else None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._ready:
            if len(self._jobs) >= self.max_queue:
                raise Busy(f"compute queue is full ({self.max_queue} steps waiting); try another peer")
            if batch is not None and batch.key is not None and batch.owner in self._settled:
                gap = time.monotonic() - self._settled.pop(batch.owner)[0]
                last = self._gap.get(batch.owner, gap)
                self._gap[batch.owner] = last + GAP_WEIGHT * (gap - last)
            if not any(job.client == client for job in self._jobs):
                self._used[client] = max(self._used.get(client, self._floor), self._floor)
            self._jobs.append(_Job(fn, args, future, loop, batch, client))
            self._ready.notify()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            future.cancel()
            raise StepTimeout(f"step did not finish within {timeout:.1f} s") from None
        except asyncio.CancelledError:
            future.cancel()
            raise

    def _take(self) -> list[_Job] | None:
        """The next job, with the queued jobs that join its batch; None when stopping with nothing queued."""
        with self._ready:
            while True:
                while self._jobs and self._jobs[0].future.cancelled():
                    self._jobs.popleft()
                if not self._jobs:
                    if self._stopping:
                        return None
                    if not self._ready.wait(IDLE_TICK):
                        self._between()
                    continue
                head = self._next()
                if head is None:  # only jobs whose callers gave up: dropped above on the next look
                    continue
                key = head.batch.key if head.batch is not None else None
                if key is None:
                    return [head]
                self._await_company(head, key)
                if not head.future.cancelled():  # its caller may have given up while it waited
                    return self._gather(head, key)

    def _next(self) -> _Job | None:
        """Take the oldest queued job of the client that has used the least compute (lock held): of its jobs, the
        oldest not marked `later`, if any (a long step's chunks make way for the decode steps of its other
        sessions: one prompt delays them by one chunk at most)."""
        first: dict[Hashable, _Job] = {}
        for job in list(self._jobs):
            if job.future.cancelled():
                self._jobs.remove(job)
                continue
            seen = first.get(job.client)
            if seen is None or (seen.batch is not None and seen.batch.later and
                                (job.batch is None or (not job.batch.later and job.batch.owner != seen.batch.owner))):
                first[job.client] = job
        if not first:
            return None
        head = min(first.values(), key=lambda job: self._used[job.client])
        self._jobs.remove(head)
        self._served = max(self._served, self._used[head.client])
        return head

    @property
    def _floor(self) -> float:
        """The least figure a client that starts queueing gets: `idle_credit` below the client served last."""
        return self._served - self.idle_credit

    def _charge(self, jobs: list[_Job], seconds: float) -> None:
        """Count a call's time to the clients of its jobs, by rows; forget clients with nothing queued whose
        figure is at the floor or below (they would start from there anyway)."""
        rows = sum(job.rows for job in jobs)
        with self._ready:
            for job in jobs:
                self._used[job.client] = self._used.get(job.client, self._floor) + seconds * job.rows / rows
            queued = {job.client for job in self._jobs}
            for client in [c for c, used in self._used.items() if used <= self._floor and c not in queued]:
                del self._used[client]

    def _await_company(self, head: _Job, key: Hashable) -> None:
        """Wait (lock held, released while waiting) for the sessions of `key` whose results went out and whose next
        steps are due within `COMPANY_SOON` (or, while every core is busy, for the last call's sessions,
        `company_wait` at most); never while other work is queued (module docstring)."""
        if self.company_wait <= 0:
            return
        start = time.monotonic()
        while not self._stopping:
            here = {head.batch.owner}
            for job in self._jobs:
                if job.batch is None or job.batch.key != key:
                    return  # other work is waiting: never hold it back
                here.add(job.batch.owner)
            now = time.monotonic()
            if now - start >= self.company_wait:
                return
            if self._last.get(key, frozenset()) - here and self.cores_busy():  # the file read last
                self._ready.wait(machine.COMPANY_CHECK)
                continue
            # only those already on their way: due soon (a session not measured yet is due at once), not overdue
            due = [settled + self._gap.get(owner, 0.0) for owner, (settled, k) in self._settled.items()
                   if k == key and owner not in here]
            soon = [d for d in due if -COMPANY_SOON <= d - now <= COMPANY_SOON]
            if not soon or now - start >= COMPANY_SOON:
                return
            self._ready.wait(max(0.0, min(max(soon) - now + machine.COMPANY_CHECK, start + COMPANY_SOON - now)))

    def _gather(self, head: _Job, key: Hashable) -> list[_Job]:
        taken, owners, rows, kept = [head], {head.batch.owner}, head.batch.rows, deque()
        for job in self._jobs:
            b = job.batch
            if job.future.cancelled():
                continue  # dropped: its caller is gone
            if b is not None and b.key == key and b.owner not in owners and rows + b.rows <= self.max_batch_rows:
                taken.append(job)
                owners.add(b.owner)
                rows += b.rows
            else:
                if b is not None:
                    owners.add(b.owner)  # a later job of this owner must not overtake this one
                kept.append(job)
        self._jobs = kept
        return taken

    def _between(self) -> None:
        if self.between is not None:
            try:
                self.between()
            except Exception:  # boundary: the worker outlives a failing hook
                logger.exception("the runtime's between-jobs call failed")

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            self._between()
            started = time.perf_counter()
            if len(jobs) == 1:
                try:
                    outcomes: list[tuple[Any, BaseException | None]] = [(jobs[0].fn(*jobs[0].args), None)]
                except BaseException as e:  # boundary: the error travels back to the awaiting request
                    outcomes = [(None, e)]
            else:
                try:
                    results = list(jobs[0].batch.fn([job.args for job in jobs]))
                    if len(results) != len(jobs):
                        raise RuntimeError(f"batch function returned {len(results)} results for {len(jobs)} jobs")
                except BaseException as e:  # boundary: the batch's error travels back to every job in it
                    logger.debug("batch of %d jobs failed: %r", len(jobs), e)
                    results = [e] * len(jobs)
                outcomes = [(None, r) if isinstance(r, BaseException) else (r, None) for r in results]
                self.batches_run += 1
                self.batched_jobs += len(jobs)
            took = time.perf_counter() - started
            # charged before the results go back: a client's next job is placed by what this one cost
            self.jobs_done += len(jobs)
            self._charge(jobs, took)
            if jobs[0].batch is not None and jobs[0].batch.key is not None:
                self._last[jobs[0].batch.key] = frozenset(job.batch.owner for job in jobs)
                settled = time.monotonic()
                with self._ready:
                    for job in jobs:
                        self._settled[job.batch.owner] = (settled, job.batch.key)
                    for figures in (self._settled, self._gap):  # sessions that left: the first half followed goes
                        if len(figures) > MAX_FOLLOWED:
                            for owner in list(figures)[:len(figures) // 2]:
                                del figures[owner]
            for job, (result, error) in zip(jobs, outcomes):
                if error is not None:
                    _settle_error(job, error)
                else:
                    _settle_result(job, result)


def _settle_result(job: _Job, result: Any) -> None:
    job.loop.call_soon_threadsafe(_settle, job.future, result, None)


def _settle_error(job: _Job, error: BaseException) -> None:
    job.loop.call_soon_threadsafe(_settle, job.future, None, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
