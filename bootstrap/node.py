"""The bootstrap node: a DHT-only member of the swarm with a stable identity and address.

It stores and checks announcement records like every node, serves no blocks, and imports no torch.
Its key file is created on first start, so its multiaddrs (the swarm's entry point) survive restarts.
With `--monitor-port` it also serves the swarm health page (`bootstrap.monitor`) from its own node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from bootstrap.config import BootstrapConfig
from bootstrap.monitor import Monitor, announce
from swarm.net import wire
from swarm.net.identity import load_or_create
from swarm.net.record_service import records_handler
from swarm.net import known_peers
from swarm.net.reach import RelayLimits
from swarm.net.transport import Node

logger = logging.getLogger(__name__)


async def run(config: BootstrapConfig, stop: asyncio.Event, on_ready: Callable[[list[str]], None] | None = None) -> None:
    identity = load_or_create(config.identity)
    async with Node(identity, identity_path=config.identity, host=config.host, port=config.port,
                    announce_host=config.announce_host, initial_peers=config.initial_peers,
                    reachability=config.reachability, relay=RelayLimits(), join_alone=True,
                    known_peers=known_peers.path_for(config.identity, config.identity.parent)
                    if config.identity else None) as node, contextlib.AsyncExitStack() as stack:
        await node.serve(wire.RECORDS_PROTOCOL, records_handler(node))
        maddrs = await node.maddrs()  # public ones first
        for addr in maddrs:
            print(addr, flush=True)
        logger.info("bootstrap %s ready; give peers --initial-peers %s", node.peer_id, maddrs[0] if maddrs else "?")
        if config.monitor_port is not None:
            announce(await stack.enter_async_context(Monitor(node, config.monitor_host, config.monitor_port,
                                                             config.monitor_interval)))
        if on_ready is not None:
            on_ready(maddrs)
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), config.log_interval)
            if stop.is_set():  # no report then: the daemon may be gone already (a signal to our whole group)
                break
            logger.info("swarm size: %d DHT nodes known, %d connections, %d records checked (%d rejected)",
                        node.routing_table_size(), await node.connected_peers(),
                        node.counters["accepted"] + node.counters["rejected"], node.counters["rejected"])
        logger.info("bootstrap stopping")
