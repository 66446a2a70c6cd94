"""Real clients against `swarm api`: an agent framework on a tool-trained model, the cost of structured
output, and an evaluation harness's wall time.

Sections (`--sections`, default all):
- `agents`: Qwen2.5-Coder-0.5B-Instruct (from PyPI wheels, `swarm/local/pypi_models.py`) on a bootstrap and 3 peers
  on 127.0.0.1, behind `swarm api`; LangChain's `ChatOpenAI`: a `bind_tools` round trip (the model asks
  for a tool, gets its result, answers), and `with_structured_output(PydanticModel)` by function calling and
  by JSON schema, 20 questions each: how many validate (the target: 20 of 20). Exits 1 if any check fails.
- `cost`: decode tokens/s of the same chat answer streamed with a `json_schema` response format and
  without (plain JSON asked for in words), on the demo swarm, runs interleaved; median of `--runs`. The
  target: at least 0.9x.
- `eval`: lm-eval's multiple-choice task of tests/data/lm_eval scored through the demo swarm
  (`local-completions`, batch sizes 1 and 4) and by lm-eval's own `hf` backend on the same checkpoint in
  this process: wall time of each.

Writes its tables into docs/benchmarks.md between its markers.

    python benchmarks/api_clients.py [--sections agents cost eval] [--runs 5] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine, write_section  # noqa: E402

from swarm.weights.models import local_model_id  # noqa: E402

QWEN = "qwen2.5-coder-0.5b-instruct"
QUESTIONS = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Linus Torvalds", "Guido van Rossum", "Marie Curie",
             "Isaac Newton", "Albert Einstein", "Ada Yonath", "Katherine Johnson", "Tim Berners-Lee",
             "Margaret Hamilton", "Dennis Ritchie", "Barbara Liskov", "Donald Knuth", "John von Neumann",
             "Edsger Dijkstra", "Frances Allen", "Ken Thompson", "Hedy Lamarr"]


def log(message: str) -> None:
    print(f"[api-clients] {message}", file=sys.stderr, flush=True)


def swarm_api(net, path: Path, model_id: str, *extra: str) -> str:
    from client.demo import start_swarm

    start_swarm(net, path, 3, "float32", model_id)
    return net.start_api("api", path, "--model-id", model_id, *extra, timeout=300).extra["url"]


# ---- agents ----

def agents(args) -> tuple[list[str], bool]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    from swarm.cli import cache_home
    from swarm.local.launch import LocalSwarm
    from swarm.local.pypi_models import MODELS, default_dir, prepare

    class Person(BaseModel):
        """Facts about a person."""

        name: str = Field(description="the person's full name", max_length=40)
        born: int = Field(description="the year the person was born", ge=1000, le=2030)
        field: str = Field(description="what the person is known for, in a few words", max_length=60)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny and 21 degrees Celsius in {city}."

    path = prepare(QWEN, default_dir(cache_home(), QWEN))
    model_id = local_model_id(path)
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="swarm-agents-") as root, LocalSwarm(Path(root)) as net:
        url = swarm_api(net, path, model_id, "--context-length", "2048")
        llm = ChatOpenAI(base_url=url, api_key="unused", model=model_id, temperature=0, max_tokens=160, timeout=300,
                         max_retries=0)
        # a tool round trip, the model deciding (tool_choice auto): its call is parsed and run, the result goes
        # back in the history, and the model replies (what it replies is the model's: greedy through the swarm
        # is transformers' greedy, see benchmarks/real_models.py)
        started = time.perf_counter()
        bound = llm.bind_tools([get_weather])
        messages = [HumanMessage("What is the weather in Paris right now?")]
        asked = bound.invoke(messages)
        calls = asked.tool_calls
        final = None
        if calls:
            messages += [asked, ToolMessage(get_weather.invoke(calls[0]["args"]), tool_call_id=calls[0]["id"])]
            final = bound.invoke(messages)
        round_trip = bool(calls) and calls[0]["name"] == "get_weather" and "paris" in json.dumps(calls[0]["args"]).lower() \
            and final is not None and bool(final.content or final.tool_calls)
        ok &= round_trip
        reply = (final.content if final is not None and isinstance(final.content, str) else "") or \
            (f"calls {final.tool_calls[0]['name']} again" if final is not None and final.tool_calls else "")
        rows.append(f"| `bind_tools` round trip (tool_choice auto) | {'yes' if round_trip else 'NO'} | "
                    f"{time.perf_counter() - started:.1f} s | call {calls[0]['name'] if calls else 'none'}"
                    f"({json.dumps(calls[0]['args']) if calls else ''}); the reply after the result: "
                    f"`{reply.strip()[:60].replace(chr(10), ' ').replace('|', '/')}` |")
        log(rows[-1])
        for method in ("function_calling", "json_schema"):
            structured = llm.with_structured_output(Person, method=method, include_raw=True)
            started, valid = time.perf_counter(), 0
            for who in QUESTIONS:
                out = structured.invoke(f"Give the facts about {who}.")
                valid += isinstance(out.get("parsed"), Person) and out.get("parsing_error") is None
            ok &= valid == len(QUESTIONS)
            rows.append(f"| `with_structured_output(Person, method=\"{method}\")` | {valid}/{len(QUESTIONS)} valid | "
                        f"{time.perf_counter() - started:.1f} s | |")
            log(rows[-1])
    lines = ["### API clients: an agent framework on a tool-trained model", "",
             f"Machine: {machine()}. {MODELS[QWEN].title} (float32) on a bootstrap and 3 peers on 127.0.0.1 behind "
             "`swarm api`; LangChain's `ChatOpenAI` at temperature 0 (`benchmarks/api_clients.py --sections agents`).",
             "", "| what | result | time | detail |", "|---|---|---|---|", *rows]
    return lines, ok


# ---- cost of structured output ----

def cost(args) -> tuple[list[str], bool]:
    import openai

    from swarm.local.launch import LocalSwarm

    path = demo_path()
    model_id = local_model_id(path)
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                               "genres": {"type": "array", "items": {"type": "string"}}},
              "required": ["title", "year", "genres"]}
    messages = [{"role": "user", "content": "Describe a famous film as JSON with its title, year and genres."}]
    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    with tempfile.TemporaryDirectory(prefix="swarm-cost-") as root, LocalSwarm(Path(root)) as net:
        oai = openai.OpenAI(base_url=swarm_api(net, path, model_id), api_key="unused", max_retries=0, timeout=300)
        fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": schema}}
        for _ in range(args.runs + 1):  # the first round warms routes and caches; not counted
            for kind in rates:
                extra = {"response_format": fmt} if kind == "json_schema" else {}
                times = []
                for chunk in oai.chat.completions.create(model=model_id, messages=messages, max_tokens=48,
                                                         temperature=0, stream=True, **extra):
                    if chunk.choices and chunk.choices[0].delta.content:
                        times.append(time.perf_counter())
                if len(times) > 2:
                    rates[kind].append((len(times) - 1) / (times[-1] - times[0]))
        for kind in rates:
            rates[kind] = rates[kind][1:]
    plain, shaped = statistics.median(rates["plain"]), statistics.median(rates["json_schema"])
    lines = ["### API clients: the cost of structured output", "",
             f"Machine: {machine()}. Demo model on a bootstrap and 3 peers on 127.0.0.1 behind `swarm api`; one "
             "chat answer (at most 48 tokens, greedy) streamed with a `json_schema` response format and without, "
             f"runs interleaved, median of {args.runs}; decode tokens/s counted between the first and the last "
             "streamed chunk (`benchmarks/api_clients.py --sections cost`).", "",
             "| response format | decode tokens/s | vs none |", "|---|---|---|",
             f"| none | {plain:.1f} | 1.00x |", f"| json_schema | {shaped:.1f} | {shaped / plain:.2f}x |"]
    return lines, shaped / plain >= 0.9


# ---- an evaluation harness ----

def evaluate(args) -> tuple[list[str], bool]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from swarm.local.launch import LocalSwarm

    path = demo_path()
    model_id = local_model_id(path)
    data = REPO / "tests" / "data" / "lm_eval" / "questions.jsonl"
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-eval-") as root, LocalSwarm(Path(root)) as net:
        (Path(root) / "task.yaml").write_text(
            f"task: swarm_questions\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
            "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
        tasks = TaskManager(include_path=root)
        url = swarm_api(net, path, model_id)
        runs = [("lm-eval `hf`, in this process", "hf",
                 {"pretrained": str(path), "dtype": "float32", "device": "cpu"}, 1)]
        runs += [(f"`local-completions` through the swarm, batch size {b}", "local-completions",
                  {"model": model_id, "base_url": f"{url}/completions", "num_concurrent": 1}, b) for b in (1, 4)]
        for label, model, model_args, batch in runs:
            started = time.perf_counter()
            out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["swarm_questions"],
                                          task_manager=tasks, batch_size=batch)
            seconds = time.perf_counter() - started
            rows.append((label, seconds, out["results"]["swarm_questions"]["acc,none"]))
            log(f"{label}: {seconds:.1f} s")
    base = rows[0][1]
    lines = ["### API clients: an evaluation harness", "",
             f"Machine: {machine()}. lm-eval's multiple-choice task of tests/data/lm_eval (10 questions, 40 "
             "choices) on the demo model: lm-eval's `hf` backend locally, and `local-completions` against "
             "`swarm api` on a bootstrap and 3 peers on 127.0.0.1 (echo + logprobs; the remote tokenizer "
             "endpoints); wall time of `simple_evaluate` (`benchmarks/api_clients.py --sections eval`).", "",
             "| backend | wall time | vs hf | accuracy |", "|---|---|---|---|"]
    lines += [f"| {label} | {s:.1f} s | {s / base:.1f}x | {acc:.2f} |" for label, s, acc in rows]
    return lines, len({acc for _, _, acc in rows}) == 1


def demo_path() -> Path:
    from swarm.cli import cache_home
    from swarm.local.demo_model import default_demo_dir, prepare_demo_model

    return prepare_demo_model(default_demo_dir(cache_home()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["agents", "cost", "eval"],
                        choices=["agents", "cost", "eval"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args()
    ok = True
    for section in args.sections:
        lines, passed = {"agents": agents, "cost": cost, "eval": evaluate}[section](args)
        ok &= passed
        print("\n".join(lines) if args.no_write else write_section(f"api-{section}", lines), flush=True)
        if not passed:
            log(f"{section}: a check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
