"""Run a long-lived async service until SIGINT or SIGTERM, then let it shut down cleanly.

The service receives a stop event; the first signal sets it, and the service's own context managers
release everything (daemons included). A second signal while stopping is ignored, so shutdown is
never cut short into leaving child processes behind.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
    return 0
