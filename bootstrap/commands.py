"""`swarm bootstrap`: run the swarm's entry node. Light at import."""

from __future__ import annotations

import argparse
from pathlib import Path


def register_bootstrap(sub: argparse._SubParsersAction) -> None:
    from bootstrap.node import BootstrapConfig
    from swarm.config import add_options

    p = sub.add_parser("bootstrap", help="run a bootstrap node: the stable entry point of a swarm",
                       description="A DHT-only node with a stable identity. Prints its multiaddrs; give one to "
                       "peers and clients as --initial-peers. Stops cleanly on Ctrl-C or SIGTERM.")
    add_options(p, BootstrapConfig)
    p.set_defaults(run=_run_bootstrap)


def _run_bootstrap(args: argparse.Namespace) -> int:
    import asyncio

    from bootstrap.node import BootstrapConfig, run
    from swarm.config import from_args
    from swarm.signals import run_until_signal

    config = from_args(BootstrapConfig, args)
    if config.identity is None:
        config = from_args(BootstrapConfig, args, identity=Path(args.cache_home) / "bootstrap.key")

    async def main(stop: asyncio.Event) -> None:
        await run(config, stop)

    return run_until_signal(main)
