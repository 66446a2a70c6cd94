"""transformers' assisted generation through the swarm (`prompt_lookup_num_tokens`, `assistant_model`): the
session is the cache transformers crops after each pass over drafted tokens, and greedy output is
token for token plain greedy, and so transformers' own, also when a peer freezes in the middle of a
speculative run."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.model import DistributedModelForCausalLM
from swarm.records import default_model_id
from swarm_harness import Fault, MODEL_ID, replicated_swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COPY = ("Rewrite this sentence word for word: The quick brown fox jumps over the lazy dog while the farmer watches "
        "from the old wooden fence near the river, and the children laugh in the tall summer grass.")


class Steps:
    """A streamer that records how many tokens each step gave (more than one: drafted tokens accepted)."""

    def __init__(self):
        self.sizes: list[int] = []

    def put(self, value) -> None:
        self.sizes.append(value.numel())

    def end(self) -> None:
        pass


@pytest.fixture(scope="module")
def demo(demo_swarm, demo_model_dir):
    model = DistributedModelForCausalLM.from_pretrained(demo_model_dir, demo_swarm.bootstrap_addrs,
                                                        model_id=default_model_id(demo_model_dir))
    yield model
    model.close()


@pytest.fixture(scope="module")
def demo_local(demo_model_dir):
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def copy_prompt(demo_model_dir) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return tokenizer.apply_chat_template([{"role": "user", "content": COPY}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_prompt_lookup_through_the_swarm_equals_plain_greedy(demo, demo_local, demo_model_dir):
    ids = copy_prompt(demo_model_dir)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = demo_local.generate(ids, **kwargs).tolist()
    steps = Steps()
    got = demo.generate(ids, prompt_lookup_num_tokens=8, streamer=steps, **kwargs).tolist()
    assert got == want
    assert max(steps.sizes[1:]) > 1  # drafted tokens were accepted: steps of several tokens (the first is the prompt)
    assert demo.generate(ids, **kwargs).tolist() == want  # and the plain path is unchanged


def test_an_assistant_model_through_the_swarm_equals_plain_greedy(demo, demo_local, demo_model_dir):
    ids = copy_prompt(demo_model_dir)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = demo_local.generate(ids, **kwargs).tolist()
    assert demo.generate(ids, assistant_model=demo_local, **kwargs).tolist() == want


@pytest.fixture(scope="module")
def replicated(tmp_path_factory, tiny_llama):
    with replicated_swarm(tmp_path_factory.mktemp("speculative"), tiny_llama) as net:
        yield net


def test_a_peer_frozen_mid_speculation_is_replaced_exactly(replicated, tiny_llama):
    prompt = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11, 5, 17, 42, 99]])
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    want = local.generate(prompt, **kwargs).tolist()
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, replicated.bootstrap_addrs, model_id=MODEL_ID,
                                                     verify_fraction=0) as remote:
        assert remote.generate(prompt, prompt_lookup_num_tokens=4, **kwargs).tolist() == want
        fault = Fault(replicated, remote, lambda proc: os.kill(proc.popen.pid, signal.SIGSTOP), 3)
        try:
            assert remote.generate(prompt, prompt_lookup_num_tokens=4, streamer=fault, **kwargs).tolist() == want
            assert fault.victim is not None and remote.active_session is None
        finally:
            if fault.victim:
                os.kill(replicated.procs[fault.victim].popen.pid, signal.SIGCONT)
