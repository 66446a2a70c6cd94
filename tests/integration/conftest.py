"""Integration fixtures: one real swarm (bootstrap + three peers on a tiny llama checkpoint) and one of the
demo model per test session, each stopped once the last test that uses it is done, and a client node on
a background event loop."""

from __future__ import annotations

import contextlib

import pytest
import torch

from client.loop import LoopThread
from swarm.model.checkpoint import Checkpoint
from lifetimes import release_after_last_use
from swarm_harness import CACHE_TOKENS, PEER_OPTIONS, LocalSwarm, client_node


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def two_block_budget(checkpoint) -> int:
    """A memory budget that holds two blocks with their cache, not three."""
    ckpt = Checkpoint(checkpoint)
    per_block = ckpt.block_bytes(0, torch.float32) + CACHE_TOKENS * ckpt.cache_bytes_per_token(torch.float32)
    return 2 * per_block + per_block // 2


@pytest.fixture(scope="session")
def local(tiny_llama):
    """The tiny llama run by transformers in this process: the ground truth."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def swarm(tmp_path_factory, tiny_llama):
    """Bootstrap, then three peers started one after another with no --blocks, each serving `/metrics` on a port
    of its own (`LocalSwarm.metrics_url`)."""
    net = LocalSwarm(tmp_path_factory.mktemp("swarm"))
    try:
        net.start_bootstrap()
        budget = str(two_block_budget(tiny_llama))
        for i in range(3):
            net.start_peer(f"peer{i}", tiny_llama, "--memory-budget", budget, "--metrics-port", "0", *PEER_OPTIONS)
        release_after_last_use("swarm", net.stop_all)
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="session")
def loop():
    with LoopThread() as lt:
        yield lt


@pytest.fixture(scope="session")
def client(swarm, loop):
    """A client-mode DHT node joined to the swarm, with its own identity."""
    with contextlib.ExitStack() as stack:
        node = stack.enter_context(client_node(loop, swarm.bootstrap_addrs))
        release_after_last_use("client", stack.close)
        yield node


@pytest.fixture(scope="session")
def demo_swarm(tmp_path_factory, demo_model_dir):
    """The real demo model (SmolLM2) on a bootstrap and three peers, shared by the modules that need it."""
    from client.demo import start_swarm
    from swarm.weights.models import local_model_id

    net = LocalSwarm(tmp_path_factory.mktemp("demo-swarm"))
    try:
        start_swarm(net, demo_model_dir, 3, "float32", local_model_id(demo_model_dir))
        release_after_last_use("demo_swarm", net.stop_all)
        yield net
    finally:
        net.stop_all()
