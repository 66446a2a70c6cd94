"""The bootstrap node: a DHT-only member of the swarm with a stable identity and address.

It stores and checks announcement records like every node, serves no blocks, and imports no torch.
Its key file is created on first start, so its multiaddrs (the swarm's entry point) survive restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swarm.config import option
from swarm.identity import load_or_create
from swarm.transport import Node

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    identity: Path = option(help="Ed25519 key file, created on first start (default: <cache home>/bootstrap.key)",
                            required=False, default=None)
    host: str = option("127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    port: int = option(0, help="TCP port to listen on (0: any free port; give one for a stable address)")
    announce_host: str | None = option(None, help="public address to announce, if different from --host")
    log_interval: float = option(60.0, help="seconds between swarm size reports")


async def run(config: BootstrapConfig, stop: asyncio.Event, on_ready: Callable[[list[str]], None] | None = None) -> None:
    identity = load_or_create(config.identity)
    async with Node(identity, identity_path=config.identity, host=config.host, port=config.port,
                    announce_host=config.announce_host) as node:
        maddrs = await node.maddrs()
        for addr in maddrs:
            print(addr, flush=True)
        logger.info("bootstrap %s ready; give peers --initial-peers %s", node.peer_id, maddrs[0] if maddrs else "?")
        if on_ready is not None:
            on_ready(maddrs)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), config.log_interval)
            logger.info("swarm size: %d DHT nodes known, %d connections, %d records checked (%d rejected)",
                        node.routing_table_size(), await node.connected_peers(),
                        node.counters["accepted"] + node.counters["rejected"], node.counters["rejected"])
        logger.info("bootstrap stopping")
