"""`swarm peer`: serve a span of a model's blocks to the swarm. Light at import."""

from __future__ import annotations

import argparse


def register_peer(sub: argparse._SubParsersAction) -> None:
    from peer.config import PeerConfig
    from swarm.config import add_options

    p = sub.add_parser("peer", help="serve blocks of a model to the swarm",
                       description="Load a span of a model's blocks, announce them (signed) in the swarm's DHT "
                       "and serve inference sessions until stopped with Ctrl-C or SIGTERM.")
    add_options(p, PeerConfig)
    p.set_defaults(run=_run_peer)


def _run_peer(args: argparse.Namespace) -> int:
    import asyncio

    from peer.config import PeerConfig
    from swarm.config import from_args
    from swarm.signals import run_until_signal

    config = from_args(PeerConfig, args)

    async def main(stop: asyncio.Event) -> None:
        from peer.server import serve

        await serve(config, stop)

    return run_until_signal(main)
