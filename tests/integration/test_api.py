"""`swarm api` against the real demo swarm, driven by the official `openai` package, curl and raw sockets.

Ground truth is the SDK's `generate` through the same swarm (itself checked against local transformers
in test_demo_swarm.py): greedy completions and chats, streamed or not, must give the same text.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, GenerationConfig

from client.generation import stop_token_ids
from client.loop import LoopThread
from client.model import DistributedModelForCausalLM
from client.inference.peer_session import info
from swarm_harness import client_node, wait_until
from swarm.weights.models import local_model_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
CONTEXT = 256
MAX_TOKENS = 64
MAX_BODY = 65536


@pytest.fixture(scope="module")
def model_id(demo_model_dir):
    return local_model_id(demo_model_dir)


@pytest.fixture(scope="module")
def api(demo_swarm, demo_model_dir):
    """The gateway under test: small limits, so that each limit can be reached cheaply."""
    proc = demo_swarm.start_api("api", demo_model_dir, "--context-length", str(CONTEXT), "--max-tokens",
                                str(MAX_TOKENS), "--max-generations", "4", "--max-queue", "2", "--max-connections",
                                "128", "--header-timeout", "3", "--body-timeout", "2", "--max-body-bytes",
                                str(MAX_BODY))
    yield proc.extra["url"]
    demo_swarm.stop("api")


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def sdk(demo_swarm, demo_model_dir):
    model = DistributedModelForCausalLM.from_pretrained(demo_model_dir, demo_swarm.bootstrap_addrs)
    yield model
    model.close()


@pytest.fixture(scope="module")
def sdk_text(sdk, tokenizer, demo_model_dir):
    """Greedy text (and token count) of the SDK's generate for a prompt's ids."""
    end = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(demo_model_dir))

    def generate(ids: list[int], max_new_tokens: int) -> tuple[str, int]:
        x = torch.tensor([ids])
        out = sdk.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=end, pad_token_id=end[0])
        new = out[0, len(ids):].tolist()
        return tokenizer.decode(new, skip_special_tokens=True), len(new)

    return generate


def post(url: str, body: bytes | dict, timeout: float = 30) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of a POST (errors included)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# ---- same text as the SDK ----

def test_models_lists_the_served_model(oai, model_id):
    assert [m.id for m in oai.models.list()] == [model_id]
    assert oai.models.retrieve(model_id).id == model_id


def test_completion_equals_sdk_generate_streamed_or_not(oai, model_id, tokenizer, sdk_text):
    expected, tokens = sdk_text(tokenizer(PROMPT).input_ids, 24)
    whole = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert whole.usage.completion_tokens == tokens
    assert whole.choices[0].finish_reason == ("length" if tokens == 24 else "stop")
    chunks = list(oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert len(chunks) > 3  # streamed token by token, not in one piece
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_equals_sdk_generate_streamed_or_not(oai, model_id, tokenizer, sdk_text):
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected, tokens = sdk_text(list(ids), 40)
    assert "Paris" in expected
    whole = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"  # the model ends its turn
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), tokens)
    chunks = list(oai.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == tokens and not chunks[-1].choices


def test_blocks_no_other_peer_can_check_are_named_in_a_header_and_the_usage(api, model_id):
    """The demo swarm's three peers each serve their blocks alone: nothing checks them, and answers say so."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    status, headers, whole = post(api + "/completions", body)
    assert status == 200
    blocks = headers["X-Swarm-Unchecked-Blocks"].split(", ")
    assert [b.split(" at ")[0] for b in blocks] == ["[0:10)", "[10:20)", "[20:30)"]
    assert whole["usage"]["unchecked_blocks"] == blocks
    req = urllib.request.Request(api + "/completions", json.dumps({**body, "stream": True, "stream_options": {
        "include_usage": True}}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["X-Swarm-Unchecked-Blocks"] == headers["X-Swarm-Unchecked-Blocks"]
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert events[-1]["usage"]["unchecked_blocks"] == blocks


def test_stop_strings_cut_the_text_streamed_or_not(oai, model_id, tokenizer, sdk_text):
    expected, _ = sdk_text(tokenizer(PROMPT).input_ids, 24)
    assert "." in expected
    cut = expected[:expected.index(".")]
    whole = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=[".", "zzz"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    chunks = list(oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=".",
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_gives_choices(oai, model_id):
    def sample(seed):
        r = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=1.2, top_p=0.95,
                                   seed=seed, n=3)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage.completion_tokens

    first, tokens = sample(7)
    assert len(first) == 3 and tokens <= 36
    assert sample(7)[0] == first
    assert sample(8)[0] != first
    assert len(set(first)) > 1  # each choice samples on its own


def test_n_choices_stream_one_choice_per_chunk_like_the_whole_answer(oai, model_id):
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=1.0,
                  seed=11, n=3)
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    assert all(len(c.choices) == 1 for c in chunks)  # clients that read choices[0] see every choice
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in range(3)}
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]


