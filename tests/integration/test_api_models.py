"""Several models in one swarm: one bootstrap, the peers of two different tiny models (llama on one peer,
qwen2 on two), one `swarm api` serving both (`--model` and `--model-id` repeated).

Ground truth is each model run locally by transformers: a greedy completion through the gateway names its
model, and must give exactly the text of that model's greedy search, never the other's. `swarm status`
without a model lists both models from the swarm's directory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm.cli import main
from swarm_harness import LocalSwarm, start_models, wait_until
from tiny_models import build_servable_checkpoint

pytestmark = pytest.mark.integration

LLAMA, QWEN = "tiny-llama-a", "tiny-qwen2-b"
PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {LLAMA: build_servable_checkpoint("llama", tmp_path_factory.mktemp("llama-a"), seed=0),
            QWEN: build_servable_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-b"), seed=1)}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, checkpoints):
    """One swarm, two models: the llama on one peer, the qwen2 on two."""
    net = LocalSwarm(tmp_path_factory.mktemp("two-models"))
    try:
        start_models(net, {LLAMA: (checkpoints[LLAMA], (("llama-all", "0:6"),)),
                           QWEN: (checkpoints[QWEN], (("qwen-head", "0:3"), ("qwen-tail", "3:6")))})
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def oai(two_models, checkpoints):
    proc = two_models.start_api("api-two", checkpoints[LLAMA], "--model-id", LLAMA, "--model", str(checkpoints[QWEN]),
                                "--model-id", QWEN)
    yield openai.OpenAI(base_url=proc.extra["url"], api_key="unused", max_retries=0, timeout=60)
    two_models.stop("api-two")


def local_greedy(path, prompt: str, tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_one_gateway_serves_each_model_as_transformers_runs_it(oai, checkpoints):
    assert [m.id for m in oai.models.list()] == [LLAMA, QWEN]
    assert [oai.models.retrieve(m).id for m in (LLAMA, QWEN)] == [LLAMA, QWEN]
    expected = {m: local_greedy(checkpoints[m], PROMPT, TOKENS) for m in (LLAMA, QWEN)}
    assert expected[LLAMA] != expected[QWEN]  # two models: a request routed to the wrong one would show
    for model in (LLAMA, QWEN):
        got = oai.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        assert (got.model, got.choices[0].text) == (model, expected[model])
        streamed = oai.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[model]


def test_a_model_not_served_is_openai_404_and_a_missing_one_a_400(oai):
    for call in (lambda: oai.completions.create(model="tiny-mistral", prompt=PROMPT, max_tokens=2),
                 lambda: oai.models.retrieve("tiny-mistral")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert (e.value.body["code"], e.value.body["param"], e.value.body["type"]) == (
            "model_not_found", "model", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as e:  # several models served: a request must name one
        oai.post("/completions", body={"prompt": PROMPT, "max_tokens": 2}, cast_to=object)
    assert e.value.body["param"] == "model" and LLAMA in e.value.body["message"] and QWEN in e.value.body["message"]


def test_status_without_a_model_lists_every_model_of_the_swarm(two_models, capsys):
    def listed():
        assert main(["status", "--initial-peers", *two_models.bootstrap_addrs, "--json"]) == 0
        found = {m["model"]: m for m in json.loads(capsys.readouterr().out)["models"]}
        return found if all(m in found and found[m]["covered"] == 6 for m in (LLAMA, QWEN)) else None

    found = wait_until(listed, 30, "both models to be listed and covered")
    assert set(found) == {LLAMA, QWEN}
    assert [(found[m]["num_blocks"], found[m]["uncovered"], found[m]["online"]) for m in (LLAMA, QWEN)] == [
        (6, [], 1), (6, [], 2)]
    assert sorted((p["start"], p["end"]) for p in found[QWEN]["peers"]) == [(0, 3), (3, 6)]
    # the light client (its own process: py-libp2p and the daemon's bindings cannot share one) reads the same
    done = subprocess.run([sys.executable, "-m", "swarm.cli", "status", "--initial-peers", *two_models.bootstrap_addrs,
                           "--transport", "libp2p", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    light = {m["model"]: m for m in json.loads(done.stdout)["models"]}
    assert {m: (light[m]["covered"], light[m]["online"]) for m in light} == {LLAMA: (6, 1), QWEN: (6, 2)}
    assert main(["status", "--initial-peers", *two_models.bootstrap_addrs]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "2 models in the swarm"
    assert [line.split()[:3] for line in table[2:]] == [[LLAMA, "6/6", "1/1"], [QWEN, "6/6", "2/2"]]
