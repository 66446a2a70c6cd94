"""Structured output: JSON, a JSON schema, a regular expression, a choice or a grammar, enforced while
decoding by masking the logits of every token that cannot continue a valid output.

`compile_format` turns an OpenAI `response_format` into a `Grammar` (`compile_guided` does the same
for vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` fields); a `Constraint`
applies it to one request's rows (its `n` choices), step by step:

    grammar = compile_format(tokenizer, head.vocab_size, body["response_format"], end_tokens)
    constraint = Constraint(grammar, rows=n)
    logits = constraint.mask(logits)       # [rows, vocab]: what the grammar forbids is -inf
    constraint.advance(tokens)             # the tokens chosen, one per row
    saved = constraint.state(); ...; constraint.restore(saved)   # rewind to an earlier step

The engine is llguidance (Earley parsing over lazily built lexer automata, in Rust), chosen against
xgrammar and outlines-core by measuring them here: the demo tokenizer (SmolLM2, 49,152 tokens), one
thread of this x86-64 CPU, torch 2.13.0 CPU, `benchmarks/grammar.py` (its table is in
docs/benchmarks.md). Compile: first time (again); per token: one row's mask and advance, median of 200
tokens (the library's own mask alone):

| library | pip install into a venv with torch | compile json_object / test schema, ms | per token, ms |
|---|---|---|---|
| llguidance 1.9.1 | 2.5 s, +7 MB, no dependencies | 8 (1) / 3 (3) | 0.20 (0.04-0.07) |
| xgrammar 0.2.9 | 35 s, +1,030 MB: it requires triton on x86-64 Linux | 33 (26) / 31 (33) | 0.17-0.21 (0.04) |
| outlines-core 0.2.14 | 2.4 s, +6 MB | 10,100 / 1,800, compact JSON only | 0.16-0.27 (0.01-0.09) |

All three gave only valid JSON. llguidance compiles a schema in milliseconds (outlines-core builds a
whole automaton first: seconds per schema, and `json_object` only as a depth-bounded regular
expression), installs without a gigabyte of GPU compiler (xgrammar), and brings regular expressions,
Lark grammars and unlimited rollback. Per token all three cost about the same, 0.2 ms of a decode step
of 70-100 ms: the demo model decoding here with a json_schema enforced kept 1.01x the tokens/s of
decoding without (0.5 ms of an 81 ms step). Converting the tokenizer takes 0.4-1.2 s, once.

Decisions:
- **End tokens.** The caller names the model's end tokens (`end_tokens`). While the output is
  incomplete they are forbidden; once it is complete they are allowed, and once nothing may follow
  (the last `}` of a JSON object) they are the only tokens allowed. An end token finishes its row;
  it is never fed to the grammar, so rewinding over it is only a flag.
- **Whitespace.** JSON may have at most 20 whitespace characters in a row (enough to pretty-print a
  few levels deep), so a model cannot loop on blank lines forever; nothing before the first `{` or
  after the last `}`.
- **`strict`.** A `json_schema` is enforced whether `strict` is true or false. With `strict: true` a
  schema that uses a keyword the engine cannot enforce (`uniqueItems`, `contains`, an unknown
  `format`, ...) is refused with the keyword named; with `strict: false` such keywords are ignored (the
  output then follows the rest of the schema). Properties come in the schema's order.
- **What is JSON.** `json_object` is any JSON object; a `json_schema` may have any root type. Only
  `schema` and `strict` of OpenAI's `json_schema` change the output (`name` is checked, as OpenAI does).
- **Rows are independent.** A finished row's logits are left as they are. State is a token count per
  row: `restore` rolls the grammar back by the difference (llguidance keeps the whole history).
- **-inf.** `mask` returns float32 logits holding -inf: apply it after any check for non-finite logits
  (the sampler's) and before temperature and top-p, so that sampling only ever sees allowed tokens.

Thread safety: a `Grammar` may be shared by threads and requests (new matchers are copied from it under a
lock); a `Constraint` belongs to one request and must not be used by two threads at once. The masks
are computed with the GIL released. The first grammar for a tokenizer converts its vocabulary (0.4-1.2 s,
cached per tokenizer, vocabulary size and end tokens): call `grammar_tokenizer` at startup to pay it
before the first request.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

MAX_WHITESPACE = 20  # JSON whitespace characters in a row
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}
MAX_MESSAGE = 500  # characters of an engine's error message passed on to the user
GUIDED_KINDS = ("json", "regex", "choice", "grammar")
SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
LOG_LEVEL = 0  # the engine's own warnings on stderr: none (errors come back as messages)


class FormatError(ValueError):
    """A response format or guided-decoding field that cannot be enforced; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GrammarError(RuntimeError):
    """The grammar engine failed during a generation (a token it did not allow, or an internal limit)."""


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {key: LLTokenizer}
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int, end_tokens: list[int]) -> llguidance.LLTokenizer:
    """The engine's view of a Hugging Face fast tokenizer (built once per tokenizer, vocabulary size and
    end tokens; about 0.5-1 s)."""
    if not end_tokens:
        raise ValueError("a grammar needs the model's end tokens")
    width = max(vocab_size, len(tokenizer))  # logits may be wider than the vocabulary, never narrower
    key = (width, tuple(end_tokens))
    with _tokenizers_lock:  # held while building: a second thread waits rather than builds it again
        built = _tokenizers.setdefault(tokenizer, {})
        if key not in built:
            if getattr(tokenizer, "backend_tokenizer", None) is None:
                raise FormatError("response_format", f"structured output needs a fast tokenizer; this model's "
                                  f"is a {type(tokenizer).__name__}")
            built[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=list(end_tokens))
        return built[key]


