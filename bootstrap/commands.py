"""`swarm bootstrap`: run the swarm's entry node. Light at import."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def register_bootstrap(sub: argparse._SubParsersAction) -> None:
    from bootstrap.node import BootstrapConfig
    from swarm.signals import add_service_command

    def load_serve():
        from bootstrap.node import run

        return run

    def default_identity(config: BootstrapConfig, args: argparse.Namespace) -> BootstrapConfig:
        if config.identity is not None:
            return config
        return dataclasses.replace(config, identity=Path(args.cache_home) / "bootstrap.key")

    add_service_command(sub, "bootstrap", BootstrapConfig, load_serve, finish=default_identity,
                        help="run a bootstrap node: the stable entry point of a swarm",
                        description="A DHT-only node with a stable identity. Prints its multiaddrs; give one to "
                        "peers and clients as --initial-peers. Stops cleanly on Ctrl-C or SIGTERM.")
