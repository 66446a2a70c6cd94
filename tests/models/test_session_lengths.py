"""The session length the SDK asks for a `generate()` (`DistributedModelForCausalLM._max_length`) holds every
sequence transformers runs through the model, also with prompt lookup drafting near max_length: transformers
bounds where its drafts are copied from by max_length, not how many it drafts, so a pass may run past it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from client.model import DistributedModelForCausalLM, drafted_tokens

pytestmark = pytest.mark.models

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11] * 4])  # repeated: prompt lookup always finds a draft


def needed(prompt_length: int, **kwargs) -> int:
    model = SimpleNamespace(generation_config=GenerationConfig())
    return DistributedModelForCausalLM._max_length(model, prompt_length, kwargs)


@torch.inference_mode()
def test_prompt_lookup_runs_past_max_length_and_the_session_holds_it(tiny_checkpoint):
    local = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    lengths = []

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        lengths.append((0 if cache is None else cache.get_seq_length()) + kwargs["input_ids"].shape[1])

    hook = local.register_forward_pre_hook(record, with_kwargs=True)
    over = []
    try:
        for new in range(1, 17):  # where the last pass falls varies with the length
            lengths.clear()
            local.generate(PROMPT, max_new_tokens=new, prompt_lookup_num_tokens=8, do_sample=False, pad_token_id=0)
            assert max(lengths) <= needed(PROMPT.shape[1], max_new_tokens=new, prompt_lookup_num_tokens=8)
            over.append(max(lengths) - (PROMPT.shape[1] + new))
    finally:
        hook.remove()
    assert max(over) > 0, over  # past max_length: what a session sized for prompt + new tokens would refuse


def test_lengths_a_call_needs():
    assert needed(110, max_new_tokens=64) == 174
    assert needed(110, max_new_tokens=64, prompt_lookup_num_tokens=8) == 182
    assert needed(110, max_new_tokens=64, generation_config=GenerationConfig(prompt_lookup_num_tokens=4)) == 178
    assert needed(10) == 30 and needed(30, max_length=50) == 50  # transformers' default: 20 new tokens
    assert drafted_tokens({}, GenerationConfig()) == 0
