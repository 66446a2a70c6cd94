"""Prompt reuse through `swarm api` (client.api.reuse): what conversations cost with it and without it.

Starts a bootstrap and three peers (real processes on 127.0.0.1) serving the demo model's blocks [0:10),
[10:20), [20:30) with their metrics on, and two gateways in front of them: `warm` (reuse on, the default)
and `cold` (`--reuse-tokens 0`). Clients are the `openai` package, streaming, greedy. Time to first token is
seen by the client, from sending the request to the first content chunk.

1. A chat of `--turns` turns: each user message is about 150 tokens of English text, each answer at most 24
   tokens (so each turn adds about 175 prompt tokens). First-token time per turn, median over `--repeats`
   conversations (each run on both gateways, one after the other, with different texts).
2. Conversations sharing a 1,000-token system prompt: one request alone (its first token is the cold
   figure), then one more, then `--concurrent` at once, each with its own question. Their first-token
   times (median, slowest) and the tokens the peers ran through their blocks in each round, on each
   gateway. (Run first, on peers that hold nothing yet.)
3. Memory: the cache tokens the peers hold once the requests are done (kept sessions), in bytes.

    python benchmarks/prefix_reuse.py [--turns 6] [--repeats 3] [--concurrent 8]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import openai  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from client.demo import threads_per_peer  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

TEXT = (REPO / "tests" / "data" / "english.txt").read_text().split()
ANSWER_TOKENS = 24
SPANS = ("0:10", "10:20", "20:30")


def cpu_flags() -> str:
    """The CPU's vector and matrix extensions that matter for these kernels (avx2, avx512 VNNI and bf16, AMX)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return " ".join(f for f in ("avx2", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags) or "none of note"


def words(start: int, tokens: int, tokenizer) -> str:
    """English text of about `tokens` tokens, from word `start` of the sample text."""
    out, n = [], start
    while len(tokenizer(" ".join(out)).input_ids) < tokens:
        out.append(TEXT[n % len(TEXT)])
        n += 1
    return " ".join(out)