def test_curl_streams_server_sent_events(api, model_id, oai):
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                       "temperature": 0, "stream": True})
    done = subprocess.run(["curl", "-sN", "-D", "/dev/stderr", "--max-time", "60", f"{api}/chat/completions", "-H",
                           "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=90)
    assert "content-type: text/event-stream" in done.stderr.lower()
    events = [ln.removeprefix("data: ") for ln in done.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": QUESTION}],
                                        max_tokens=16, temperature=0)
    assert text == whole.choices[0].message.content


def test_concurrent_streams_are_served_at_the_same_time(oai, model_id):
    expected = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    spans: list[tuple[float, float, str]] = []

    def client():
        c = openai.OpenAI(base_url=str(oai.base_url), api_key="unused", max_retries=0, timeout=60)
        first, text = None, ""
        for chunk in c.completions.create(model=model_id, prompt=PROMPT, max_tokens=32, temperature=0, stream=True):
            first = first or time.monotonic()
            text += chunk.choices[0].text
        spans.append((first, time.monotonic(), text))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(spans) == 4 and all(s[2] == expected for s in spans)
    # every stream had produced its first token before any stream ended: all four ran at once
    assert max(s[0] for s in spans) < min(s[1] for s in spans)


# ---- errors ----

@pytest.mark.parametrize("change, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 5}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),  # over the server's limit
    ({"best_of": 3}, "best_of"),  # not implemented: refused, never ignored
])
def test_invalid_parameters_are_400(api, model_id, change, param):
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": PROMPT, **change})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert body["error"]["message"]


def test_nan_temperature_is_400(api, model_id):
    raw = ('{"model": "%s", "prompt": "hi", "temperature": NaN}' % model_id).encode()
    status, _, body = post(f"{api}/completions", raw)
    assert status == 400 and body["error"]["param"] == "temperature"


def test_the_official_client_sees_typed_errors(oai, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt="hi")
    assert e.value.body["code"] == "model_not_found"


def test_context_length_is_enforced(api, model_id):
    long_prompt = "word " * (CONTEXT + 10)
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": long_prompt, "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    near = "word " * (CONTEXT - 20)
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": near, "max_tokens": MAX_TOKENS})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "in the completion" in body["error"]["message"]


def test_malformed_requests(api, model_id):
    status, _, body = post(f"{api}/completions", b"{not json")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, _, body = post(f"{api}/completions", {"prompt": "no model"})
    assert status == 400 and body["error"]["param"] == "model"
    status, _, body = post(f"{api}/chat/completions", {"model": model_id, "messages": [{"role": "wizard"}]})
    assert status == 400 and body["error"]["param"] == "messages[0]"
    status, _, body = post(f"{api}/nowhere", {"model": model_id})
    assert status == 404 and body["error"]["code"] == "not_found"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{api}/completions", timeout=10)  # GET
    assert e.value.code == 405 and json.loads(e.value.read())["error"]["code"] == "method_not_allowed"


def test_oversize_body_is_413(api, model_id):
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": "x" * (MAX_BODY + 1)})
    assert status == 413 and body["error"]["code"] == "body_too_large"


def test_slow_body_is_408(api):
    host, port = api.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        reply = b""
        for _ in range(100):  # the server answers once the 2 s body deadline has passed, then closes
            data = s.recv(4096)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply


def test_uncovered_blocks_are_503_with_retry_after(demo_swarm, demo_model_dir):
    """A second model in the swarm whose only peer serves blocks [0:10) of 30."""
    demo_swarm.start_peer("half", demo_model_dir, "--blocks", "0:10", "--model-id", "half-model", "--cache-tokens",
                          "1024")
    proc = demo_swarm.start_api("api-half", demo_model_dir, "--model-id", "half-model", "--retry-after", "7")
    try:
        status, headers, body = post(f"{proc.extra['url']}/completions", {"model": "half-model", "prompt": "hi"})
    finally:
        demo_swarm.stop("api-half")
        demo_swarm.stop("half")
    assert status == 503 and headers["Retry-After"] == "7"
    assert body["error"]["code"] == "no_route" and "[10:30) of half-model" in body["error"]["message"]


def test_edge_inputs_get_answers_not_crashes(api, model_id, oai):
    greedy = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": PROMPT, "max_tokens": 6,
                                                  "temperature": 1e-300})
    assert status == 200 and body["choices"][0]["text"] == greedy  # a vanishing temperature is greedy
    for where, payload in (("prompt", {"prompt": "hi \ud800"}),
                           ("messages[0].content", {"messages": [{"role": "user", "content": "hi \ud800"}]})):
        endpoint = "completions" if "prompt" in payload else "chat/completions"
        status, _, body = post(f"{api}/{endpoint}", {"model": model_id, **payload})  # JSON escapes it: \\ud800
        assert status == 400 and body["error"]["param"] == where, body
    status, _, body = post(f"{api}/completions", {"model": model_id, "prompt": "x" * (CONTEXT * 16 + 1)})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


