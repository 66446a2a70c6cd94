"""Test settings of the shared integration swarm; the processes themselves are `swarm.launch`'s."""

from __future__ import annotations

import contextlib

from swarm.launch import LocalSwarm, Proc, pid_alive, wait_until

__all__ = ["LocalSwarm", "Proc", "pid_alive", "wait_until", "client_node", "MODEL_ID", "CACHE_TOKENS",
           "IDLE_TIMEOUT", "MAX_SESSIONS", "PEER_OPTIONS"]


@contextlib.contextmanager
def client_node(loop, initial_peers):
    """A client-mode DHT node with its own identity, joined through `initial_peers`, on `loop` (a LoopThread)."""
    from swarm.identity import Identity
    from swarm.transport import Node

    node = Node(Identity.generate(), initial_peers=initial_peers, client_mode=True)
    loop.run(node.__aenter__(), timeout=60)
    try:
        yield node
    finally:
        loop.run(node.__aexit__(None, None, None), timeout=30)

# The shared integration swarm: three peers of this model on a tiny llama checkpoint.
MODEL_ID = "tiny-llama"
CACHE_TOKENS = 1024
IDLE_TIMEOUT = 4
MAX_SESSIONS = 32
PEER_OPTIONS = ("--model-id", MODEL_ID, "--cache-tokens", str(CACHE_TOKENS), "--announce-interval", "2",
                "--record-ttl", "8", "--idle-timeout", str(IDLE_TIMEOUT), "--max-sessions", str(MAX_SESSIONS))
