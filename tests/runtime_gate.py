"""A job that holds a peer's compute worker until released, so tests can set up its queue exactly."""

from __future__ import annotations

import asyncio
import threading

WAIT = 5.0  # seconds a test waits for the worker thread before declaring it stuck


class Gate:
    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self):
        self.started.set()
        if not self.release.wait(WAIT):
            raise TimeoutError("the test never released the gate")
        return "released"

    async def wait_started(self):
        assert await asyncio.to_thread(self.started.wait, WAIT), "the worker never started the job"
