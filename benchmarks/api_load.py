"""Concurrent streaming clients against `swarm api` on the demo swarm: requests per second and time to
first token.

Starts a bootstrap and three peers (real processes on 127.0.0.1) serving the demo model's blocks
[0:10), [10:20), [20:30), and `swarm api` in front of them. Then, for each client count (default 1 and
4), every client (a thread with the official `openai` package) sends streaming chat requests one after
another (`--requests` each, greedy, at most `--tokens` tokens; the prompt asks for a long story, so the
model does not end earlier, and the tokens actually generated are what is counted).
Reports, per client count: requests per second (completed requests / wall time of the round), the
median and 90th percentile time to first token seen by the client (request sent to first content
chunk), the median time per request, and aggregate completion tokens per second.

    python benchmarks/api_load.py [--clients 1 4] [--requests 5] [--tokens 32]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import openai  # noqa: E402

from client.demo import start_swarm  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

QUESTION = "Write a long story about a lighthouse keeper and a storm."


def one_request(client: openai.OpenAI, model: str, tokens: int) -> dict:
    started = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or usage is None:
        raise RuntimeError("the stream carried no text or no usage chunk")
    return {"ttft": first - started, "total": time.perf_counter() - started, "tokens": usage.completion_tokens}


def round_of(url: str, model: str, clients: int, requests: int, tokens: int) -> dict:
    results: list[dict] = []
    errors: list[BaseException] = []

    def run_client() -> None:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        for _ in range(requests):
            try:
                results.append(one_request(client, model, tokens))
            except Exception as e:  # reported below: a benchmark with failures is not a result
                errors.append(e)

    threads = [threading.Thread(target=run_client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]!r}")
    ttfts = sorted(r["ttft"] for r in results)
    return {"clients": clients, "requests": len(results), "rps": len(results) / wall,
            "ttft_median": statistics.median(ttfts), "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "total_median": statistics.median(r["total"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=5, help="requests per client, one after another")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = local_model_id(path)
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", model_id)
        url = net.start_api("api", path, "--max-generations", str(max(args.clients))).extra["url"]
        round_of(url, model_id, 1, 1, args.tokens)  # warm-up: routes measured, threads started
        for clients in args.clients:
            row = round_of(url, model_id, clients, args.requests, args.tokens)
            rows.append(row)
            print(f"{clients} clients: {row['rps']:.2f} requests/s, first token {row['ttft_median'] * 1e3:.0f} ms "
                  f"(p90 {row['ttft_p90'] * 1e3:.0f} ms), {row['tokens_per_s']:.1f} tokens/s", flush=True)
    lines = [
        "### OpenAI-compatible API: concurrent streaming clients",
        "",
        f"Machine: {machine()}. Demo model (SmolLM2-135M-Instruct) on a bootstrap and 3 peers [0:10) [10:20) "
        f"[20:30) on 127.0.0.1, `swarm api` in front; each client (a thread, the `openai` package) sends "
        f"{args.requests} streaming chat requests in a row, greedy, {args.tokens} tokens each. Time to first "
        "token is seen by the client, from sending the request to the first content chunk.",
        "",
        "| clients | requests/s | first token, median | first token, p90 | request, median | tokens/s, all clients |",
        "|---|---|---|---|---|---|",
        *(f"| {r['clients']} | {r['rps']:.2f} | {r['ttft_median'] * 1e3:.0f} ms | {r['ttft_p90'] * 1e3:.0f} ms | "
          f"{r['total_median']:.2f} s | {r['tokens_per_s']:.1f} |" for r in rows),
        "",
        f"Command: `.venv/bin/python benchmarks/api_load.py --clients {' '.join(map(str, args.clients))} "
        f"--requests {args.requests} --tokens {args.tokens}`",
    ]
    print(write_section("api_load", lines))


if __name__ == "__main__":
    main()
