"""The gateway's request parsing: what OpenAI's API accepts is accepted, everything else is a 400 naming the
parameter, never a 500."""

from __future__ import annotations

import dataclasses
import json

import pytest

from client.api.requests import MAX_STOP_STRINGS, ApiError, parse_chat, parse_common, parse_completion, parse_messages
from client.config import ApiConfig
from client.sampling import Sampling

pytestmark = pytest.mark.unit

CONFIG = ApiConfig()


def common(**body) -> tuple[Sampling, bool, bool]:
    return common_raw(body)


def common_raw(body: dict) -> tuple[Sampling, bool, bool]:
    c = parse_common(body, CONFIG)
    return dataclasses.replace(c.sampling, max_tokens=c.max_tokens or 0), c.stream, c.include_usage


def test_defaults():
    sampling, stream, usage = common()
    assert sampling == Sampling(max_tokens=0, temperature=1.0, top_p=1.0, n=1, stop=(), seed=None)
    assert (stream, usage) == (False, False)


def test_every_field_in_range_is_taken():
    sampling, stream, usage = common(max_tokens=7, temperature=0, top_p=0.5, n=CONFIG.max_n, stop=["a", "bc"],
                                     seed=42, presence_penalty=-2, frequency_penalty=2.0, stream=True,
                                     stream_options={"include_usage": True})
    assert sampling == Sampling(max_tokens=7, temperature=0.0, top_p=0.5, n=CONFIG.max_n, stop=("a", "bc"), seed=42,
                                presence_penalty=-2.0, frequency_penalty=2.0)
    assert (stream, usage) == (True, True)
    assert isinstance(sampling.temperature, float)


@pytest.mark.parametrize("stop, expected", [("x", ("x",)), (["x"], ("x",)), (["\n", "END"], ("\n", "END")),
                                            (["s"] * MAX_STOP_STRINGS, ("s",) * MAX_STOP_STRINGS), (None, ()),
                                            ([], ())])
def test_stop_as_string_or_list(stop, expected):
    assert common(stop=stop)[0].stop == expected


def test_max_completion_tokens_is_an_alias_that_wins():
    assert common(max_completion_tokens=9)[0].max_tokens == 9
    assert common(max_completion_tokens=9, max_tokens=3)[0].max_tokens == 9
    assert common(max_tokens=CONFIG.max_tokens)[0].max_tokens == CONFIG.max_tokens


def test_negative_and_large_seeds_fold_into_63_bits():
    assert common(seed=-1)[0].seed == 2**63 - 1
    assert common(seed=2**63 - 1)[0].seed == 2**63 - 1
    assert common(seed=-2**63)[0].seed == 0


def test_usage_in_the_stream_only_when_streaming():
    assert common(stream=False, stream_options={"include_usage": True})[1:] == (False, False)
    assert common(stream=True)[1:] == (True, False)
    assert common(stream=None)[1:] == (False, False)


@pytest.mark.parametrize("name, value", [("logprobs", False), ("logprobs", None), ("top_logprobs", 0),
                                         ("echo", False), ("best_of", 1), ("suffix", ""), ("logit_bias", {}),
                                         ("tools", []), ("tool_choice", "none"), ("functions", []),
                                         ("response_format", {"type": "text"}), ("user", "someone")])
def test_harmless_values_of_unsupported_features_are_accepted(name, value):
    common(**{name: value})


def expect_invalid(param: str, fn, *args, code: str | None = "invalid_value") -> ApiError:
    with pytest.raises(ApiError) as caught:
        fn(*args)
    err = caught.value
    assert err.status == 400
    assert err.param == param
    assert err.type == "invalid_request_error"
    if code is not None:
        assert err.code == code
    assert param.split("[")[0].split(".")[0] in err.message  # the message names what was wrong
    return err


@pytest.mark.parametrize("name, value", [
    ("temperature", True), ("temperature", False), ("temperature", "1"), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", -0.1), ("temperature", 2.01), ("temperature", [1]),
    pytest.param("temperature", 10**400, id="temperature-huge-int"),  # a JSON integer too large for a float
    ("top_p", 1.5), ("top_p", -0.0001), ("top_p", float("-inf")), ("top_p", True),
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -3),
    pytest.param("frequency_penalty", -10**400, id="frequency_penalty-huge-negative-int"),
    ("n", 0), ("n", CONFIG.max_n + 1), ("n", 1.0), ("n", True), ("n", "2"),
    ("seed", True), ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 1.5),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", CONFIG.max_tokens + 1), ("max_tokens", True),
    ("max_tokens", 5.0), ("max_tokens", "5"),
    ("max_completion_tokens", 0), ("max_completion_tokens", CONFIG.max_tokens + 1),
    ("stop", ""), ("stop", [""]), ("stop", ["a", ""]), ("stop", ["s"] * (MAX_STOP_STRINGS + 1)), ("stop", [1]),
    ("stop", {"a": 1}), ("stop", 5), ("stop", [None]), ("stop", "x" * 257), ("stop", ["\ud800"]),
    ("stream_options", {"include_usage": "no"}),
    ("stream", "yes"), ("stream", 1), ("stream_options", ["include_usage"]), ("stream_options", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("repetition_penalty", 11),
])
def test_bad_values_are_400_naming_the_parameter(name, value):
    expect_invalid(name, common_raw, {name: value})


def test_json_nan_infinity_and_huge_numbers_are_refused():
    # Python's json module accepts these non-standard literals, so the parser must refuse them itself
    for text in ('{"temperature": NaN}', '{"top_p": Infinity}', '{"presence_penalty": -Infinity}',
                 '{"temperature": 1e999}', '{"temperature": 1' + "0" * 400 + "}"):
        body = json.loads(text)
        expect_invalid(next(iter(body)), common_raw, body)


