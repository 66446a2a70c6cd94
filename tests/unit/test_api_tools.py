"""Tools for the chat endpoint without a swarm: the request's tools checked, the history's calls shaped for
templates, calls found in whole replies and in streams, and the response bodies OpenAI clients read."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from client.api.errors import ApiError
from client.api.requests import parse_messages
from client.api.responses import ResponseBodies
from client.api.tools import ToolStream, Tools, find_calls, parse_tools
from client.generation import Delta

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}


def test_tool_choice_forms():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert (auto.choice, auto.parallel, auto.forced, auto.names) == ("auto", True, False, NAMES)
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None  # rendered without tools
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).forced
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": False})
    assert (named.choice, named.parallel) == ("get_time", False)
    assert named.call_schema()["properties"]["name"] == {"const": "get_time"}
    assert len(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).call_schema()["anyOf"]) == 2


@pytest.mark.parametrize("body, param", [
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "web"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param


def test_history_calls_get_object_arguments_and_tool_results_keep_their_ids():
    messages = parse_messages({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


@pytest.mark.parametrize("text, content, calls", [
    ("Hello", "Hello", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [{"name": "get_weather", "arguments": {"city": "Paris"}}]),
    ('Let me check.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "Let me check.",
     [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "",  # Llama 3's bare JSON
     [{"name": "get_weather", "arguments": {"city": "Rome"}}]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', "",  # cut by max_tokens before the tag
     [{"name": "get_weather", "arguments": {"city": "Rome"}}]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}'
     '</tool_call>', []),  # an undeclared tool stays text
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', '<tool_call>{"name": "get_weather", '
     '"arguments": {"city": </tool_call>', []),  # malformed: text
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call
])
def test_calls_found_in_whole_replies(text, content, calls):
    assert find_calls(text, NAMES) == (content, calls)


def stream(pieces: list[str]) -> tuple[str, list[dict]]:
    s = ToolStream(NAMES)
    out = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return out + rest, calls


def test_a_stream_holds_back_what_may_be_a_call():
    s = ToolStream(NAMES)
    assert s.feed("Sure") == "Sure"
    assert s.feed(", <tool") == ", "  # the start of a tag waits
    assert s.feed("_call>{\"name\": \"get_time\", ") == ""
    assert s.feed("\"arguments\": {}}</tool_call>") == ""
    assert s.finish() == ("", [{"name": "get_time", "arguments": {}}])
    assert stream(["Plain ", "<to", "y> text"]) == ("Plain <toy> text", [])
    assert stream(["{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}"])[1][0]["name"] == "get_weather"
    assert stream(["{not json"]) == ("{not json", [])


def choice(text: str, finish: str = "stop") -> SimpleNamespace:
    return SimpleNamespace(index=0, text=text, finish_reason=finish, logprobs=[])


def test_response_bodies_carry_tool_calls_whole_and_streamed():
    tools = Tools((WEATHER, TIME), "auto", parallel=False)
    gen = SimpleNamespace(choices=[choice('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                          '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')],
                          prompt_tokens=5, completion_tokens=9, unchecked=[], cached=0)
    whole = ResponseBodies("chat.completion", "m", 1, tools=tools).whole([gen])
    c = whole["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]  # parallel_tool_calls false: the first call only
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    out = ResponseBodies("chat.completion", "m", 1, tools=tools)
    chunks = out.chunks(0, [Delta(0, "<tool_call>{\"name\": \"get_time\", ")]) + \
        out.chunks(0, [Delta(0, "\"arguments\": {}}</tool_call>", "stop")])
    deltas = [ch["choices"][0] for ch in chunks]
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert deltas[-1]["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert deltas[-1]["delta"]["tool_calls"][0]["index"] == 0
    plain = ResponseBodies("chat.completion", "m", 1, tools=tools).whole([SimpleNamespace(
        choices=[choice("It is sunny.")], prompt_tokens=1, completion_tokens=1, unchecked=[], cached=0)])
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["choices"][0]["finish_reason"] == "stop"
