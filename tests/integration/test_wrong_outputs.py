"""A sole server of some blocks that returns outputs no blocks can produce, for real on 127.0.0.1 with the demo
model: honest [0:15), and [15:30) served only by a peer whose outputs are all zeros, constant rows or NaN
(`tests/adversary.py`). Such a peer is caught by the free check of every output (`hops.implausible`) and
banned as a liar; with no other peer of its blocks there is nothing to wait for, so the SDK raises a
`NoRoute` naming it within seconds (never an empty text as an answer, never after a wait for blocks), and
`swarm api` answers 503 with the reason, streamed or not.

One swarm for the module: the three liars serve [15:30) side by side, and each client is let route only
through the honest peer and one of them (`allow_peers`), so each sees a sole server of [15:30).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from adversary import adversary
from client.model import DistributedModelForCausalLM
from swarm.errors import NoRoute
from swarm.net.transport import describe_peer
from swarm.weights.models import local_model_id
from swarm_harness import LocalSwarm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LIARS = ("zeros", "constant", "nan")
PROMPT = "The capital of France is"
PROMPTLY_S = 10.0  # a clear error within this, far below one wait for blocks (`wait_for_blocks`, 30 s)


@pytest.fixture(scope="module")
def liar_swarm(tmp_path_factory, demo_model_dir):
    net = LocalSwarm(tmp_path_factory.mktemp("liar-swarm"))
    try:
        net.start_bootstrap()
        options = ("--model-id", local_model_id(demo_model_dir), "--threads", "1", "--cache-tokens", "4096")
        net.start_peer("honest", demo_model_dir, "--blocks", "0:15", *options, wait=False)
        for mode in LIARS:
            net.start_peer(mode, demo_model_dir, "--blocks", "15:30", *options, wait=False, program=adversary(mode))
        for name in ("honest", *LIARS):
            net.wait_serving(net.procs[name], timeout=300)
        yield net
    finally:
        net.stop_all()


def allowed(net: LocalSwarm, *names: str) -> tuple[str, ...]:
    return tuple(net.procs[name].peer_id for name in ("honest", *names))


@pytest.mark.parametrize("mode", LIARS)
def test_the_sdk_fails_at_once_naming_the_peer_that_returned_wrong_outputs(liar_swarm, demo_model_dir, mode):
    ids = AutoTokenizer.from_pretrained(demo_model_dir)(PROMPT, return_tensors="pt").input_ids
    liar = liar_swarm.procs[mode].peer_id
    with DistributedModelForCausalLM.from_pretrained(demo_model_dir, liar_swarm.bootstrap_addrs,
                                                     allow_peers=allowed(liar_swarm, mode)) as model:
        started = time.monotonic()
        with pytest.raises(NoRoute, match=r"no honest peer serves blocks \[15:30\) .*: peer "
                           f"{re.escape(describe_peer(liar))} returned wrong outputs") as e:
            model.generate(ids, max_new_tokens=4, do_sample=False)
        elapsed = time.monotonic() - started
        assert model.connection.client.bans.reasons[liar] == "wrong_output"
    assert elapsed < PROMPTLY_S, f"NoRoute after {elapsed:.1f} s: {e.value}"


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_api_answers_503_with_the_reason_promptly_streamed_or_not(liar_swarm, demo_model_dir):
    """The API may route through the zeros and the NaN liar (both sole servers of [15:30) as far as it may
    know): the first request finds both out, the next knows them already; each gets 503 within seconds."""
    proc = liar_swarm.start_api("api", demo_model_dir, "--max-tokens", "8", "--allow-peers",
                                *allowed(liar_swarm, "zeros", "nan"))
    url = proc.extra["url"] + "/completions"
    body = {"model": local_model_id(demo_model_dir), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    try:
        for stream in (True, False):
            started = time.monotonic()
            status, text = post(url, {**body, "stream": stream}, timeout=PROMPTLY_S + 20)
            elapsed = time.monotonic() - started
            assert status == 503, text
            error = json.loads(text)["error"]
            assert error["code"] == "no_route" and "[15:30)" in error["message"], error
            assert elapsed < PROMPTLY_S, f"{status} after {elapsed:.1f} s: {error}"
            if stream:  # the first request: both liars caught, by what they returned
                for name in ("zeros", "nan"):
                    assert describe_peer(liar_swarm.procs[name].peer_id) in error["message"], error
                assert "returned wrong outputs" in error["message"]
            else:
                assert "wrong_output" in error["message"] or "returned wrong outputs" in error["message"], error
    finally:
        liar_swarm.stop("api")
