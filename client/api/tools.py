"""Tools (function calling) for the chat endpoint: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked into `Tools`, the history's tool calls and results put into the shape chat
templates read, and the model's tool calls found in its output.

Rendering: the model's own chat template gets the tools (`apply_chat_template(tools=...)`); a template that
never reads `tools` cannot show them to the model, so such a model is refused (400 `no_tool_support`).
In the history, an assistant message's `tool_calls` keep OpenAI's shape with `arguments` parsed into an
object (templates print them as JSON), and `tool` messages keep `tool_call_id` and `name`.

Finding calls in the output (`ToolCalls`): the format most open chat templates teach (Qwen2.5, Hermes and
their kin), `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and a bare JSON object (or
list of them) naming a declared tool with `arguments` or `parameters`, as Llama 3's templates ask.
Text before the first block is the message's content; a call that does not parse, or names no declared
tool, stays text. Streamed, text that may still turn out to be a call is held back (the start of a
`<tool_call>` tag; a reply that opens with `{` or `[`) and the calls go out whole, each as one
`tool_calls` delta, when the choice ends.

`tool_choice` `none` renders without tools (the model cannot call any); `auto` lets the model choose;
`required` and a named function constrain decoding to a call (a JSON object of the tool's name and
arguments, by the response-format grammar), so the reply is always a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from client.api.errors import ApiError, invalid

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class Tools:
    tools: tuple[dict, ...]  # each {"type": "function", "function": {"name", "description"?, "parameters"?}}
    choice: str  # "auto", "none", "required", or a function's name
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call that `tool_choice` allows (for `required` or a named function)."""
        allowed = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        options = [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
        return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None when it declares none (or `tool_choice` is `none`)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "'tool_choice' names a tool, but the request declares no 'tools'")
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise invalid("tools", "'tools' must be a list of at most 128 tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise invalid(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                          "'_', '.' or '-'")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema "
                          "object")
        tools.append({"type": "function", "function": {k: v for k, v in fn.items()
                                                       if k in ("name", "description", "parameters", "strict")}})
    names = {t["function"]["name"] for t in tools}
    if len(names) < len(tools):
        raise invalid("tools", "two tools have the same name")
    if choice is None or choice in ("auto", "none", "required"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        choice = choice["function"]["name"]
        if choice not in names:
            raise invalid("tool_choice", f"'tool_choice' names '{choice}', which is not among the 'tools'")
    else:
        raise invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if choice == "none":
        return None
    return Tools(tuple(tools), choice, parallel)


def history_tool_calls(message: dict, where: str) -> list[dict] | None:
    """An assistant message's `tool_calls`, checked, with arguments as objects (what templates print)."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}.tool_calls[{j}]", f"'{where}.tool_calls[{j}]' must hold a function with a name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # shown to the model as the string it was
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def check_template(tokenizer, model_id: str) -> None:
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "tools" not in template:
        raise ApiError(400, f"the chat template of '{model_id}' has no tool support: it never shows tools to the "
                       "model", param="tools", code="no_tool_support")


# ---- calls in the output ----

def _as_calls(value: Any, names: set[str]) -> list[dict] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"name": item["name"], "arguments": arguments})
    return calls or None


def find_calls(text: str, names: set[str]) -> tuple[str, list[dict]]:
    """The content and the calls of a whole reply (see the module docstring)."""
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            calls = _as_calls(json.loads(stripped), names)
        except ValueError:
            calls = None
        if calls:
            return "", calls
    start = text.find(TAG_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(re.escape(TAG_OPEN) + r"(.*?)(?:" + re.escape(TAG_CLOSE) + r"|$)", text[start:], re.S):
        try:
            found = _as_calls(json.loads(block.strip()), names)
        except ValueError:
            found = None
        if not found:
            return text, []  # a malformed call: the reply stays text, nothing is run
        calls += found
    return text[:start].rstrip(), calls


def openai_calls(calls: list[dict], parallel: bool) -> list[dict]:
    """Calls in OpenAI's shape (`arguments` a JSON string), each with a fresh id; one unless `parallel`."""
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in (calls if parallel else calls[:1])]


class ToolStream:
    """One streamed choice's text, with possible calls held back: `feed` gives the text that can go out now;
    `finish` the rest of the text and the calls."""

    def __init__(self, names: set[str]):
        self.names = names
        self.text = ""  # everything so far
        self.sent = 0  # characters given out

    def feed(self, delta: str) -> str:
        self.text += delta
        body = self.text.lstrip()
        if body[:1] in ("{", "[") or (not body and self.text):
            return ""  # the whole reply may be a call (or nothing is known yet)
        cut = self.text.find(TAG_OPEN)
        if cut < 0:  # hold back what may be the start of a tag
            cut = next((len(self.text) - k for k in range(min(len(TAG_OPEN) - 1, len(self.text)), 0, -1)
                        if self.text.endswith(TAG_OPEN[:k])), len(self.text))
        out = self.text[self.sent:max(cut, self.sent)]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = find_calls(self.text, self.names)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return rest, []


def output_grammar(structure: tuple[str, Any] | None, tools: Tools | None, tokenizer, vocab_size: int,
                   end_tokens: list[int]):
    """The compiled grammar a reply must follow (`client.grammar`): a response format, one of vLLM's guided
    fields, or a forced tool call (a JSON object of the tool's name and arguments); None if nothing shapes
    the reply. A format that cannot be enforced is a 400 naming its field."""
    from client import grammar

    param = None
    if tools is not None and tools.forced:
        if structure is not None:
            raise invalid("tool_choice", f"a forced tool call and '{structure[0]}' cannot both shape the output")
        structure = ("response_format", {"type": "json_schema", "json_schema": {
            "name": "tool_call", "schema": tools.call_schema(), "strict": False}})
        param = "tools"
    if structure is None:
        return None
    kind, value = structure
    try:
        if kind == "response_format":
            return grammar.compile_format(tokenizer, vocab_size, value, end_tokens)
        return grammar.compile_guided(tokenizer, vocab_size, kind.removeprefix("guided_"), value, end_tokens)
    except grammar.FormatError as e:
        raise ApiError(400, str(e), param=param or e.param, code="invalid_value") from None