def test_full_queue_is_503_and_the_rest_complete(oai, model_id):
    results: list[object] = []

    def client():
        c = openai.OpenAI(base_url=str(oai.base_url), api_key="unused", max_retries=0, timeout=60)
        try:
            results.append("".join(ch.choices[0].text for ch in c.completions.create(
                model=model_id, prompt=PROMPT, max_tokens=48, temperature=0, stream=True)))
        except openai.APIStatusError as e:
            results.append(e)

    threads = [threading.Thread(target=client) for _ in range(8)]  # 4 slots + 2 queue places
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    busy = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert len(results) == 8 and len(busy) >= 2
    assert all(e.status_code == 503 and e.response.headers["Retry-After"] for e in busy)
    assert len({r for r in results if isinstance(r, str)}) == 1  # the others completed, all alike


# ---- hardening ----

@pytest.fixture(scope="module")
def peers_info(demo_swarm):
    """Sessions open on each demo peer, from their info calls."""
    with LoopThread() as loop, client_node(loop, demo_swarm.bootstrap_addrs) as node:
        peers = [demo_swarm.procs[f"peer{i}"].peer_id for i in range(3)]

        def sessions() -> list[int]:
            return [loop.run(info(node, p, timeout=5), timeout=10).sessions for p in peers]

        yield sessions


def test_disconnect_mid_stream_frees_peer_sessions(oai, model_id, peers_info, api):
    # earlier requests' sessions are closed, or kept for reuse (client.api.reuse): those stay while this runs
    seen = [peers_info()]
    wait_until(lambda: seen.append(peers_info()) or seen[-1] == seen[-2], 10, "earlier requests' sessions to close")
    kept = seen[-1]
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me a story."}]
    stream = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)
    received = [next(stream) for _ in range(4)]
    assert received[-1].choices[0].finish_reason is None  # still generating
    assert peers_info() == [n + 1 for n in kept]  # its own session (a new one, or a fork of a kept one)
    stream.close()
    closed = time.monotonic()
    wait_until(lambda: peers_info() == kept, 10, "the peers to close the abandoned session")
    assert time.monotonic() - closed < 5
    cancelled = scrape(api)["swarm_api_cancelled"]
    assert cancelled[()] >= 1


async def _slow_headers(host: str, port: int, count: int, seconds: float) -> tuple[int, int]:
    """`count` connections that send a request line, then a header byte every half second; how many the
    server closed (or refused) within `seconds`, and how many were opened."""
    conns = []
    for _ in range(count):
        try:
            conns.append(await asyncio.wait_for(asyncio.open_connection(host, port), 5))
        except (OSError, asyncio.TimeoutError):
            continue
    for _, w in conns:
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    async def closed(reader, writer) -> bool:
        try:
            return await asyncio.wait_for(_trickle_until_closed(reader, writer), seconds)
        except asyncio.TimeoutError:
            return False
        finally:
            writer.close()

    results = await asyncio.gather(*(closed(r, w) for r, w in conns))
    return sum(results), len(conns)


