"""The real demo model (SmolLM2-135M-Instruct), cut into three spans, generates exactly what
transformers' own `generate` does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.inference.local_chain import LocalChain

pytestmark = [pytest.mark.models, pytest.mark.slow]


@torch.inference_mode()
def test_three_spans_of_smollm2_match_transformers_generate(demo_model_dir):
    from swarm.local.demo_model import DEMO_PROMPT

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tokenizer(DEMO_PROMPT, return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    del ref

    chain = LocalChain.from_path(demo_model_dir, 3)
    assert [str(b.span) for b in chain.blocks] == ["[0:10)", "[10:20)", "[20:30)"]
    session = chain.session(max_length=ids.shape[1] + 32)
    logits = session.prefill(ids, chunk=3)[:, -1]
    ours = []
    for _ in range(32):
        ours.append(int(logits.argmax(-1)))
        logits = session.step(torch.tensor([ours[-1:]]))[:, -1]
    assert ours == expected.tolist(), (tokenizer.decode(ours), tokenizer.decode(expected))
    assert "Paris" in tokenizer.decode(ours)

