"""`swarm api`'s scoring features against the real demo swarm, through the `openai` package: log-probabilities
(chat and completions, streamed or not), echo and prompt scoring, several prompts per request, the tokenizer
endpoints, embeddings and the extra sampling fields. Ground truth is the same model run locally by
transformers in this process: its log-softmax, its final hidden states."""

from __future__ import annotations

import base64
import json
import math
import re
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from client.generation import stop_token_ids
from swarm.weights.models import local_model_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "The capital of France is"
TOLERANCE = 1e-3  # log-probabilities through the swarm vs locally (float32 both; different kernels)


@pytest.fixture(scope="module")
def model_id(demo_model_dir):
    return local_model_id(demo_model_dir)


@pytest.fixture(scope="module")
def api(demo_swarm, demo_model_dir):
    proc = demo_swarm.start_api("api-scoring", demo_model_dir, "--context-length", "256", "--max-tokens", "32")
    yield proc.extra["url"]
    demo_swarm.stop("api-scoring")


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def local(demo_model_dir):
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def local_logprobs(local, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every position of `ids` [tokens, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(local(torch.tensor([ids])).logits[0].float(), -1)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- log-probabilities ----

def test_echo_scores_the_prompt_with_the_models_own_logprobs(oai, model_id, tokenizer, local):
    ids = tokenizer(PROMPT + " Paris").input_ids
    reply = oai.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    want = local_logprobs(local, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]].item()) < TOLERANCE
        top = want[i - 1].topk(2)
        expected = {tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        assert set(expected) <= set(lp.top_logprobs[i]) and len(lp.top_logprobs[i]) <= 3  # k + the chosen one
        assert all(abs(lp.top_logprobs[i][k] - v) < TOLERANCE for k, v in expected.items())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def greedy_ids(local, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = local.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                             max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_generated_tokens_carry_their_logprobs_streamed_or_not(oai, model_id, tokenizer, local):
    ids = tokenizer(PROMPT).input_ids
    made = greedy_ids(local, ids, 6)
    want = local_logprobs(local, ids + made)
    whole = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in made] and "".join(lp.tokens) == whole.choices[0].text
    for i, value in enumerate(lp.token_logprobs):
        assert abs(value - want[len(ids) - 1 + i, made[i]].item()) < TOLERANCE
        assert list(lp.top_logprobs[i]) == [lp.tokens[i]]  # logprobs 0: the chosen token only
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(made))]
    chunks = list(oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                         stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_and_top_logprobs(oai, model_id, tokenizer, local):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    made = greedy_ids(local, ids, 5)
    want = local_logprobs(local, ids + made)
    reply = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in made]
    for i, entry in enumerate(content):
        row = want[len(ids) - 1 + i]
        assert abs(entry.logprob - row[made[i]].item()) < TOLERANCE
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOLERANCE)
    chunks = list(oai.chat.completions.create(model=model_id, messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


# ---- several prompts ----

def test_several_prompts_run_together_with_choices_indexed_as_openai_does(oai, model_id, tokenizer):
    prompts = [PROMPT, "Once upon a time", tokenizer("1, 2, 3,").input_ids]
    alone = [oai.completions.create(model=model_id, prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in prompts]
    batch = oai.completions.create(model=model_id, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [t for t in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) if isinstance(p, str) else len(p)
                                                    for p in prompts)
    chunks = list(oai.completions.create(model=model_id, prompt=prompts, max_tokens=5, temperature=0, stream=True))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == dict(enumerate(alone))


# ---- tokenizer endpoints ----

def test_tokenize_detokenize_and_tokenizer_info_in_vllms_shapes(api, model_id, tokenizer):
    root = api.removesuffix("/v1")
    status, out = post(f"{root}/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and out["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    status, chat = post(f"{root}/tokenize", {"model": model_id, "messages": [{"role": "user", "content": "hi"}],
                                             "return_token_strs": True})
    assert chat["tokens"] == list(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=True)["input_ids"])
    assert len(chat["token_strs"]) == chat["count"]
    assert post(f"{root}/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": PROMPT})
    with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=10) as resp:
        info = json.loads(resp.read())
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    status, err = post(f"{root}/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = post(f"{root}/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"


# ---- embeddings ----

def test_embeddings_are_the_mean_of_the_final_hidden_states(oai, model_id, tokenizer, local):
    texts = ["The capital of France is Paris.", "Bonjour"]
    reply = oai.embeddings.create(model=model_id, input=texts)
    assert [d.index for d in reply.data] == [0, 1]
    for text, item in zip(texts, reply.data):
        with torch.no_grad():
            states = local(torch.tensor([tokenizer(text).input_ids]), output_hidden_states=True).hidden_states[-1]
        want = states[0].mean(0)
        want = want / want.norm()
        assert len(item.embedding) == want.numel()
        assert torch.allclose(torch.tensor(item.embedding), want, atol=1e-4)
        assert math.isclose(float(np.linalg.norm(item.embedding)), 1.0, rel_tol=1e-5)
    raw = oai.embeddings.with_raw_response.create(model=model_id, input=texts[0], encoding_format="base64")
    packed = json.loads(raw.text)["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == pytest.approx(reply.data[0].embedding,
                                                                                          abs=1e-6)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t).input_ids) for t in texts)
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=model_id, input="x", dimensions=8)


# ---- sampling fields ----

def test_top_k_min_p_and_repetition_penalty(oai, model_id):
    greedy = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    top1 = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # only the most likely token is left
    certain = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                     extra_body={"min_p": 1.0}).choices[0].text
    assert certain == greedy
    runs = [oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                   extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.2}).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, extra_body={"repetition_penalty": -1})


# ---- speculative decoding ----

COPY = ("Rewrite this sentence word for word: The quick brown fox jumps over the lazy dog while the farmer watches "
        "from the old wooden fence near the river, and the children laugh in the tall summer grass.")


def drafted(api: str) -> dict[str, float]:
    with urllib.request.urlopen(api.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {outcome: float(value) for outcome, value in
            re.findall(r'^swarm_api_drafted_tokens_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_speculative_decoding_gives_the_same_text_in_fewer_steps(oai, api, model_id, tokenizer, local, demo_model_dir):
    """Greedy requests draft tokens by prompt lookup (on by default); a copying answer has them accepted, and
    the text is transformers' greedy text, streamed or not."""
    messages = [{"role": "user", "content": COPY}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    with torch.no_grad():
        out = local.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                             max_new_tokens=32, do_sample=False, pad_token_id=0,
                             eos_token_id=stop_token_ids(tokenizer, GenerationConfig.from_pretrained(demo_model_dir)))
    want = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    before = drafted(api)
    reply = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=32, temperature=0)
    assert reply.choices[0].message.content == want
    after = drafted(api)
    assert after.get("accepted", 0) > before.get("accepted", 0)
    chunks = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