async def _trickle_until_closed(reader, writer) -> bool:
    for _ in range(600):  # bounded by the caller's timeout too
        try:
            writer.write(b"X")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(1024), 0.5)
        except asyncio.TimeoutError:
            continue
        except OSError:
            return True
        if data == b"" or data.startswith(b"HTTP/1.1 503"):
            return True
    return False


def test_slow_header_flood_does_not_starve_a_real_request(api, oai, model_id):
    host, port = api.split("//")[1].split("/")[0].split(":")
    result: dict[str, object] = {}
    flood = threading.Thread(target=lambda: result.update(flood=asyncio.run(_slow_headers(host, int(port), 300, 8))))
    flood.start()
    fresh: list[socket.socket] = []
    try:
        time.sleep(2)  # the flood is in place: 300 connections against a cap of 128
        evicted = _evicted(api)
        # A fresh cap's worth right before the request, so that none has reached its header deadline (3 s)
        # however slow this machine is: the request gets in only by evicting one. A connection that cannot
        # evict gets 503, an error here. (No bound on the answer's time: that is the machine's load.)
        for _ in range(128):
            fresh.append(socket.create_connection((host, int(port)), timeout=5))
            fresh[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0)
        after = _evicted(api)
        # the fresh ones left reach their header deadline: each is closed by the server within a few seconds
        ended = sum(_closed_by_server(s, 10) for s in fresh)
    finally:
        for s in fresh:
            s.close()
        flood.join(60)
    assert "Paris" in answer.choices[0].text and after >= evicted + 1
    assert ended == len(fresh)
    closed, opened = result["flood"]
    assert opened >= 250 and closed == opened  # every slow connection was evicted or timed out within 8 s
    dropped = scrape(api)["swarm_api_connections_dropped"]
    assert dropped[(("reason", "evicted"),)] > 0 and dropped[(("reason", "timed_out"),)] > 0


def test_slow_body_flood_does_not_starve_a_real_request(api, oai, model_id):
    """Connections that send complete headers, then hold back their body, are evicted too."""
    host, port = api.split("//")[1].split("/")[0].split(":")

    def slow_bodies(n: int) -> None:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            socks.append(s)

    socks: list[socket.socket] = []
    try:
        slow_bodies(200)  # the cap is 128
        time.sleep(0.5)
        evicted = _evicted(api)
        # A fresh cap's worth right before the request, so that none of them has reached its body deadline
        # (2 s) however slow this machine is: the request gets in only by evicting one. A connection that
        # cannot evict gets 503, an error here.
        slow_bodies(128)
        answer = oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0)
        after = _evicted(api)
    finally:
        for s in socks:
            s.close()
    assert "Paris" in answer.choices[0].text and after >= evicted + 1


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes `s` (end of stream, or a reset) within `within` seconds of now."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if s.recv(4096) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (socket.timeout, TimeoutError):
            return False
    return False


def _evicted(api: str) -> float:
    """Connections the gateway evicted so far (the scrape's own connection included when it evicted one)."""
    return scrape(api)["swarm_api_connections_dropped"][(("reason", "evicted"),)]


# ---- metrics ----

def scrape(api: str) -> dict[str, dict[tuple, float]]:
    text = urllib.request.urlopen(api.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total") if family.type == "counter" else sample.name
            out.setdefault(name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_count_requests_tokens_and_latency(api, oai, model_id):
    before = scrape(api)
    oai.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    after = scrape(api)
    key = (("endpoint", "/v1/completions"), ("status", "200"))
    assert after["swarm_api_requests"][key] == before["swarm_api_requests"].get(key, 0) + 1
    completion, model = (("kind", "completion"), ("model", model_id)), (("model", model_id),)
    assert after["swarm_api_tokens"][completion] - before["swarm_api_tokens"].get(completion, 0) == 8
    assert after["swarm_api_time_to_first_token_seconds_count"][model] >= 1
    assert after["swarm_api_request_seconds_count"][(("endpoint", "/v1/completions"), ("model", model_id))] >= 1
    assert after["swarm_api_token_seconds_count"][model] >= 7
