"""Exact failover: peers die (SIGKILL), freeze (SIGSTOP) or vanish entirely mid-generation.

A swarm of its own: blocks [0:3) on one peer, [3:6) on two replicas. Each fault hits the replica the
running generation uses, from inside `generate` (a streamer), between two tokens. The tokens must
equal transformers' local `generate`, and the stall between two tokens must stay short.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.model import DistributedModelForCausalLM
from swarm.errors import NoRoute
from swarm_harness import Fault, MODEL_ID, replicated_swarm

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
NEW_TOKENS = 24
FAULT_AFTER = 8  # tokens generated before the fault


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, tiny_llama):
    with replicated_swarm(tmp_path_factory.mktemp("failover"), tiny_llama) as net:
        yield net


@pytest.fixture(scope="module")
def remote(replicated, tiny_llama):
    # no checked outputs: these tests time the stream token by token, which a check would hold back (the failover
    # of checked sessions is in test_trust); a session per generation: each test counts its own failovers
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, replicated.bootstrap_addrs, model_id=MODEL_ID,
                                                        verify_fraction=0, reuse_sessions=False)
    yield model
    model.close()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return local.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()


def generate(model, streamer):
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          streamer=streamer).tolist()


def test_no_fault_run_matches_local(remote, expected):
    assert remote.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist() == expected


def test_frozen_peer_is_routed_around(replicated, remote, expected):
    fault = Fault(replicated, remote, lambda proc: os.kill(proc.popen.pid, signal.SIGSTOP), FAULT_AFTER)
    try:
        assert generate(remote, fault) == expected
    finally:
        if fault.victim:
            os.kill(replicated.procs[fault.victim].popen.pid, signal.SIGCONT)
    [failover] = fault.session.failovers
    assert failover.reason == "timeout" and failover.blocks == "[3:6)"
    assert failover.stall_s < 3.0 and fault.worst_gap() < 3.0, (failover, fault.worst_gap())


def test_slow_peer_is_avoided_for_the_rest_of_the_session(replicated, tiny_llama, expected, caplog):
    caplog.set_level(logging.INFO, logger="client")
    # a client of its own: the shared one may still ban the replica an earlier test froze (5 s), and with its
    # only alternative banned a slow peer is rightly kept
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, replicated.bootstrap_addrs, model_id=MODEL_ID,
                                                        verify_fraction=0, reuse_sessions=False)
    throttled = []

    def slow_down(proc):
        # 3% of a core (a cgroup CPU quota: 3 ms per 100 ms): every decode step, a few ms of work, waits for the
        # next period, about 100 ms; a pause and resume cycle could fall in step with the client's steps instead
        replicated.throttle(proc, 0.03)
        throttled.append(proc)

    fault = Fault(replicated, model, slow_down, FAULT_AFTER)
    try:
        assert generate(model, fault) == expected
    finally:
        for proc in throttled:
            replicated.unthrottle(proc)
        model.close()
    assert len(fault.session.failovers) == 1, (fault.victim, caplog.text[-3000:])
    [failover] = fault.session.failovers
    assert failover.reason == "slow" and failover.failed_peer == replicated.procs[fault.victim].peer_id
    assert fault.victim not in {name for name, p in replicated.procs.items()
                                if any(h.peer == p.peer_id for h in fault.session.route)}


def test_killed_peer_is_replaced_exactly(replicated, remote, expected):
    fault = Fault(replicated, remote, lambda proc: replicated.stop(proc.name, signal.SIGKILL), FAULT_AFTER)
    assert generate(remote, fault) == expected
    [failover] = fault.session.failovers
    assert failover.reason == "connection_lost" and failover.failed_peer == replicated.procs[fault.victim].peer_id
    assert failover.stall_s < 2.0 and fault.worst_gap() < 2.0, (failover, fault.worst_gap())


def test_losing_the_last_replica_is_a_clear_error(replicated, remote):
    """With no wait for the blocks to come back (`--wait-for-blocks 0`; test_client_wait.py covers the
    wait), the generation fails at once, naming them."""
    client = remote.connection.client
    waiting, client.config = client.config, dataclasses.replace(client.config, wait_for_blocks=0)
    fault = Fault(replicated, remote, lambda proc: replicated.stop(proc.name, signal.SIGKILL), FAULT_AFTER)
    try:
        with pytest.raises(NoRoute, match=r"blocks \[3:6\)") as info:
            generate(remote, fault)
    finally:
        client.config = waiting
    assert time.monotonic() - fault.times[-1] < 5.0
    assert info.value.missing == (3, 4, 5)
    assert fault.session.position == fault.session.session.length  # a failed step leaves no trace
    assert not replicated.procs["head-span"].popen.poll()  # the rest of the swarm is untouched
