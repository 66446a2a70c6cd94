"""Test settings of the shared integration swarm; the processes themselves are `swarm.local.launch`'s."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from swarm.local.launch import LocalSwarm, Proc, pid_alive, wait_until

__all__ = ["LocalSwarm", "Proc", "pid_alive", "wait_until", "client_node", "start_split", "start_models",
           "replicated_swarm", "Fault", "MODEL_ID",
           "CACHE_TOKENS", "IDLE_TIMEOUT", "MAX_SESSIONS", "PEER_OPTIONS"]


@contextlib.contextmanager
def client_node(loop, initial_peers):
    """A client-mode DHT node with its own identity, joined through `initial_peers`, on `loop` (a LoopThread)."""
    from swarm.net.identity import Identity
    from swarm.net.transport import Node

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


def start_split(net: LocalSwarm, model, spans=(("head-span", "0:3"), ("tail", "3:6"))) -> None:
    """A bootstrap and one peer per (name, blocks) of `spans`, started together; returns once all serve."""
    net.start_bootstrap()
    for name, blocks in spans:
        net.start_peer(name, model, "--blocks", blocks, *PEER_OPTIONS, wait=False)
    for name, _ in spans:
        net.wait_serving(net.procs[name])


def start_models(net: LocalSwarm, models: dict[str, tuple[Path, tuple[tuple[str, str], ...]]]) -> None:
    """A bootstrap and the peers of several models on it: for each model id, (checkpoint, (name, blocks) of
    each of its peers); all started together, returns once all serve."""
    net.start_bootstrap()
    options = PEER_OPTIONS[2:]  # without --model-id
    for model_id, (model, spans) in models.items():
        for name, blocks in spans:
            net.start_peer(name, model, "--blocks", blocks, "--model-id", model_id, *options, wait=False)
    for _, spans in models.values():
        for name, _ in spans:
            net.wait_serving(net.procs[name])


REPLICATED = (("head-span", "0:3"), ("replica-a", "3:6"), ("replica-b", "3:6"))


@contextlib.contextmanager
def replicated_swarm(root: Path, model):
    """A swarm of its own: blocks [0:3) on one peer, [3:6) on two replicas (what failover tests fault). On
    exit every peer is resumed first (a test that failed half-way may leave one stopped), then all stop."""
    net = LocalSwarm(root)
    try:
        start_split(net, model, REPLICATED)
        yield net
    finally:
        for proc in net.procs.values():
            if proc.alive():
                os.kill(proc.popen.pid, signal.SIGCONT)
        net.stop_all()


class Fault:
    """A streamer for `generate`: after `after` tokens, applies `action` to the process of the peer that
    serves `block` in the running session's route, and records when each token came (`times`) and when
    the fault struck (`at`)."""

    def __init__(self, net: LocalSwarm, model, action, after: int, block: int = 3):
        self.net, self.model, self.action, self.after, self.block = net, model, action, after, block
        self.times: list[float] = []
        self.victim: str | None = None
        self.session = None
        self.at: float | None = None

    def put(self, value) -> None:
        self.times.append(time.monotonic())
        if len(self.times) == self.after + 1:  # the first put is the prompt
            self.session = self.model.active_session
            peer = next(h.peer for h in self.session.route if h.span.start <= self.block < h.span.end)
            self.victim = next(name for name, p in self.net.procs.items() if p.peer_id == peer)
            self.at = time.monotonic()
            self.action(self.net.procs[self.victim])

    def end(self) -> None:
        pass

    def worst_gap(self) -> float:
        """The longest wait between two generated tokens."""
        return max(b - a for a, b in zip(self.times[1:], self.times[2:]))
