"""Structured output and tools through `swarm api` on the real demo swarm, with the `openai` package:
`response_format` (json_object, json_schema), vLLM's guided fields, and forced tool calls (the demo model's
weights with a tool-capable chat template). Every output must parse and validate, whatever the model
would have said: the grammar decides what it can say."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest

from swarm.weights.models import local_model_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "none"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
# A Hermes-style template (the shape Qwen2.5's teaches): tools in the system turn, calls in <tool_call> tags
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def model_id(demo_model_dir):
    return local_model_id(demo_model_dir)


@pytest.fixture(scope="module")
def tool_model_dir(demo_model_dir, tmp_path_factory):
    """The demo model's files with a chat template that shows tools to the model."""
    folder = tmp_path_factory.mktemp("tool-model")
    for f in demo_model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def api(demo_swarm, tool_model_dir, model_id):
    proc = demo_swarm.start_api("api-structured", tool_model_dir, "--model-id", model_id, "--context-length", "512",
                                "--max-tokens", "96")
    yield proc.extra["url"]
    demo_swarm.stop("api-structured")


@pytest.fixture(scope="module")
def plain_api(demo_swarm, demo_model_dir):
    """The demo model as it is: its template has no tools."""
    proc = demo_swarm.start_api("api-plain", demo_model_dir, "--context-length", "256")
    yield proc.extra["url"]
    demo_swarm.stop("api-plain")


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=180)


def test_json_schema_output_always_validates(oai, model_id):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outputs = []
    for seed, who in enumerate(["a pirate", "my aunt", "a robot", "a chef", "a child"]):  # 5 requests x 4 = 20
        reply = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": f"Describe {who}."}],
                                            response_format=fmt, n=4, temperature=1.0, seed=seed, max_tokens=96)
        outputs += [(c.message.content, c.finish_reason) for c in reply.choices]
    assert len(outputs) == 20
    for text, finish in outputs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in outputs}) > 1  # sampled: the grammar leaves the model its choices


def test_json_object_streamed(oai, model_id):
    chunks = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Give me JSON."}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=96,
                                         stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_guided_fields_on_completions(oai, model_id):
    choice = oai.completions.create(model=model_id, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no", "maybe"]}).choices[0].text
    assert choice in ("yes", "no", "maybe")
    date = oai.completions.create(model=model_id, prompt="A date:", max_tokens=16, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}).choices[0].text
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", date)


def test_a_forced_tool_call_parses_and_validates_streamed_or_not(oai, model_id):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = oai.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=64)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(oai.chat.completions.create(model=model_id, messages=messages, tools=[WEATHER], temperature=0,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              max_tokens=64, stream=True))
    calls = [t for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls for t in ch.choices[0].delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back into the history; the model answers in text (no tool forced now)
    follow = oai.chat.completions.create(model=model_id, temperature=0, max_tokens=8, tools=[WEATHER], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_refusals_are_typed(oai, model_id, plain_api):
    plain = openai.OpenAI(base_url=plain_api, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        plain.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert e.value.body["code"] == "no_tool_support"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                           "maximum": 1}}})
    assert e.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                    tool_choice="required", response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
