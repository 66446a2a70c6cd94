"""A gateway serving several models, without a swarm: each request goes to the model its `model` field names
(the tokenizer endpoints show whose tokenizer answered), a model not served is OpenAI's 404 `model_not_found`,
and `--model`/`--model-id` pair up as documented. A real aiohttp server on 127.0.0.1, a real HTTP client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from client.api.gateway import Gateway
from client.api.served import ServedModel, served_models
from client.config import ApiConfig
from swarm import http
from swarm.errors import ConfigError

pytestmark = pytest.mark.unit


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def served(model_id: str, words: list[str], context: int) -> ServedModel:
    return ServedModel(model_id, None, SimpleNamespace(vocab_size=len(words)), word_tokenizer(words), context, [0])


A = served("model-a", ["?", "hello", "world"], 64)
B = served("model-b", ["?", "world", "hello"], 32)


def ask(gateway_models: list[ServedModel], calls: list[tuple[str, str, dict | None]]) -> list[tuple[int, dict]]:
    async def run():
        gw = Gateway(ApiConfig(), gateway_models)
        server = await http.start(gw.app(), "127.0.0.1", 0, gw.config.limits)
        out = []
        try:
            async with aiohttp.ClientSession() as session:
                for method, path, body in calls:
                    async with session.request(method, f"{server.url}{path}", json=body) as resp:
                        out.append((resp.status, await resp.json()))
        finally:
            await server.close()
            await gw.close()
        return out

    return asyncio.run(run())


def test_each_request_goes_to_the_model_it_names():
    (listed, card, tok_a, tok_b, info_b, detok_b) = ask([A, B], [
        ("GET", "/v1/models", None), ("GET", "/v1/models/model-b", None),
        ("POST", "/tokenize", {"model": "model-a", "prompt": "hello world"}),
        ("POST", "/tokenize", {"model": "model-b", "prompt": "hello world"}),
        ("GET", "/tokenizer_info?model=model-b", None),
        ("POST", "/detokenize", {"model": "model-b", "tokens": [1, 2]})])
    assert listed == (200, {"object": "list", "data": [
        {"id": m, "object": "model", "created": listed[1]["data"][0]["created"], "owned_by": "swarm"}
        for m in ("model-a", "model-b")]})
    assert card[1]["id"] == "model-b"
    assert (tok_a[1]["tokens"], tok_a[1]["max_model_len"]) == ([1, 2], 64)
    assert (tok_b[1]["tokens"], tok_b[1]["max_model_len"]) == ([2, 1], 32)
    assert (info_b[1]["model_max_length"], info_b[1]["vocab_size"]) == (32, 3)
    assert detok_b == (200, {"prompt": "world hello"})


def test_a_model_not_served_is_404_and_a_missing_one_400_when_several_are_served():
    replies = ask([A, B], [
        ("POST", "/v1/completions", {"model": "model-c", "prompt": "hello"}),
        ("POST", "/v1/chat/completions", {"model": "model-c", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/embeddings", {"model": "model-c", "input": "hello"}),
        ("GET", "/v1/models/model-c", None),
        ("POST", "/tokenize", {"model": "model-c", "prompt": "hello"}),
        ("POST", "/v1/completions", {"prompt": "hello"}),
        ("POST", "/tokenize", {"prompt": "hello"}),
        ("GET", "/tokenizer_info", None)])
    for status, body in replies[:5]:
        assert status == 404
        assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert "'model-c'" in body["error"]["message"] and "'model-a', 'model-b'" in body["error"]["message"]
    for status, body in replies[5:]:
        assert (status, body["error"]["param"], body["error"]["code"]) == (400, "model", "invalid_value")
        assert "'model-a', 'model-b'" in body["error"]["message"]


def test_one_model_served_keeps_the_model_optional_where_it_was():
    tokenized, info, completion = ask([A], [("POST", "/tokenize", {"prompt": "world"}), ("GET", "/tokenizer_info", None),
                                            ("POST", "/v1/completions", {"prompt": "hello"})])
    assert tokenized == (200, {"count": 1, "max_model_len": 64, "tokens": [2]})
    assert info[0] == 200 and info[1]["model_max_length"] == 64
    assert completion[0] == 400 and completion[1]["error"]["message"] == "'model' is required: a string naming the model"


def test_model_ids_pair_with_models_in_order(tmp_path):
    def checkpoint(folder: str, name: str) -> Path:  # named by its marker, as the demo model is
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "swarm-model.json").write_text(json.dumps({"name": name}))
        (tmp_path / folder / "config.json").write_text(json.dumps({"model_type": name}))
        (tmp_path / folder / "model.safetensors").write_bytes(name.encode())
        return tmp_path / folder

    def served(*args):
        return [(w.directory, w.name) for w in served_models(*args)]

    a, b, c = checkpoint("a", "llama"), checkpoint("b", "qwen"), checkpoint("c", "llama")
    assert served([a, b], None, None) == [(a, "llama"), (b, "qwen")]
    assert served([a, b], ["x", "y"], None) == [(a, "x"), (b, "y")]
    assert served([str(a)], ["x"], None) == [(a, "x")]
    with pytest.raises(ConfigError, match="1 --model-id for 2 --model: give none"):
        served_models([a, b], ["x"], None)
    with pytest.raises(ConfigError, match="two models would be served as llama"):
        served_models([a, c], None, None)
    with pytest.raises(ConfigError, match="two models would be served as x"):
        served_models([a, b], ["x", "x"], None)
