"""Structured output: what enforcing a JSON grammar costs, for the demo model's tokenizer (vocabulary 49,152).

On one thread: converting the tokenizer for the engine; compiling `json_object` and the test schema of
tests/unit/test_grammar.py (first time, and the median of repeats); per token, the median time of one
row's mask and advance over --tokens tokens of random logits tilted toward closing tokens (as in the
tests), and of the library's own mask alone. Then the demo model decoding greedily here, in this
process, with and without a json_schema constraint, one step of each in turn: a local step is no
longer than a step through the swarm (70-100 ms), so the local ratio is a lower bound of the swarm's.
The candidates that `client/grammar.py` was chosen against (xgrammar, outlines-core) are measured
the same way when they are importable (`pip install xgrammar outlines-core`; xgrammar brings triton, 1 GB).

    python benchmarks/grammar.py [--tokens 200] [--no-write]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests" / "unit")]

from client.generation import stop_token_ids  # noqa: E402
from client.grammar import Constraint, compile_format, grammar_tokenizer  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from test_grammar import FORMAT, SCHEMA  # noqa: E402

OBJECT = {"type": "object"}
PROMPT = "Describe a person as JSON with name, age, score, active, role, tags and address."
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
BITS = np.arange(32, dtype=np.uint32)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:,.0f}"


def forbidden_from_bitmask(bitmask: np.ndarray, width: int) -> np.ndarray:
    return ((bitmask.view(np.uint32)[:, None] >> BITS) & 1).reshape(-1)[:width] == 0


class Ours:
    """client.grammar (llguidance)."""

    name = f"llguidance {version('llguidance')}"

    def __init__(self, tokenizer, ends):
        self.tokenizer, self.ends = tokenizer, ends
        started = time.perf_counter()
        grammar_tokenizer(tokenizer, len(tokenizer), ends)
        self.setup_s = time.perf_counter() - started

    def compile(self, schema) -> None:
        fmt = {"type": "json_object"} if schema is OBJECT else FORMAT
        self.grammar = compile_format(self.tokenizer, len(self.tokenizer), fmt, self.ends)
        self.new()
        self.mask(np.zeros((1, len(self.tokenizer)), dtype=np.float32))

    def new(self) -> None:
        self.constraint = Constraint(self.grammar, 1)

    def library_mask(self) -> None:
        self.constraint.matchers[0].compute_logit_bias()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return self.constraint.mask(torch.from_numpy(logits)).numpy()

    def advance(self, token: int) -> bool:
        """Take the token; False once the output is complete (an end token)."""
        self.constraint.advance([token])
        return not self.constraint.finished(0)


class Xgrammar(Ours):
    def __init__(self, tokenizer, ends):
        import xgrammar

        self.x, self.tokenizer, self.ends = xgrammar, tokenizer, ends
        self.name = f"xgrammar {version('xgrammar')}"
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=ends)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - started

    def compile(self, schema) -> None:
        self.grammar = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                         max_whitespace_cnt=20, strict_mode=False)
        self.new()
        self.mask(np.zeros((1, len(self.tokenizer)), dtype=np.float32))

    def new(self) -> None:
        self.matcher = self.x.GrammarMatcher(self.grammar)
        self.bitmask = self.x.allocate_token_bitmask(1, len(self.tokenizer))

    def library_mask(self) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.library_mask()
        out = logits.copy()
        np.putmask(out[0], forbidden_from_bitmask(self.bitmask.numpy()[0], out.shape[1]), -np.inf)
        return out

    def advance(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")
        return not self.matcher.is_terminated()


def byte_level_vocabulary(tokenizer, ends) -> dict[bytes, list[int]]:
    """The vocabulary as bytes, for a byte-level BPE tokenizer (GPT-2's byte-to-character table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    out: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i not in ends and i not in tokenizer.all_special_ids and all(c in chars for c in token):
            out.setdefault(bytes(chars[c] for c in token), []).append(i)
    return out


class OutlinesCore(Ours):
    def __init__(self, tokenizer, ends):
        import outlines_core

        self.oc, self.tokenizer, self.ends = outlines_core, tokenizer, ends
        self.name = f"outlines-core {version('outlines-core')}"
        started = time.perf_counter()
        self.vocabulary = outlines_core.Vocabulary(ends[0], byte_level_vocabulary(tokenizer, ends))
        self.setup_s = time.perf_counter() - started

    def compile(self, schema) -> None:
        # compact JSON: a whitespace pattern makes the automaton, and its compile time, larger still
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        self.index = self.oc.Index(regex, self.vocabulary)
        self.new()
        self.mask(np.zeros((1, len(self.tokenizer)), dtype=np.float32))

    def new(self) -> None:
        self.guide = self.oc.Guide(self.index, max_rollback=1000)
        self.bitmask = torch.zeros(1, (len(self.tokenizer) + 31) // 32, dtype=torch.int32)

    def library_mask(self) -> None:
        self.guide.write_mask_into(self.bitmask.data_ptr(), self.bitmask.numel(), 4)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.library_mask()
        out = logits.copy()
        np.putmask(out[0], forbidden_from_bitmask(self.bitmask.numpy()[0], out.shape[1]), -np.inf)
        return out

    def advance(self, token: int) -> bool:
        if token in self.ends:
            return False
        self.guide.advance(token, return_tokens=False)
        return True


def compile_times(engine, schema, repeats: int = 5) -> tuple[float, float]:
    """(first compile, median of the repeats); one repeat when the first takes over a second."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.compile(schema)
        times.append(time.perf_counter() - started)
        if times[0] > 1:
            break
    return times[0], statistics.median(times[1:] or times)


def per_token(engine, tilt: np.ndarray, tokens: int, seed: int = 0) -> tuple[float, float, int]:
    """Median mask+advance and library-mask-only times over `tokens` tokens, and the outputs finished."""
    rng = np.random.default_rng(seed)
    engine.new()
    both, alone, outputs = [], [], 0
    while len(both) < tokens:
        logits = (rng.standard_normal((1, len(tilt)), dtype=np.float32) + tilt)
        started = time.perf_counter()
        engine.library_mask()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        token = int(engine.mask(logits).argmax())
        going = engine.advance(token)
        both.append(time.perf_counter() - started)
        if not going:
            outputs += 1
            engine.new()
    return statistics.median(both), statistics.median(alone), outputs


def local_decode(path: Path, tokenizer, ends, tokens: int) -> tuple[float, float, float, list[str]]:
    """Median local decode step without and with a json_schema constraint, alternating step by step (so
    both see the same machine); the median of the constraint's own part of a step (mask and advance);
    the JSON outputs completed (the next one starts from the prompt)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    grammar = compile_format(tokenizer, model.config.vocab_size, FORMAT, ends)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, return_tensors="pt").input_ids
    steps: dict[bool, list[float]] = {False: [], True: []}
    spent: list[float] = []  # the constraint's own share of each constrained step
    outs = {False: None, True: None}
    constraint, made, done = None, [], []
    with torch.inference_mode():
        for _ in range(tokens):
            for constrained in (False, True):
                if outs[constrained] is None:  # a new output (the prompt is not timed)
                    outs[constrained] = model(prompt, use_cache=True)
                    constraint, made = Constraint(grammar, 1), []
                started = time.perf_counter()
                logits = outs[constrained].logits[:, -1]
                if constrained:
                    logits = constraint.mask(logits)
                    masked = time.perf_counter()
                token = int(logits.argmax())
                if constrained:
                    chosen = time.perf_counter()
                    constraint.advance([token])
                    spent.append(masked - started + time.perf_counter() - chosen)
                outs[constrained] = model(torch.tensor([[token]]), cache=outs[constrained].cache, use_cache=True)
                steps[constrained].append(time.perf_counter() - started)
                if constrained:
                    made.append(token)
                    if constraint.finished(0):
                        done.append(tokenizer.decode(made[:-1]))
                        outs[True] = None
    return statistics.median(steps[False]), statistics.median(steps[True]), statistics.median(spent), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--no-model", action="store_true", help="skip the local decode with the demo model")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)

    path = prepare_demo_model(default_demo_dir(cache_home()))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ends = stop_token_ids(tokenizer)
    tilt = np.zeros(len(tokenizer), dtype=np.float32)
    tilt[[i for t, i in tokenizer.get_vocab().items() if any(c in t for c in '"}]')]] = 1.5
    tilt[ends] = 3.0

    lines = [f"Structured output, demo tokenizer ({len(tokenizer):,} tokens), one thread; {machine()}; "
             f"compile: first (median of repeats); per token: mask + advance of one row, median of "
             f"{args.tokens} tokens (the library's mask alone).", "",
             "| library | tokenizer setup ms | json_object compile ms | schema compile ms "
             "| json_object per token ms | schema per token ms |", "|---|---|---|---|---|---|"]
    for kind in (Ours, Xgrammar, OutlinesCore):
        try:
            engine = kind(tokenizer, ends)
        except ImportError:
            continue
        row = [engine.name, ms(engine.setup_s)]
        cells = []
        for schema in (OBJECT, SCHEMA):
            first, again = compile_times(engine, schema)
            both, alone, _ = per_token(engine, tilt, args.tokens)
            row.append(f"{ms(first)} ({ms(again)})")
            cells.append(f"{both * 1e3:.3f} ({alone * 1e3:.3f})")
        lines.append("| " + " | ".join(row + cells) + " |")
        print(lines[-1], flush=True)
    if not args.no_model:
        plain, constrained, spent, done = local_decode(path, tokenizer, ends, args.tokens)
        first = f", the first: `{json.dumps(json.loads(done[0]))}`" if done else ""
        lines += ["", f"Local greedy decode of the demo model, json_schema enforced vs not (alternating steps, "
                      f"{args.tokens} each): median step {plain * 1e3:.1f} ms vs {constrained * 1e3:.1f} ms, "
                      f"{plain / constrained:.3f}x the tokens/s; the constraint's part of a step: "
                      f"{spent * 1e3:.2f} ms. {len(done)} JSON outputs completed{first}."]
    print("\n".join(lines) if args.no_write else write_section("grammar", lines))


if __name__ == "__main__":
    main()
