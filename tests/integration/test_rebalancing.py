"""A self-balancing swarm on 127.0.0.1 with real processes: a slow peer (a CPU quota) takes fewer blocks,
a settled swarm stays put, and when the only peer of a span is killed mid-generation a peer with room
moves there and the generation completes with the same tokens."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.model import DistributedModelForCausalLM
from swarm.model.checkpoint import Checkpoint
from swarm.local.launch import cpu_quota_supported
from swarm_harness import CACHE_TOKENS, MODEL_ID, Fault, LocalSwarm, wait_until

pytestmark = pytest.mark.integration

FAST = ("--model-id", MODEL_ID, "--cache-tokens", str(CACHE_TOKENS), "--announce-interval", "1", "--record-ttl",
        "6", "--check-interval", "0.5", "--rebalance-interval", "1")
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
NEW_TOKENS = 24
FAULT_AFTER = 8


def budget(checkpoint, blocks: float) -> str:
    ckpt = Checkpoint(checkpoint)
    per_block = ckpt.block_bytes(0, torch.float32) + CACHE_TOKENS * ckpt.cache_bytes_per_token(torch.float32)
    return str(int(blocks * per_block))


def moves(proc) -> int:
    return proc.text().count(" moved from blocks ")


@pytest.fixture(scope="module")
def movable(tmp_path_factory, tiny_llama):
    """[0:3) and [3:6) pinned on a peer each; a third peer with room for 3 blocks and no --blocks."""
    net = LocalSwarm(tmp_path_factory.mktemp("rebalance"))
    try:
        net.start_bootstrap()
        net.start_peer("pinned-a", tiny_llama, "--blocks", "0:3", *FAST)
        net.start_peer("pinned-b", tiny_llama, "--blocks", "3:6", *FAST)
        net.start_peer("free", tiny_llama, "--memory-budget", budget(tiny_llama, 3.5), *FAST)
        yield net
    finally:
        net.stop_all()


def test_a_settled_swarm_makes_no_move(movable):
    """Every block has a peer and no move would raise the bottleneck by the margin: several re-evaluation
    periods (1 s each) go by without a move."""
    free = movable.procs["free"]
    assert free.span() == (0, 3), free.text()[-2000:]  # equal peers: the lowest start
    time.sleep(6)
    assert [moves(p) for p in movable.procs.values()] == [0, 0, 0, 0]
    assert "claiming them" not in free.text()


def test_the_only_peer_of_a_span_is_killed_mid_generation(movable, tiny_llama):
    """pinned-b, the only peer of [3:6), is SIGKILLed after 8 tokens: the free peer (room for 3 blocks, on
    [0:3)) moves there, old span offline first, and the generation waits for the blocks, replays and ends
    with transformers' own tokens."""
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    expected = local.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
    # without checked outputs: [0:3) has a replica to check against, and tokens held back for a check could
    # reach the fault's streamer only after the last step, when the killed peer is no longer needed
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, movable.bootstrap_addrs, model_id=MODEL_ID,
                                                        verify_fraction=0)
    fault = Fault(movable, model, lambda proc: movable.stop(proc.name, signal.SIGKILL), FAULT_AFTER)
    try:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, streamer=fault)
    finally:
        model.close()
    assert fault.victim == "pinned-b", "the fault never fired, or hit another peer"
    assert out.tolist() == expected
    free = movable.procs["free"]
    assert free.span() == (3, 6), free.text()[-3000:]
    assert "do not fit in memory at once" in free.text()
    assert moves(movable.procs["pinned-a"]) == 0  # --blocks never moves


@pytest.mark.skipif(not cpu_quota_supported(), reason="an unequal machine needs a CPU quota: root and the cgroup v1 "
                    "cpu controller (CI and the developers' machines have both; elsewhere this test cannot run)")
def test_a_slow_peer_serves_fewer_blocks(tmp_path_factory, tiny_llama):
    """Three peers with room for 4 of the 6 blocks and no --blocks; the first one started is held to 10% of
    a core. Alone at first, it takes 4 blocks; once the fast ones join it gives blocks up: they cover the
    model, it serves the fewest blocks, and fewer than one fast peer that has the same memory."""
    net = LocalSwarm(tmp_path_factory.mktemp("slow"))
    try:
        net.start_bootstrap()
        room = budget(tiny_llama, 4.5)
        names = ("slow", "fast-a", "fast-b")
        for name in names:  # each measures for itself
            proc = net.start_peer(name, tiny_llama, "--memory-budget", room, "--capacity-cache",
                                  str(net.root / f"{name}-capacity.json"), *FAST, wait=False)
            if name == "slow":
                wait_until(lambda: "measuring what a block" in proc.text() or not proc.alive(), 120,
                           "the slow peer to join", diagnostics=proc.text)
                net.throttle(proc, 0.1)
            net.wait_serving(proc, timeout=180)

        def settled():
            spans = {name: net.procs[name].span() for name in names}
            covered = {b for s in spans.values() if s for b in range(*s)} == set(range(6))
            size = {name: s[1] - s[0] for name, s in spans.items() if s}
            fast = (size.get("fast-a", 0), size.get("fast-b", 0))
            return covered and len(size) == 3 and size["slow"] <= min(fast) and size["slow"] < max(fast) and spans

        spans = wait_until(settled, 120, "the slow peer to serve the fewest blocks",
                           diagnostics=lambda: "\n".join(net.procs[n].text()[-1500:] for n in names))
        assert moves(net.procs["slow"]) >= 1, spans  # it started alone on 4 blocks
    finally:
        net.stop_all()