def first_token(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[float, str]:
    started = time.perf_counter()
    first, text = None, []
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=ANSWER_TOKENS,
                                            temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first - started, "".join(text)


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def chat_turns(clients: dict, model: str, tokenizer, turns: int, repeats: int) -> dict[str, list[list[float]]]:
    """Per gateway, per turn: the first-token times of each repeat."""
    times = {name: [[] for _ in range(turns)] for name in clients}
    for r in range(repeats):
        for name, client in clients.items():
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for t in range(turns):
                messages.append({"role": "user", "content": "Summarize: " + words(400 * (r * turns + t), 150,
                                                                                   tokenizer)})
                ttft, answer = first_token(client, model, messages)
                times[name][t].append(ttft)
                messages.append({"role": "assistant", "content": answer})
    return times


def shared_rounds(client: openai.OpenAI, model: str, system: str, counts: list[int], tag: int,
                  peers: list[str]) -> dict:
    """One request alone with `system`, then rounds of `count` requests at once with it, each with its own
    question: first-token times, and the tokens the peers ran for each round."""
    alone, _ = first_token(client, model, [{"role": "system", "content": system},
                                           {"role": "user", "content": f"Question {tag}: who wrote it?"}])
    rounds = {}
    for count in counts:
        before = sum(metric(p, "swarm_peer_tokens_total") for p in peers)
        results, errors = [], []

        def one(question: str) -> None:
            try:
                results.append(first_token(client, model, [{"role": "system", "content": system},
                                                            {"role": "user", "content": question}])[0])
            except Exception as e:  # reported below: a benchmark with failures is not a result
                errors.append(e)

        threads = [threading.Thread(target=one, args=(f"Question {tag}-{count}-{i}: what is the main idea of the "
                                                      "text above, in one sentence?",)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}")
        rounds[count] = {"median": statistics.median(results), "slowest": max(results),
                         "tokens": sum(metric(p, "swarm_peer_tokens_total") for p in peers) - before}
    return {"alone": alone, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=8)
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ckpt = Checkpoint(path)
    per_token = ckpt.cache_bytes_per_token(torch.float32) * ckpt.num_blocks / len(SPANS)  # a third of the blocks each
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as root, LocalSwarm(Path(root)) as net:
        net.start_bootstrap()
        procs = [net.start_peer(f"peer{i}", path, "--blocks", span, "--model-id", model_id, "--threads",
                                str(threads_per_peer(len(SPANS))), "--cache-tokens", "16384", "--metrics-port", "0",
                                wait=False) for i, span in enumerate(SPANS)]
        for proc in procs:
            net.wait_serving(proc, timeout=300)
        peers = [net.metrics_url(p) for p in procs]
        clients = {}
        for name, extra in (("warm", ()), ("cold", ("--reuse-tokens", "0"))):
            url = net.start_api(name, path, "--max-generations", str(args.concurrent), "--max-tokens",
                                str(ANSWER_TOKENS), *extra).extra["url"]
            clients[name] = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for client in clients.values():  # warm-up: routes measured, threads started
            first_token(client, model_id, [{"role": "user", "content": "Hello."}])
        system = "You answer questions about this text. " + words(20000, 1000, tokenizer)
        system_tokens = len(tokenizer(system).input_ids)
        counts = sorted({1, args.concurrent})
        shared = {}
        for tag, name in enumerate(("warm", "cold")):
            shared[name] = shared_rounds(clients[name], model_id, system, counts, tag, peers)
            print(f"{name}: {shared[name]}", flush=True)
        turns = chat_turns(clients, model_id, tokenizer, args.turns, args.repeats)
        for t in range(args.turns):
            print(f"turn {t + 1}: " + ", ".join(f"{n} {statistics.median(turns[n][t]) * 1e3:.0f} ms" for n in turns),
                  flush=True)
        used = sum(metric(p, "swarm_peer_cache_tokens_used") for p in peers)
        kept = metric(net.procs["warm"].extra["url"].removesuffix("/v1") + "/metrics", "swarm_api_kept_tokens")
    ratio = shared["warm"]["rounds"][args.concurrent]["tokens"] / shared["cold"]["rounds"][args.concurrent]["tokens"]
    lines = [
        "### Prompt reuse through the API: conversations that do not pay twice",
        "",
        f"Machine: {machine()}. Demo model (SmolLM2-135M-Instruct) on a bootstrap and 3 peers [0:10) [10:20) "
        f"[20:30) on 127.0.0.1, two gateways in front: reuse on (the default) and off (`--reuse-tokens 0`). "
        f"CPU flags: {cpu_flags()}. Streaming chat requests with the `openai` package, greedy; first token as the "
        "client sees it.",
        "",
        f"A chat of {args.turns} turns, each user message about 150 tokens and each answer at most {ANSWER_TOKENS} "
        f"(about 175 new prompt tokens per turn); first token per turn, median of {args.repeats} conversations:",
        "",
        "| turn | " + " | ".join(str(t + 1) for t in range(args.turns)) + " | turn 6 / turn 1 |",
        "|---|" + "---|" * (args.turns + 1),
        *(f"| reuse {'on' if n == 'warm' else 'off'} | " + " | ".join(
            f"{statistics.median(turns[n][t]) * 1e3:.0f} ms" for t in range(args.turns)) +
          f" | {statistics.median(turns[n][-1]) / statistics.median(turns[n][0]):.2f}x |" for n in ("warm", "cold")),
        "",
        f"Conversations sharing a {system_tokens}-token system prompt, each with its own question: one request "
        "alone (the first with it: nothing to reuse), then 1, then "
        f"{args.concurrent} at once; first token, and the tokens the 3 peers ran through their blocks for each "
        "round (prompts and the 24 answer tokens):",
        "",
        "| reuse | first request alone | requests at once | first token, median | slowest | median / cold alone "
        "| peers' tokens |",
        "|---|---|---|---|---|---|---|",
        *(f"| {'on' if n == 'warm' else 'off'} | {r['alone'] * 1e3:.0f} ms | {count} | {x['median'] * 1e3:.0f} ms | "
          f"{x['slowest'] * 1e3:.0f} ms | {x['median'] / shared['cold']['alone']:.2f}x | {x['tokens']:.0f} |"
          for n, r in shared.items() for count, x in r["rounds"].items()),
        "",
        f"Peers' tokens with reuse / without, {args.concurrent} at once: {ratio:.3f}. "
        f"Held afterwards: the gateway keeps {kept:.0f} tokens of finished sessions (`--reuse-tokens` bounds it, "
        f"32,768 by default); the 3 peers hold {used:.0f} cache tokens together, about "
        f"{used * per_token / 2**20:.0f} MiB "
        f"({per_token / 1024:.0f} KiB per token per peer in float32, reserved in chunks of 128 tokens; an idle kept "
        "session is reclaimed by a peer short of room for another client).",
        "",
        f"Command: `.venv/bin/python benchmarks/prefix_reuse.py --turns {args.turns} --repeats {args.repeats} "
        f"--concurrent {args.concurrent}`",
    ]
    print(write_section("prefix_reuse", lines))


if __name__ == "__main__":
    main()
