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


def add_service_command(sub, name: str, config_cls: type, load_serve: Callable[[], Callable], *, help: str,
                        description: str, finish: Callable | None = None) -> None:
    """Register `swarm NAME`: options from `config_cls`; runs `serve(config, stop)` until a signal.

    `load_serve` imports the service only when the command runs, so registration stays light.
    `finish(config, args)` may fill defaults that depend on the command line (the cache home, say).
    """
    from swarm.config import add_options, from_args

    def run(args) -> int:
        config = from_args(config_cls, args)
        if finish is not None:
            config = finish(config, args)
        serve = load_serve()
        return run_until_signal(lambda stop: serve(config, stop))

    parser = sub.add_parser(name, help=help, description=description)
    add_options(parser, config_cls)
    parser.set_defaults(run=run)
