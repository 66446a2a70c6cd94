"""`swarm bootstrap`: run the swarm's entry node; `swarm monitor`: serve the swarm health page from a
node of its own. Light at import."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


def register_bootstrap(sub: argparse._SubParsersAction) -> None:
    from bootstrap.config import BootstrapConfig
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
                        "peers and clients as --initial-peers. With --monitor-port it also serves the swarm "
                        "health page. Stops cleanly on Ctrl-C or SIGTERM.")


def register_monitor(sub: argparse._SubParsersAction) -> None:
    from bootstrap.config import MonitorConfig
    from swarm.signals import add_service_command

    def load_serve():
        from bootstrap.monitor import run

        return run

    add_service_command(sub, "monitor", MonitorConfig, load_serve,
                        help="serve the swarm health page: who serves which blocks, which blocks nobody serves",
                        description="Joins the swarm as a client, finds every model from the peers' directory "
                        "records, pings the peers every --interval seconds, and serves an HTML page (/), JSON "
                        "(/api/v1/swarm) and Prometheus gauges (/metrics). Prints 'monitor at URL' once serving.")
