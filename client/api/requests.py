"""The API's requests: OpenAI's request fields checked and parsed once into typed values (messages,
sampling), and `ApiError`, the OpenAI error object every refusal becomes. Pure: no network."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from client.api.errors import ApiError, invalid  # noqa: F401 - the parsers' errors, imported from here too
from client.api.tools import Tools, history_tool_calls, parse_tools
from client.config import ApiConfig
from client.sampling import Sampling

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
CHARS_PER_TOKEN = 16  # a prompt longer than context x this many characters cannot fit: refused untokenized
ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- request parsing: every field checked, in OpenAI's terms ----

def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # the range first: it compares a huge JSON integer exactly (math.isfinite would overflow) and refuses NaN
    if type(value) not in (int, float) or not lo <= value <= hi or not math.isfinite(value):
        raise invalid(name, f"'{name}' must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int, what: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise invalid(name, f"'{name}' must be an integer in [{lo}, {hi}]{what}, got {value!r}")
    return value


def checked_text(text: str, param: str) -> str:
    """`text`, if it can be encoded (JSON allows lone surrogate escapes, tokenizers do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(param, f"'{param}' is not valid Unicode (it holds a lone surrogate)") from None
    return text


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise invalid("stop", f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings, each of 1 to "
                      f"{MAX_STOP_CHARS} characters")
    return tuple(checked_text(s, "stop") for s in stops)


def _unsupported(body: dict, names: dict[str, Callable[[Any], bool]]) -> None:
    for name, harmless in names.items():
        if name in body and not harmless(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return checked_text(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(where, f"'{where}' may hold only text parts ({{\"type\": \"text\", \"text\": ...}})")
            parts.append(part["text"])
        return checked_text("".join(parts), where)
    raise invalid(where, f"'{where}' must be a string or a list of text parts")


def parse_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object with a role in {ROLES}")
        content = m.get("content")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": "" if content is None else _text_content(content, f"messages[{i}].content")}
        if role == "assistant" and (calls := history_tool_calls(m, f"messages[{i}]")) is not None:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        out.append(message)
    return out


@dataclass(frozen=True)
class Common:
    """What every generation request shares. `max_tokens` None: not given (the endpoint's default applies)."""

    sampling: Sampling  # max_tokens not settled yet (0)
    max_tokens: int | None
    max_tokens_param: str
    stream: bool
    include_usage: bool
    structure: tuple[str, Any] | None = None  # ("response_format", value) or ("guided_regex", value), ...

    def settled(self, max_tokens: int, **fields) -> Sampling:
        return dataclasses.replace(self.sampling, max_tokens=max_tokens, **fields)


def parse_common(body: dict, config: ApiConfig, min_tokens: int = 1) -> Common:
    """Sampling parameters, whether to stream, whether to add usage to the stream."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise invalid("stream", "'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    if options and not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", "'stream_options.include_usage' must be a boolean")
    include_usage = bool(stream and options and options.get("include_usage"))
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, param, min_tokens, config.max_tokens, " (this server's limit)")
    seed = _integer(body, "seed", -2**63, 2**63 - 1)
    top_k = _integer(body, "top_k", -1, 1 << 30)
    sampling = Sampling(
        max_tokens=0,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        n=_integer(body, "n", 1, config.max_n, " (this server's limit)") or 1,
        stop=_stops(body),
        seed=None if seed is None else seed % 2**63,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        top_k=max(top_k or 0, 0),  # -1 and 0: off, as vLLM reads them
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
    )
    _unsupported(body, {"best_of": lambda v: v in (None, 1), "suffix": lambda v: not v,
                        "logit_bias": lambda v: not v, "functions": lambda v: not v})
    return Common(sampling, max_tokens, param, bool(stream), include_usage, _structure(body))


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's names


def _structure(body: dict) -> tuple[str, Any] | None:
    """What the output must follow: a `response_format` other than text, or one of vLLM's `guided_*` fields
    (checked in full when compiled: `client.grammar`)."""
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str)):
        raise invalid("response_format", "'response_format' must be an object with a 'type'")
    wanted = [(k, body[k]) for k in GUIDED if body.get(k) is not None]
    if fmt is not None and fmt.get("type") != "text":
        wanted.insert(0, ("response_format", fmt))
    if len(wanted) > 1:
        raise invalid(wanted[1][0], f"'{wanted[0][0]}' and '{wanted[1][0]}' cannot both shape the output: send one")
    return wanted[0] if wanted else None


@dataclass(frozen=True)
class CompletionRequest:
    """`/v1/completions`: one or more prompts, each a string or token ids."""

    prompts: tuple[str | tuple[int, ...], ...]
    common: Common
    echo: bool
    logprobs: int | None


@dataclass(frozen=True)
class ChatRequest:
    """`/v1/chat/completions`."""

    messages: list[dict[str, Any]]
    common: Common
    logprobs: int | None  # None: not asked; k: each token's and the k most likely (`top_logprobs`)
    tools: Tools | None


def texts_or_ids(raw: Any, param: str, limit: int, vocab_size: int, *, empty_text: bool = True
                 ) -> tuple[str | tuple[int, ...], ...]:
    """A field that holds a string, a list of token ids, or a list of these (prompts, embedding inputs):
    its items, each checked (`param[i]` names a bad one). `empty_text`: whether "" is an item."""
    shape = f"'{param}' must be a string, a list of token ids, or a non-empty list of these"
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        items = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        items = raw
    else:
        raise invalid(param, shape)
    if len(items) > limit:
        raise invalid(param, f"at most {limit} items in '{param}' (this server's limit), got {len(items)}")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{i}]"
        if isinstance(item, str) and (item or empty_text):
            out.append(checked_text(item, where))
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            if not all(0 <= t < vocab_size for t in item):
                raise invalid(where, f"the {where}'s token ids must lie in [0, {vocab_size}) (ids of another "
                              "tokenizer? send text instead)")
            out.append(tuple(item))
        else:
            raise invalid(where, f"the {where} is empty" if not item else shape)
    return tuple(out)


def parse_completion(body: dict, config: ApiConfig, vocab_size: int) -> CompletionRequest:
    echo = body.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise invalid("echo", "'echo' must be a boolean")
    logprobs = _integer(body, "logprobs", 0, config.max_logprobs, " (this server's limit)")  # a count here
    common = parse_common(body, config, min_tokens=0 if echo else 1)  # echo with max_tokens 0 scores the prompt
    _unsupported(body, {"tools": lambda v: not v, "tool_choice": lambda v: v in (None, "none")})  # chat only
    return CompletionRequest(texts_or_ids(body.get("prompt"), "prompt", config.max_prompts, vocab_size), common,
                             bool(echo), logprobs)


def parse_chat(body: dict, config: ApiConfig) -> ChatRequest:
    common = parse_common(body, config)
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool) and wanted is not None:
        raise invalid("logprobs", "'logprobs' must be a boolean on /v1/chat/completions (top_logprobs: how many)")
    top = _integer(body, "top_logprobs", 0, config.max_logprobs, " (this server's limit)")
    if top and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return ChatRequest(parse_messages(body), common, (top or 0) if wanted else None, parse_tools(body))


