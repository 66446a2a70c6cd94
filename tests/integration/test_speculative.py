"""transformers' assisted generation through the swarm (`prompt_lookup_num_tokens`, `assistant_model`): the
session is the cache transformers crops after each pass over drafted tokens, and greedy output is
token for token plain greedy, and so transformers' own, also when a peer freezes in the middle of a
speculative run."""

from __future__ import annotations

import argparse
import io
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.cli import stream_answer
from client.generation import stop_token_ids
from client.inference.session import InferenceSession
from client.model import DistributedModelForCausalLM
from swarm.weights.models import local_model_id
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
                                                        model_id=local_model_id(demo_model_dir))
    yield model
    model.close()


@pytest.fixture(scope="module")
def demo_local(demo_model_dir):
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def copy_prompt(demo_model_dir, text: str = COPY) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
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


PARAGRAPH = ("Copy the following text exactly, word for word: Every morning the baker opens her shop on the corner of "
             "Main Street at six o'clock. She bakes bread, rolls and small cakes, and the smell fills the whole street. "
             "Children stop on their way to school to look through the window, and old men sit on the bench outside "
             "with their coffee, talking about the weather and the news of the day.")


def test_prompt_lookup_up_to_max_new_tokens_stays_in_the_session(demo, demo_local, demo_model_dir, monkeypatch):
    """A user's report: a chat prompt of about 110 tokens copying a paragraph, 64 new tokens, 8 drafted by prompt
    lookup, failed with `BadRequest: 175 tokens exceed the session's max_length 174`. transformers bounds where its
    prompt lookup copies from by max_length, not how many tokens it drafts: a pass may verify 8 drafts after the
    last input, past max_length. A session sized for this call alone must leave room for them."""
    ids = copy_prompt(demo_model_dir, PARAGRAPH)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, pad_token_id=0)
    want = demo_local.generate(ids, **kwargs).tolist()
    ends = []
    step = InferenceSession.step

    async def spy(self, hidden, position=None, attention_mask=None):
        ends.append((self.length if position is None else position) + hidden.shape[1])
        return await step(self, hidden, position, attention_mask)

    monkeypatch.setattr(InferenceSession, "step", spy)
    monkeypatch.setattr(demo, "reuse_sessions", False)  # a session sized for this call only
    assert demo.generate(ids, prompt_lookup_num_tokens=8, **kwargs).tolist() == want
    assert max(ends) > ids.shape[1] + 64  # drafts were verified past max_length (what the session must hold)


def answer(model, tokenizer, speculate: int, **sampling) -> tuple[str, dict]:
    """`swarm generate --chat`'s answer to the copying prompt (through `client.generation`), and its figures."""
    args = argparse.Namespace(**{"max_new_tokens": 40, "temperature": None, "top_p": None, "top_k": None,
                                 "seed": None, "speculative_tokens": speculate, **sampling})
    out = io.StringIO()
    stats = stream_answer(model, tokenizer, COPY, args, chat=True, out=out)
    return out.getvalue(), stats


def test_generate_drafts_by_default_and_gives_transformers_greedy_text(demo, demo_local, demo_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = copy_prompt(demo_model_dir)
    want = demo_local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                               pad_token_id=0, eos_token_id=stop_token_ids(tokenizer, demo_local.generation_config))
    text, stats = answer(demo, tokenizer, speculate=8)
    assert text == tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True)
    assert stats["accepted"] > 0 and stats["tokens"] == want.shape[1] - ids.shape[1]


def test_seeded_sampling_with_drafts_gives_the_text_without_drafts(demo, demo_model_dir):
    """Drafts checked by the sampler itself: a sampled run's tokens are those it chooses one step at a time."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    plain, _ = answer(demo, tokenizer, speculate=0, temperature=0.3, seed=11)
    drafted, stats = answer(demo, tokenizer, speculate=8, temperature=0.3, seed=11)
    assert drafted == plain and len(plain) > 40
    assert stats["accepted"] > 0


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


# ---- a long prompt in chunks (`client.inference.pipeline`) ----

LONG_PROMPT = torch.arange(300)[None] * 7 % 250 + 1


def test_a_long_prompt_in_chunks_gives_the_same_tokens(replicated, tiny_llama):
    kwargs = dict(attention_mask=torch.ones_like(LONG_PROMPT), max_new_tokens=8, do_sample=False, pad_token_id=0)
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    want = local.generate(LONG_PROMPT, **kwargs).tolist()
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, replicated.bootstrap_addrs, model_id=MODEL_ID,
                                                     verify_fraction=0, prefill_chunk=64) as remote:
        with remote.inference_session(max_length=400) as session:
            assert remote.generate(LONG_PROMPT, **kwargs).tolist() == want
            assert session.session.pipelined == 1  # 300 tokens: chunks of 64, 64, 64 and 108


def test_a_peer_lost_in_a_chunked_prompt_is_replaced_exactly(replicated, tiny_llama):
    """The session is open on both hops; the hop after the first dies before a long prompt step: the chunks
    stop, and the step runs again hop by hop, failing over to the other replica."""
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    short, kwargs = LONG_PROMPT[:, :10], dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = local.generate(LONG_PROMPT, **kwargs).tolist()
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, replicated.bootstrap_addrs, model_id=MODEL_ID,
                                                     verify_fraction=0, prefill_chunk=64) as remote:
        with remote.inference_session(max_length=400) as session:
            remote.generate(short, **kwargs)
            peer = next(h.peer for h in session.route if h.span.start == 3)
            victim = next(name for name, proc in replicated.procs.items() if proc.peer_id == peer)
            os.kill(replicated.procs[victim].popen.pid, signal.SIGKILL)
            replicated.procs[victim].popen.wait(10)
            assert remote.generate(LONG_PROMPT, **kwargs).tolist() == want
            assert session.session.pipelined == 0 and [f.failed_peer for f in session.failovers] == [peer]