def _message(text: str) -> str:
    """An engine's error message on one line, capped."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE - 3] + "..."


class Grammar:
    """A validated grammar for one tokenizer; reusable by any number of requests (`Constraint`)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, text: str, vocab_size: int, end_tokens: list[int],
                 param: str):
        self.vocab_size, self.end_tokens = vocab_size, frozenset(end_tokens)
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            raise FormatError(param, f"{param}: {_message(error)}")
        self._matcher = llguidance.LLMatcher(tokenizer, text, log_level=LOG_LEVEL)
        if self._matcher.is_error():
            raise FormatError(param, f"{param}: {_message(self._matcher.get_error())}")
        self._lock = threading.Lock()

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the grammar (a copy: microseconds)."""
        with self._lock:
            return self._matcher.deep_copy()


def _schema_grammar(schema: Any, param: str, lenient: bool = False) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise FormatError(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise FormatError(param, f"{param} must be a JSON schema object")
    # the engine's own options inside a schema are not part of our API: ours apply
    schema = {k: v for k, v in schema.items() if k != "x-guidance"}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": lenient})
    except (ValueError, TypeError) as e:
        raise FormatError(param, f"{param}: {_message(str(e))}") from None


def compile_format(tokenizer, vocab_size: int, response_format: Any, end_tokens: list[int]) -> Grammar | None:
    """An OpenAI `response_format` as a grammar: `{"type": "json_object"}` (any JSON object),
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, or `{"type": "text"}`
    (None: no constraint). `vocab_size` is the width of the model's logits. Raises `FormatError` (a
    ValueError whose message can go to the user as it is) for a format or schema that cannot be
    enforced."""
    param = "response_format"
    if not isinstance(response_format, dict):
        raise FormatError(param, "response_format must be an object with a 'type'")
    kind, strict = response_format.get("type"), False
    if kind == "text":
        return None
    if kind == "json_object":
        text = _schema_grammar({"type": "object"}, param)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise FormatError(f"{param}.json_schema", "response_format.json_schema must be an object with "
                                                      "'name' and 'schema'")
        name = spec.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
            raise FormatError(f"{param}.json_schema.name", "response_format.json_schema.name must be 1 to 64 "
                                                           "letters, digits, '_' or '-'")
        strict = spec.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise FormatError(f"{param}.json_schema.strict", "response_format.json_schema.strict must be a boolean")
        if "schema" not in spec:
            raise FormatError(f"{param}.json_schema.schema", "response_format.json_schema.schema is required")
        param = f"{param}.json_schema.schema"
        text = _schema_grammar(spec["schema"], param, lenient=not strict)
    else:
        raise FormatError(f"{param}.type", f"response_format.type must be 'text', 'json_object' or "
                                           f"'json_schema', not {kind!r}")
    try:
        return Grammar(grammar_tokenizer(tokenizer, vocab_size, end_tokens), text, vocab_size, end_tokens, param)
    except FormatError as e:
        if strict and _lenient_works(tokenizer, vocab_size, response_format["json_schema"]["schema"], end_tokens,
                                     param):
            raise FormatError(param, f"{e} (with strict false, keywords that cannot be enforced are "
                                     f"ignored)") from None
        raise


def _lenient_works(tokenizer, vocab_size: int, schema: Any, end_tokens: list[int], param: str) -> bool:
    try:
        Grammar(grammar_tokenizer(tokenizer, vocab_size, end_tokens), _schema_grammar(schema, param, lenient=True),
                vocab_size, end_tokens, param)
        return True
    except FormatError:
        return False


def compile_guided(tokenizer, vocab_size: int, kind: str, value: Any, end_tokens: list[int]) -> Grammar:
    """vLLM's guided decoding fields: `kind` 'json' (a schema, as an object or a JSON string), 'regex'
    (a regular expression the whole output matches), 'choice' (a list of strings: the output is one of
    them) or 'grammar' (llguidance's Lark dialect, or llama.cpp's GBNF: `root ::= ...`)."""
    param = f"guided_{kind}"
    if kind == "json":
        text = _schema_grammar(value, param)
    elif kind == "regex":
        if not isinstance(value, str):
            raise FormatError(param, "guided_regex must be a string")
        text = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise FormatError(param, "guided_choice must be a list of non-empty strings")
        text = "start: " + " | ".join(json.dumps(v) for v in value)
    elif kind == "grammar":
        if not isinstance(value, str):
            raise FormatError(param, "guided_grammar must be a string")
        try:
            value = any_to_lark(value)  # GBNF (llama.cpp's, xgrammar's) becomes Lark; Lark stays as it is
        except Exception as e:  # a converter of user input: whatever it raises is about that input
            raise FormatError(param, f"guided_grammar: {_message(str(e))}") from None
        text = llguidance.LLMatcher.grammar_from_lark(value)
    else:
        raise ValueError(f"unknown guided decoding kind {kind!r}; known: {', '.join(GUIDED_KINDS)}")
    return Grammar(grammar_tokenizer(tokenizer, vocab_size, end_tokens), text, vocab_size, end_tokens, param)


class Constraint:
    """One request's grammar state: `rows` outputs (its choices), each with its own matcher."""

    def __init__(self, grammar: Grammar, rows: int):
        self.grammar = grammar
        self.matchers = [grammar.matcher() for _ in range(rows)]
        self.consumed = [0] * rows  # tokens each row's matcher has taken (end tokens excluded)
        self.ended = [False] * rows

    def finished(self, row: int) -> bool:
        """Whether the row took an end token (its output is complete)."""
        return self.ended[row]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [rows, width] as float32 with every token the grammar forbids set to -inf; finished rows
        as they are. (numpy, one thread: torch's parallel kernels cost more than they save at this size.)"""
        rows, width = logits.shape
        if rows != len(self.matchers):
            raise ValueError(f"logits have {rows} rows, the constraint {len(self.matchers)}")
        out = logits.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
        for row, matcher in enumerate(self.matchers):
            if self.ended[row]:
                continue
            bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)  # 0: forbidden, else allowed
            if matcher.is_error():
                raise GrammarError(f"the grammar engine failed: {_message(matcher.get_error())}")
            known = min(width, len(bias))
            if not bias[:known].any():
                raise GrammarError(f"the grammar allows no token after {self.consumed[row]} tokens")
            np.putmask(out[row, :known], bias[:known] == 0, -np.inf)
            out[row, known:] = -np.inf  # logits wider than the grammar's vocabulary: padding
        return torch.from_numpy(out).to(logits.device)

    def advance(self, tokens: list[int]) -> None:
        """Take one chosen token per row (ignored for finished rows). A token the mask forbade raises
        `GrammarError`."""
        if len(tokens) != len(self.matchers):
            raise ValueError(f"{len(tokens)} tokens for {len(self.matchers)} rows")
        for row, (matcher, token) in enumerate(zip(self.matchers, tokens)):
            if self.ended[row]:
                continue
            if token in self.grammar.end_tokens:
                if not matcher.is_accepting():
                    raise GrammarError(f"row {row}: an end token before the output is complete")
                self.ended[row] = True
            elif matcher.consume_token(token):
                self.consumed[row] += 1
            else:
                raise GrammarError(f"row {row}: token {token} breaks the grammar: "
                                   f"{_message(matcher.get_error())}")

    def state(self) -> tuple:
        """A snapshot to `restore` later (two small tuples)."""
        return tuple(self.consumed), tuple(self.ended)

    def restore(self, state: tuple) -> None:
        """Go back to a snapshot taken earlier on this path (not to one after it)."""
        consumed, ended = state
        for row, (matcher, now, then) in enumerate(zip(self.matchers, self.consumed, consumed)):
            if then > now:
                raise ValueError(f"row {row}: cannot restore a later state ({then} tokens, now {now})")
            if then < now and not matcher.rollback(now - then):
                raise GrammarError(f"row {row}: rollback failed: {_message(matcher.get_error())}")
        self.consumed, self.ended = list(consumed), list(ended)


class ConstraintProcessor:
    """A `Constraint` as a transformers logits processor, for `generate()` without beams:
    `LogitsProcessorList([ConstraintProcessor(constraint, prompt_length=ids.shape[1])])`. The end tokens
    given to the grammar must be the generation's `eos_token_id`s."""

    def __init__(self, constraint: Constraint, prompt_length: int):
        self.constraint, self.prompt_length, self.made = constraint, prompt_length, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        made = input_ids.shape[1] - self.prompt_length
        if made > self.made:  # one call per step: the newest column holds the tokens chosen last
            self.constraint.advance(input_ids[:, -1].tolist())
            self.made = made
        return self.constraint.mask(scores)
