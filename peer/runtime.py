"""The peer's compute: one worker thread owns the blocks and runs jobs one after another.

The event loop never computes; it submits a job and awaits its future. Invariants:
- only the worker thread touches the blocks and session caches while a job runs;
- the queue is bounded: a full queue is `Busy` at once, never a long wait;
- a job whose caller gave up (timeout, disconnect) before it started is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from swarm.errors import Busy, StepTimeout

logger = logging.getLogger(__name__)


class _Job:
    __slots__ = ("fn", "args", "future", "loop")

    def __init__(self, fn, args, future, loop):
        self.fn, self.args, self.future, self.loop = fn, args, future, loop


class Runtime:
    def __init__(self, max_queue: int = 256, name: str = "compute"):
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.jobs_done = 0

    def __enter__(self) -> Runtime:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    async def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run `fn(*args)` on the worker thread; Busy if the queue is full, StepTimeout after `timeout`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            self._queue.put_nowait(_Job(fn, args, future, loop))
        except queue.Full:
            raise Busy(f"compute queue is full ({self._queue.maxsize} steps waiting); try another peer") from None
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            future.cancel()
            raise StepTimeout(f"step did not finish within {timeout:.1f} s") from None
        except asyncio.CancelledError:
            future.cancel()
            raise

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.future.cancelled():
                continue
            try:
                result, error = job.fn(*job.args), None
            except BaseException as e:  # boundary: the error travels back to the awaiting request
                result, error = None, e
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            self.jobs_done += 1


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
