"""Waiting for blocks: a generation survives its span losing its last peer for a while.

A swarm of its own: blocks [0:3) on one peer, [3:6) on one other (no replica). Mid-generation, the
only peer of [3:6) freezes for longer than a step's deadline and then resumes, or dies and a new peer
for the same blocks starts a few seconds later: the generation waits, replays onto the peer that serves
the blocks again, and its tokens equal transformers' local `generate`. With nothing coming back it
fails with `NoRoute` once its (short) wait is over. The order of the tests matters: each leaves the
swarm as the next expects it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.model import DistributedModelForCausalLM
from swarm.errors import NoRoute
from swarm_harness import Fault, LocalSwarm, MODEL_ID, PEER_OPTIONS, start_split

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
NEW_TOKENS = 16
FAULT_AFTER = 6  # tokens generated before the fault
# longer than what the client tries before it waits: a step's deadline (1.5 s and a little), the 0.5 s probe,
# a re-read of the view and a second-chance ping (2 s)
FREEZE_S = 10.0
WAITING = r"waiting up to {} s for blocks \[3:6\) of tiny-llama to be served again\.\.\."


@pytest.fixture(scope="module")
def gap_swarm(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("wait"))
    try:
        start_split(net, tiny_llama)
        yield net
    finally:
        for proc in net.procs.values():  # a test that failed half-way may leave a peer stopped
            if proc.alive():
                os.kill(proc.popen.pid, signal.SIGCONT)
        net.stop_all()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return local.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()


def open_model(net: LocalSwarm, tiny_llama, notices: list, **config) -> DistributedModelForCausalLM:
    model = DistributedModelForCausalLM.from_pretrained(tiny_llama, net.bootstrap_addrs, model_id=MODEL_ID, **config)
    model.on_wait = notices.append
    return model


def generate(model, streamer):
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          streamer=streamer).tolist()


def test_a_frozen_last_peer_that_resumes_is_waited_for(gap_swarm, tiny_llama, expected):
    notices, timers = [], []

    def freeze(proc):
        os.kill(proc.popen.pid, signal.SIGSTOP)
        timers.append(threading.Timer(FREEZE_S, os.kill, (proc.popen.pid, signal.SIGCONT)))
        timers[-1].start()

    with open_model(gap_swarm, tiny_llama, notices) as model:  # the default wait: 30 s
        fault = Fault(gap_swarm, model, freeze, FAULT_AFTER)
        try:
            assert generate(model, fault) == expected
        finally:
            for timer in timers:
                timer.join(FREEZE_S + 5)
            os.kill(gap_swarm.procs["tail"].popen.pid, signal.SIGCONT)
    assert fault.victim == "tail" and len(notices) == 1
    assert re.fullmatch(WAITING.format(30), notices[0]), notices
    [failover] = fault.session.failovers  # waiting is not a retry: one failure, one replacement
    assert failover.reason == "timeout" and failover.blocks == "[3:6)"
    assert failover.new_hops == (f"[3:6) at {gap_swarm.procs['tail'].peer_id[-8:]}",)
    assert FREEZE_S - 1 < failover.stall_s < FREEZE_S + 8, failover


def test_a_dead_last_peer_replaced_by_a_new_one_is_waited_for(gap_swarm, tiny_llama, expected):
    notices, starters = [], []

    def replace(proc):
        gap_swarm.stop(proc.name, signal.SIGKILL)
        starters.append(threading.Timer(2.0, gap_swarm.start_peer, ("tail-2", tiny_llama, "--blocks", "3:6",
                                                                    *PEER_OPTIONS), {"wait": False}))
        starters[-1].start()

    # a new peer process takes a while to load torch and its blocks on a busy machine: a long wait
    with open_model(gap_swarm, tiny_llama, notices, wait_for_blocks=120) as model:
        fault = Fault(gap_swarm, model, replace, FAULT_AFTER)
        try:
            assert generate(model, fault) == expected
        finally:
            for starter in starters:
                starter.join(10)
    assert fault.victim == "tail" and len(notices) == 1 and re.fullmatch(WAITING.format(120), notices[0])
    [failover] = fault.session.failovers
    assert failover.reason == "connection_lost"
    assert failover.new_hops == (f"[3:6) at {gap_swarm.procs['tail-2'].peer_id[-8:]}",)


def test_with_nothing_coming_back_the_wait_ends_in_no_route(gap_swarm, tiny_llama):
    gap_swarm.wait_serving(gap_swarm.procs["tail-2"])
    notices = []
    with open_model(gap_swarm, tiny_llama, notices, wait_for_blocks=3) as model:
        fault = Fault(gap_swarm, model, lambda proc: gap_swarm.stop(proc.name, signal.SIGKILL), FAULT_AFTER)
        with pytest.raises(NoRoute, match=r"blocks \[3:6\) of tiny-llama.*; waited 3(\.\d)? s") as info:
            generate(model, fault)
        waited = time.monotonic() - fault.at
        assert fault.victim == "tail-2" and len(notices) == 1
        assert 3.0 <= waited < 10.0, waited
        assert info.value.missing == (3, 4, 5)
        assert fault.session.position == fault.session.session.length  # a failed step leaves no trace
        # a new generation has lost nothing yet: it does not wait, it fails at once
        started = time.monotonic()
        with pytest.raises(NoRoute, match=r"blocks \[3:6\)"):
            model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert time.monotonic() - started < 5.0 and len(notices) == 1
    assert gap_swarm.procs["head-span"].alive()  # the rest of the swarm is untouched
