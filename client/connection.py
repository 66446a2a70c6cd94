"""Joining a swarm as a client: `joined()` (or `joined_node()`, for several models' clients on one node),
the one way every client part does it (the SDK, the API gateway, the CLI), and `SwarmConnection`, a joined client driven from synchronous code.

The SDK's blocking API runs every coroutine on one background event loop (`LoopThread`) that owns a
client-mode DHT node and the `SwarmClient`. One per model object; `close()` (or `with`) stops both.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import weakref
from pathlib import Path
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from client.config import ClientConfig
from client.loop import LoopThread
from client.inference.stalls import StallMemory
from client.inference.swarm_client import SwarmClient
from swarm.errors import ConfigError
from swarm.net.identity import Identity
from swarm.cli import cache_home
from swarm.net import known_peers
from swarm.net.transport import Node

logger = logging.getLogger(__name__)
T = TypeVar("T")
JOIN_TIMEOUT = 120.0  # seconds a client may take to join (start its node, reach an initial peer)


def require_peers(config: ClientConfig) -> None:
    if not config.initial_peers:
        raise ConfigError("no initial peers: give the multiaddr of the swarm's bootstrap node or of any peer")


def settle_heap(config: ClientConfig) -> None:
    """Before a light client's join: move every object the process has made so far (torch, transformers, the
    caller's own) out of reach of Python's full garbage collections (`gc.freeze`).

    py-libp2p's import makes enough long-lived objects to start a full collection, which then walks every
    object of torch and transformers as well: 0.2 s in the middle of the join, measured on the demo client.
    Frozen objects are still freed when their last reference goes; only a reference cycle among them made
    garbage later is never collected. So this runs on the thread that owns the process's work, before the
    head loads (nothing half-built is frozen), never alongside it."""
    if config.transport == "libp2p":
        gc.freeze()


@contextlib.asynccontextmanager
async def joined_node(config: ClientConfig, *, settle: bool = True) -> AsyncIterator[Node]:
    """A fresh client-mode node (a new identity) joined to the swarm, for the block: a DHT node on the daemon,
    or a light node (`--transport libp2p`). Clients of several models may share it (`swarm api`).
    `settle`: run `settle_heap` here (a caller that joins in a thread of its own runs it before)."""
    require_peers(config)
    if config.transport == "libp2p":
        if settle:
            settle_heap(config)
        from client.light.node import LightNode

        async with LightNode(config.initial_peers) as node:
            yield node
        return
    async with Node(Identity.generate(), host=None, initial_peers=config.initial_peers, client_mode=True,
                    known_peers=known_peers.path_for(None, Path(cache_home()))) as node:
        yield node


@contextlib.asynccontextmanager
async def joined(model_id: str, num_blocks: int, config: ClientConfig, *, settle: bool = True,
                 digest: str | None = None, floor: float | None = None,
                 starts: Sequence[int] | None = None) -> AsyncIterator[SwarmClient]:
    """A `SwarmClient` for `model_id` (routing only through peers of the weights `digest`, if given; refusing
    hidden states whose spread is under `floor`, `hops.output_floor`; cutting routes only at `starts`,
    `swarm.span.span_starts`) over a fresh client-mode node (`joined_node`), for the block."""
    async with joined_node(config, settle=settle) as node:
        yield SwarmClient(node, model_id, num_blocks, config, digest, floor, stalls=StallMemory.of(config),
                          starts=starts)


class SwarmConnection:
    """Joins in the background from the moment it is made (the caller loads the head meanwhile); `client`
    waits for the join to finish and raises what it raised."""

    def __init__(self, model_id: str, num_blocks: int, config: ClientConfig, digest: str | None = None,
                 floor: float | None = None, starts: Sequence[int] | None = None):
        require_peers(config)
        self.config = config
        self._loop = LoopThread("swarm-client")
        self._loop.__enter__()
        self._stack = contextlib.AsyncExitStack()
        self._client: SwarmClient | None = None
        settle_heap(config)  # here, before the caller goes on to load the head
        self._joining = asyncio.run_coroutine_threadsafe(
            self._stack.enter_async_context(joined(model_id, num_blocks, config, settle=False, digest=digest,
                                                floor=floor, starts=starts)), self._loop.loop)
        self._finalizer = weakref.finalize(self, SwarmConnection._shutdown, self._loop, self._stack, self._joining)

    @property
    def client(self) -> SwarmClient:
        if self._client is None:
            try:
                self._client = self._joining.result(JOIN_TIMEOUT)
            except BaseException:
                self._joining.cancel()
                raise
        return self._client

    @property
    def node(self):
        return self.client.node

    @property
    def longest_wait(self) -> float:
        """An outer bound for any one call: every step retried to the limit at the longest deadline, each
        retry after the longest wait for blocks."""
        return (self.config.step_timeout + self.config.wait_for_blocks) * (self.config.max_retries + 2) + 60

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self._loop.run(coro, self.longest_wait if timeout is None else timeout)

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _shutdown(loop: LoopThread, stack: contextlib.AsyncExitStack, joining) -> None:
        joining.cancel()
        try:
            loop.run(stack.aclose(), timeout=30)
        except Exception:  # closing anyway: the reaper stops the daemon if this process exits
            logger.debug("client node did not stop cleanly", exc_info=True)
        loop.__exit__(None, None, None)
