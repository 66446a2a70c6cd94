"""Structured output (`client.grammar`) with the demo model's real tokenizer and random logits: every
constrained sample parses and follows its schema, end tokens come exactly when the output is complete,
and a rewind reproduces the same continuation."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

from client.grammar import Constraint, ConstraintProcessor, FormatError, compile_format, compile_guided

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # slow: the demo model's tokenizer (prepared once, cached)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "role", "address"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def ends(tokenizer):
    return sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors of one vocabulary row: torch's thread pool costs more than it saves (and far more on a
    loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tilt(tokenizer, ends):
    """Added to random logits: tokens that close a string, an array or an object, and end tokens, are
    likelier, so that random outputs end within a hundred tokens (untilted ones write strings of
    hundreds). Every token stays possible."""
    bias = torch.zeros(len(tokenizer))
    for token, i in tokenizer.get_vocab().items():
        if any(c in token for c in '"}]'):
            bias[i] = 1.5
    bias[ends] = 3.0
    return bias


def choose(constraint, rows: int, g: torch.Generator, tilt: torch.Tensor, width: int) -> list[int]:
    """One step: random logits (seeded), tilted, masked; the most likely token of each row."""
    logits = torch.randn(rows, width, generator=g)
    logits[:, :len(tilt)] += tilt
    return constraint.mask(logits).argmax(-1).tolist()


def sample(grammar, rows: int, seed: int, tilt: torch.Tensor, width: int | None = None):
    """Random constrained outputs: (token ids per row, the constraint)."""
    width = width or len(tilt)
    g = torch.Generator().manual_seed(seed)
    constraint = Constraint(grammar, rows)
    out = [[] for _ in range(rows)]
    for _ in range(MAX_TOKENS):
        tokens = choose(constraint, rows, g, tilt, width)
        for row, token in enumerate(tokens):
            if not constraint.finished(row):
                out[row].append(token)
        constraint.advance(tokens)
        if all(constraint.finished(r) for r in range(rows)):
            return out, constraint
    raise AssertionError(f"outputs still unfinished after {MAX_TOKENS} tokens: {out}")


def texts(tokenizer, outputs, ends):
    for ids in outputs:
        assert ids[-1] in ends and not set(ids[:-1]) & set(ends)
        yield tokenizer.decode(ids[:-1])


def check(value, schema, where="$"):
    """The subset of JSON schema validation the test schema uses."""
    if "enum" in schema:
        assert value in schema["enum"], where
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), where
        assert set(schema.get("required", ())) <= set(value), where
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema.get("properties", {})), where
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                check(value[key], sub, f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            check(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), where
    elif kind == "integer":
        assert type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value), where
    elif kind == "number":
        assert type(value) in (int, float), where
    elif kind == "boolean":
        assert type(value) is bool, where


def test_json_object_outputs_parse(tokenizer, ends, tilt):
    grammar = compile_format(tokenizer, len(tokenizer), {"type": "json_object"}, ends)
    found = []
    for seed in range(5):
        outputs, _ = sample(grammar, 4, seed, tilt)
        found += [json.loads(text) for text in texts(tokenizer, outputs, ends)]
    assert len(found) == 20 and all(isinstance(v, dict) for v in found)
    assert any(v for v in found), "only empty objects: the test would prove little"


def test_json_schema_outputs_follow_the_schema(tokenizer, ends, tilt):
    grammar = compile_format(tokenizer, len(tokenizer), FORMAT, ends)
    found = []
    for seed in range(5):
        outputs, _ = sample(grammar, 4, 100 + seed, tilt)
        for text in texts(tokenizer, outputs, ends):
            check(json.loads(text), SCHEMA)
            found.append(json.loads(text))
    assert len(found) == 20
    assert {v["role"] for v in found} == {"admin", "user", "guest"}
    assert any(v.get("tags") for v in found) and any("zip" in v["address"] for v in found)


def test_end_tokens_only_when_complete(tokenizer, ends):
    grammar = compile_format(tokenizer, len(tokenizer), FORMAT, ends)
    constraint = Constraint(grammar, 1)
    zeros = torch.zeros(1, len(tokenizer))
    assert torch.isinf(constraint.mask(zeros)[0, ends]).all()
    text = '{"name":"Ann","age":30,"active":true,"role":"user","address":{"city":"Oslo"}'
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert constraint.mask(zeros)[0, token] == 0, "a token of a valid output was masked"
        constraint.advance([token])
    assert torch.isinf(constraint.mask(zeros)[0, ends]).all(), "an end token before the last brace"
    constraint.advance(tokenizer.encode("}", add_special_tokens=False))
    allowed = torch.isfinite(constraint.mask(zeros)[0]).nonzero().flatten().tolist()
    assert allowed == ends, "after the last brace only the end tokens may follow"
    constraint.advance([ends[0]])
    assert constraint.finished(0)
    assert torch.equal(constraint.mask(zeros), zeros), "a finished row's logits are left as they are"


def test_rewind_reproduces_the_continuation(tokenizer, ends, tilt):
    grammar = compile_format(tokenizer, len(tokenizer), FORMAT, ends)
    rows = 3
    constraint = Constraint(grammar, rows)
    g = torch.Generator().manual_seed(7)
    saved, rng, steps = [constraint.state()], [g.get_state()], []
    while not all(constraint.finished(r) for r in range(rows)):
        tokens = choose(constraint, rows, g, tilt, len(tokenizer))
        constraint.advance(tokens)
        steps.append(tokens)
        saved.append(constraint.state())
        rng.append(g.get_state())
    assert len(steps) > 10 and len(steps) < MAX_TOKENS
    for back in (len(steps) - 1, len(steps) // 2, 3):  # over finished rows, then further, then again
        constraint.restore(saved[back])
        g.set_state(rng[back])
        assert [constraint.finished(r) for r in range(rows)] == [any(s[r] in ends for s in steps[:back])
                                                                 for r in range(rows)]
        for step in range(back, len(steps)):
            tokens = choose(constraint, rows, g, tilt, len(tokenizer))
            assert tokens == steps[step], f"step {step} differs after a rewind to {back}"
            constraint.advance(tokens)
            assert constraint.state() == saved[step + 1]
    with pytest.raises(ValueError, match="later state"):
        Constraint(grammar, rows).restore(saved[5])  # only back, never forward


def test_logits_wider_than_the_vocabulary(tokenizer, ends, tilt):
    width = len(tokenizer) + 64  # models pad their LM head
    grammar = compile_format(tokenizer, width, {"type": "json_object"}, ends)
    outputs, constraint = sample(grammar, 4, 3, tilt, width=width)
    for text in texts(tokenizer, outputs, ends):
        assert isinstance(json.loads(text), dict)
    fresh = Constraint(grammar, 1).mask(torch.zeros(1, width))
    assert torch.isinf(fresh[0, len(tokenizer):]).all()


@pytest.mark.parametrize("response_format, param, says", [
    ("json", "response_format", "object"),
    ({"type": "yaml"}, "response_format.type", "json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema", "name"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name", "name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "response_format.json_schema.schema", "foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
     "response_format.json_schema.schema", "nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema", "object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                             "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "uniqueItems.*with strict false"),
])
def test_invalid_formats_are_refused(tokenizer, ends, response_format, param, says):
    with pytest.raises(ValueError, match=says) as raised:
        compile_format(tokenizer, len(tokenizer), response_format, ends)
    assert isinstance(raised.value, FormatError) and raised.value.param == param
    assert "\n" not in str(raised.value)


def test_strict_false_ignores_what_cannot_be_enforced(tokenizer, ends):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}}
    assert compile_format(tokenizer, len(tokenizer), spec, ends) is not None
    assert compile_format(tokenizer, len(tokenizer), {"type": "text"}, ends) is None
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}, "strict": True}}
    with pytest.raises(FormatError) as raised:
        compile_format(tokenizer, len(tokenizer), spec, ends)
    assert "strict" not in str(raised.value), "no hint where strict false would not help"


@pytest.mark.parametrize("kind, value, accept", [
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("choice", ["yes", "no", "maybe so", 'a "quoted" \\ one', "naïve\n"],
     lambda t: t in ["yes", "no", "maybe so", 'a "quoted" \\ one', "naïve\n"]),
    ("grammar", 'start: "x" /[0-9]{2}/ ("!" | "?")', lambda t: re.fullmatch(r"x[0-9]{2}[!?]", t)),
    ("grammar", 'root ::= "x" [0-9] [0-9] ("!" | "?")', lambda t: re.fullmatch(r"x[0-9]{2}[!?]", t)),
    ("json", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_guided_decoding(tokenizer, ends, tilt, kind, value, accept):
    grammar = compile_guided(tokenizer, len(tokenizer), kind, value, ends)
    outputs, _ = sample(grammar, 4, 11, tilt)
    for text in texts(tokenizer, outputs, ends):
        assert accept(text), (kind, text)


@pytest.mark.parametrize("kind, value", [("regex", "("), ("choice", []), ("choice", "yes"),
                                         ("grammar", "start: undefined_rule"), ("json", "{nope")])
def test_invalid_guided_fields_are_refused(tokenizer, ends, kind, value):
    with pytest.raises(FormatError) as raised:
        compile_guided(tokenizer, len(tokenizer), kind, value, ends)
    assert raised.value.param == f"guided_{kind}"


def test_as_a_logits_processor(tokenizer, ends):
    grammar = compile_guided(tokenizer, len(tokenizer), "choice", ["yes", "no"], ends)
    processor = ConstraintProcessor(Constraint(grammar, 2), prompt_length=3)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    yes, no = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("no", add_special_tokens=False)
    scores = torch.zeros(2, len(tokenizer))
    for step in range(max(len(yes), len(no)) + 1):
        allowed = torch.isfinite(processor(ids, scores))
        chosen = [(yes + [ends[0]] * 9)[step], (no + [ends[0]] * 9)[step]]
        assert allowed[0, chosen[0]] and allowed[1, chosen[1]]
        ids = torch.cat([ids, torch.tensor(chosen)[:, None]], dim=1)
    processor(ids, scores)
    assert processor.constraint.finished(0) and processor.constraint.finished(1)


def test_one_grammar_serves_threads_at_once(tokenizer, ends, tilt):
    grammar = compile_format(tokenizer, len(tokenizer), FORMAT, ends)
    alone = [sample(grammar, 2, seed, tilt)[0] for seed in range(4)]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda seed: sample(grammar, 2, seed, tilt)[0], range(4)))
    assert together == alone