@pytest.mark.parametrize("name, value", [
    ("best_of", 2), ("suffix", "x"),
    ("logit_bias", {"5": 10}), ("functions", [{"name": "f"}]),
])
def test_unsupported_features_are_400_unsupported_parameter(name, value):
    expect_invalid(name, common_raw, {name: value}, code="unsupported_parameter")


@pytest.mark.parametrize("name, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "auto")])
def test_tools_are_for_chat_only(name, value):
    expect_invalid(name, lambda: parse_completion({"prompt": "x", name: value}, CONFIG, 100),
                   code="unsupported_parameter")


def test_what_shapes_the_output():
    structure = lambda **b: parse_common(b, CONFIG).structure  # noqa: E731
    assert structure() is None and structure(response_format={"type": "text"}) is None
    assert structure(response_format={"type": "json_object"}) == ("response_format", {"type": "json_object"})
    assert structure(guided_regex="a+") == ("guided_regex", "a+")
    expect_invalid("guided_regex", lambda: structure(response_format={"type": "json_object"}, guided_regex="a"))
    expect_invalid("guided_choice", lambda: structure(guided_json={}, guided_choice=["a"]))
    expect_invalid("response_format", lambda: structure(response_format="json"))


def test_vllm_sampling_extras():
    sampling = common(top_k=40, min_p=0.05, repetition_penalty=1.3)[0]
    assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty) == (40, 0.05, 1.3)
    assert common(top_k=-1)[0].top_k == 0  # vLLM's "off"
    assert common()[0] == common(top_k=0, min_p=0, repetition_penalty=1)[0]


# ---- completions: prompts, echo, logprobs ----

def completion(**body):
    return parse_completion(body, CONFIG, vocab_size=100)


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ("hi",)), ([1, 2], ((1, 2),)), (["a", "b"], ("a", "b")), ([[1], [2, 3]], ((1,), (2, 3))),
    (["a", [4]], ("a", (4,))), ([""], ("",)),  # an empty string is tokenized: it may hold a BOS token
])
def test_prompts_are_strings_token_lists_or_lists_of_these(prompt, prompts):
    assert completion(prompt=prompt).prompts == prompts


@pytest.mark.parametrize("prompt, param", [
    (None, "prompt"), ([], "prompt"), (5, "prompt"), ([[]], "prompt"), ([1, "a"], "prompt"), ([[100]], "prompt"),
    (["a", [1, -1]], "prompt[1]"), (["a", []], "prompt[1]"), (["a"] * (CONFIG.max_prompts + 1), "prompt"),
    (["ok", "\ud800"], "prompt[1]"), ([{"a": 1}], "prompt"),
])
def test_bad_prompts_are_400_naming_the_prompt(prompt, param):
    expect_invalid(param, lambda: completion(**({} if prompt is None else {"prompt": prompt})))


def test_completion_logprobs_and_echo():
    req = completion(prompt="x", logprobs=3, echo=True, max_tokens=0)
    assert (req.logprobs, req.echo, req.common.max_tokens) == (3, True, 0)
    assert completion(prompt="x", logprobs=0).logprobs == 0  # the chosen token's, as OpenAI gives it
    assert completion(prompt="x").logprobs is None
    expect_invalid("max_tokens", lambda: completion(prompt="x", max_tokens=0))  # 0 only scores an echoed prompt
    for bad in (-1, CONFIG.max_logprobs + 1, True, 1.0):
        expect_invalid("logprobs", lambda: completion(prompt="x", logprobs=bad))
    expect_invalid("echo", lambda: completion(prompt="x", echo="yes"))


def test_chat_logprobs_is_a_flag_and_top_logprobs_a_count():
    def chat(**b):
        return parse_chat({"messages": [{"role": "user", "content": "hi"}], **b}, CONFIG)

    assert chat().logprobs is None
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).logprobs is None
    expect_invalid("top_logprobs", lambda: chat(top_logprobs=2))  # needs logprobs: true, as OpenAI says
    expect_invalid("logprobs", lambda: chat(logprobs=3))
    expect_invalid("top_logprobs", lambda: chat(logprobs=True, top_logprobs=CONFIG.max_logprobs + 1))


# ---- messages ----

def test_messages_roles_and_text_parts():
    body = {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
        {"role": "user", "content": []},
    ]}
    assert parse_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ("hi", "messages"), ({"role": "user", "content": "hi"}, "messages"), ([], "messages"),
    (["hi"], "messages[0]"), ([{"content": "hi"}], "messages[0]"), ([{"role": "robot", "content": "x"}], "messages[0]"),
    ([{"role": ["user"], "content": "x"}], "messages[0]"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content"),
    ([{"role": "user", "content": ["plain"]}], "messages[0].content"),
    ([{"role": "user", "content": {"type": "text", "text": "a"}}], "messages[0].content"),
])
def test_bad_messages_are_400_naming_the_message(messages, param):
    body = {} if messages is None else {"messages": messages}
    expect_invalid(param, parse_messages, body)


# ---- the error object ----

def test_api_error_is_an_openai_error_object():
    err = ApiError(503, "busy", type="server_busy", code="server_busy", headers={"Retry-After": "1"})
    assert err.body() == {"error": {"message": "busy", "type": "server_busy", "param": None, "code": "server_busy"}}
    response = err.response()
    assert response.status == 503
    assert response.headers["Retry-After"] == "1"
    assert json.loads(response.body) == err.body()
    assert str(err) == "busy"
