"""The peer as an inference server: what one swarm gives many users at once, against transformers locally.

Starts a bootstrap and three peers (real processes on 127.0.0.1) serving the demo model's blocks [0:10),
[10:20), [20:30) in float32 with one compute thread each, and `swarm api` in front of them (no prompt reuse,
no drafts: `--reuse-tokens 0 --speculative-tokens 0`). transformers runs the same model in this process, with
torch's threads, while the swarm is idle. Sections (`--sections`, all by default):

- `long`: one user at `--long-context` tokens of context (a prompt of that many tokens, then greedy decoding):
  the median decode step through the swarm against transformers' own step at that context (`generate`, one
  sequence), in the same run.
- `users`: `--users` users at once, each with its own prompt of about `--prompt` tokens (English text, a
  different part for each), streaming `--tokens` tokens each, greedy. Aggregate decode tokens/s over the
  window in which every user decodes (from the last user's first token to the first user's last), and the
  median step each user sees; against one user alone through the same swarm, and against transformers running
  the same prompts as one left-padded batch (`generate`), and one of them alone.
- `prefill`: `--users` - 1 users decode (short prompts, long answers) while one more sends a prompt of
  `--prompt` tokens: the steps they see while it is prefilled (from its request to its first token) against
  their steps before it came.
- `memory`: on the first peer, straight through its session protocol: one session holding a prompt of
  `--prompt` tokens, then `--forks` forks of it at its end, each stepping one token of its own. The peer's cache
  memory (`swarm_peer_cache_bytes`: pages its sessions' keys and values were written to) for the prefix alone,
  and with the forks, against one copy of it; bytes per cached token against 2 x blocks x key-value heads x
  head dim x 4 (float32).

Figures are medians. Each user's text is compared with transformers' greedy text for the same prompt (counted,
not required: batched rows may round differently). CPU flags are noted: compare only ratios of one run.

    python benchmarks/serving.py [--sections long users prefill memory] [--users 8] [--prompt 1000] [--tokens 48]

Writes its section into docs/benchmarks.md between its markers (`--no-write`: print only; `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
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
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from client.demo import threads_per_peer  # noqa: E402
from client.inference.peer_session import PeerSession  # noqa: E402
from client.loop import LoopThread  # noqa: E402
from prefix_reuse import cpu_flags  # noqa: E402
from report import demo_model, machine, write_section  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.net.identity import Identity  # noqa: E402
from swarm.net.transport import Node  # noqa: E402
from swarm.span import Span  # noqa: E402

TEXT = (REPO / "tests" / "data" / "english.txt").read_text().split()
SPANS = ("0:10", "10:20", "20:30")
SECTIONS = ("long", "users", "prefill", "memory")


def log(msg: str) -> None:
    print(f"[serving] {msg}", flush=True)


def prompt_ids(tokenizer, start: int, tokens: int) -> list[int]:
    """Exactly `tokens` token ids of English text, from word `start` of the sample text (wrapping around)."""
    words = [TEXT[(start + i) % len(TEXT)] for i in range(tokens)]  # a word is at least one token
    return tokenizer(" ".join(words)).input_ids[:tokens]


# ---- transformers, locally ----

class StepClock(LogitsProcessor):
    """Records the time of every call (one per generated token) without changing the scores."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def local_run(model, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """transformers' `generate` of `prompts` as one left-padded batch: the median decode step (s) and each
    prompt's greedy tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    clock = StepClock()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return statistics.median(steps), [row[width:].tolist() for row in out]


# ---- the swarm, through the API ----

class Stream:
    """One streaming completion: when each of its tokens arrived, and its text."""

    def __init__(self, client: openai.OpenAI, model: str, prompt: list[int], tokens: int):
        self.client, self.model, self.prompt, self.tokens = client, model, prompt, tokens
        self.sent = 0.0
        self.times: list[float] = []
        self.text: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sent = time.perf_counter()
            stream = self.client.completions.create(model=self.model, prompt=self.prompt, max_tokens=self.tokens,
                                                    temperature=0, stream=True, logprobs=0)
            for chunk in stream:
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None and choice.logprobs and choice.logprobs.tokens:
                    now = time.perf_counter()
                    self.times.extend([now] * len(choice.logprobs.tokens))
                    self.text.append(choice.text or "")
        except Exception as e:  # reported by the caller: a benchmark with failures is not a result
            self.error = e

    def steps_between(self, start: float, end: float) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:]) if start <= a and b <= end]

    def step(self) -> float:
        return statistics.median(self.steps_between(self.times[0], self.times[-1]))


def run_streams(streams: list[Stream]) -> None:
    threads = [threading.Thread(target=s.run) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    failed = [s.error for s in streams if s.error is not None or not s.times]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed; first: {failed[0]!r}")


def aggregate(streams: list[Stream]) -> tuple[float, float]:
    """(aggregate decode tokens/s, median step of a user (s)) over the window in which every stream decodes."""
    start, end = max(s.times[0] for s in streams), min(s.times[-1] for s in streams)
    if end <= start:
        raise RuntimeError("the streams did not decode at the same time: raise --tokens")
    count = sum(sum(1 for t in s.times if start < t <= end) for s in streams)
    return count / (end - start), statistics.median(d for s in streams for d in s.steps_between(start, end))


def same_text(streams: list[Stream], expected: list[list[int]], tokenizer) -> int:
    return sum("".join(s.text) == tokenizer.decode(e[:len(s.times)]) for s, e in zip(streams, expected))


# ---- the cache's memory, on one peer ----

def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def settled(url: str, timeout: float = 30.0) -> float:
    """The peer's cache memory once it stops changing (closed sessions' blocks are freed between its turns)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = scrape(url)["swarm_peer_cache_bytes"]
        if now == last:
            return now
        last = now
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the peer's cache memory did not settle in {timeout:.0f} s")


def memory(net: LocalSwarm, model_id: str, hidden_size: int, prompt: int, forks: int) -> dict:
    proc = net.procs["peer0"]
    url = net.metrics_url(proc)
    span = Span(0, 10)

    async def main() -> dict:
        async with Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True) as node:
            base = await settled(url)  # what the sections before left is given back while the peer idles
            source = await PeerSession.open(node, proc.peer_id, model_id, span, max_length=prompt + 64)
            opened = [source]
            try:
                await source.step(torch.randn(1, prompt, hidden_size), 0)
                one = scrape(url)["swarm_peer_cache_bytes"] - base
                for _ in range(forks):
                    fork = await PeerSession.open(node, proc.peer_id, model_id, span, max_length=prompt + 64,
                                                  fork=(source.id, prompt))
                    opened.append(fork)
                    await fork.step(torch.randn(1, 1, hidden_size), prompt)  # a token of its own
                figures = scrape(url)
                return {"one": one, "all": figures["swarm_peer_cache_bytes"] - base,
                        "shared": figures["swarm_peer_cache_blocks_shared"],
                        "token_bytes": figures["swarm_peer_cache_token_bytes"]}
            finally:
                for s in opened:
                    await s.close()

    with LoopThread() as lt:
        return lt.run(main(), timeout=300)


def start(net: LocalSwarm, path: Path, model_id: str, users: int, max_tokens: int, threads: int) -> openai.OpenAI:
    net.start_bootstrap()
    procs = [net.start_peer(f"peer{i}", path, "--blocks", span, "--model-id", model_id, "--threads", str(threads),
                            "--cache-tokens", "32768", "--metrics-port", "0", wait=False)
             for i, span in enumerate(SPANS)]
    for proc in procs:
        net.wait_serving(proc, timeout=300)
    url = net.start_api("api", path, "--max-generations", str(users + 1), "--reuse-tokens", "0",
                        "--speculative-tokens", "0", "--max-tokens", str(max_tokens)).extra["url"]
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)


def measure(args, path: Path, model_id: str, tokenizer, local) -> dict:
    prompts = [prompt_ids(tokenizer, 1500 * i, args.prompt - 7 * i) for i in range(args.users)]
    long_prompt = prompt_ids(tokenizer, 50000, args.long_context)
    r: dict = {}
    log(f"transformers locally ({torch.get_num_threads()} threads)")
    local_run(local, [prompts[0][:64]], 4)  # warm-up
    if "long" in args.sections:
        r["long_local"], r["long_expected"] = local_run(local, [long_prompt], args.tokens)
    if "users" in args.sections:
        r["local_batch"], r["users_expected"] = local_run(local, prompts, args.tokens)
        r["local_one"], _ = local_run(local, prompts[:1], args.tokens)
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as root, LocalSwarm(Path(root)) as net:
        client = start(net, path, model_id, args.users, 4 * args.tokens, args.peer_threads)
        run_streams([Stream(client, model_id, prompts[0][:64], 4)])  # warm-up: routes measured, threads started
        if "long" in args.sections:
            s = Stream(client, model_id, long_prompt, args.tokens)
            run_streams([s])
            r["long_swarm"], r["long_same"] = s.step(), same_text([s], r["long_expected"], tokenizer)
            log(f"long: swarm step {r['long_swarm'] * 1e3:.1f} ms, local {r['long_local'] * 1e3:.1f} ms")
        if "users" in args.sections:
            one = Stream(client, model_id, prompts[0], args.tokens)
            run_streams([one])
            r["swarm_one"] = one.step()
            streams = [Stream(client, model_id, p, args.tokens) for p in prompts]
            run_streams(streams)
            r["swarm_users"], r["users_step"] = aggregate(streams)
            r["users_first"] = statistics.median(s.times[0] - s.sent for s in streams)
            r["users_same"] = same_text(streams, r["users_expected"], tokenizer)
            log(f"users: {r['swarm_users']:.1f} tokens/s, step {r['users_step'] * 1e3:.0f} ms; one user "
                f"{r['swarm_one'] * 1e3:.0f} ms; transformers {r['local_batch'] * 1e3:.0f} ms per batch step")
        if "prefill" in args.sections:
            r["prefill"] = prefill(client, model_id, tokenizer, prompts[-1], args)
            log(f"prefill: {r['prefill']}")
        if "memory" in args.sections:
            hidden = Checkpoint(path).hidden_size
            r["memory"] = memory(net, model_id, hidden, args.prompt, args.forks)
            log(f"memory: {r['memory']}")
    return r


def prefill(client, model_id: str, tokenizer, long_prompt: list[int], args) -> tuple[float, float, float, float]:
    """(their median step before, median during, longest during, the prompt's first-token time)."""
    short = [prompt_ids(tokenizer, 900 * i + 7, 32) for i in range(args.users - 1)]
    decoding = [Stream(client, model_id, p, 4 * args.tokens) for p in short]
    late = Stream(client, model_id, long_prompt, 4)
    threads = [threading.Thread(target=s.run) for s in decoding]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and min(len(s.times) for s in decoding) < args.tokens // 2:
        time.sleep(0.05)
    late.run()
    for t in threads:
        t.join(900)
    if late.error or any(s.error for s in decoding):
        raise RuntimeError(f"a stream failed: {late.error or next(s.error for s in decoding if s.error)!r}")
    before = [d for s in decoding for d in s.steps_between(0, late.sent)][-8 * len(decoding):]
    during = [d for s in decoding for d in s.steps_between(late.sent, late.times[0])]
    return statistics.median(before), statistics.median(during), max(during), late.times[0] - late.sent


def table(args, r: dict, theory: int) -> list[str]:
    lines = ["## The peer as an inference server: many users at once (demo model, 3 peers)", "",
             f"`python benchmarks/serving.py {' '.join(sys.argv[1:])}` on {machine()}, CPU flags: {cpu_flags()}. "
             f"SmolLM2-135M-Instruct; 3 peers [0:10) [10:20) [20:30), {args.peer_threads} compute thread(s) each, `swarm api` in front "
             "(no prompt reuse, no drafts); transformers in the benchmark's process with torch's threads, while "
             "the swarm idles. Greedy; medians.", "",
             "| target | measured | ratio | met |", "|---|---|---|---|"]

    def row(target: str, measured: str, ratio: float, ok: bool) -> None:
        lines.append(f"| {target} | {measured} | {ratio:.2f}x | {'yes' if ok else 'no'} |")

    if "long_swarm" in r:
        ratio = r["long_swarm"] / r["long_local"]
        row(f"one user at {args.long_context} tokens of context: decode step <= 1.3x transformers'",
            f"{r['long_swarm'] * 1e3:.1f} ms vs {r['long_local'] * 1e3:.1f} ms (same text: {r['long_same']}/1)",
            ratio, ratio <= 1.3)
    if "swarm_users" in r:
        local = args.users / r["local_batch"]
        one = 1 / r["swarm_one"]
        row(f"{args.users} users, ~{args.prompt}-token prompts: aggregate >= 1.0x transformers' padded batch",
            f"{r['swarm_users']:.1f} vs {local:.1f} tokens/s", r["swarm_users"] / local, r["swarm_users"] >= local)
        row(f"... and >= 4x one user's through the swarm (transformers' own: "
            f"{r['local_one'] / r['local_batch'] * args.users:.1f}x)",
            f"{r['swarm_users']:.1f} vs {one:.1f} tokens/s", r["swarm_users"] / one, r["swarm_users"] >= 4 * one)
    if "prefill" in r:
        before, during, longest, first = r["prefill"]
        row(f"{args.users - 1} users decoding while one sends a {args.prompt}-token prompt: steps <= 2x usual",
            f"{during * 1e3:.0f} ms during (longest {longest * 1e3:.0f}) vs {before * 1e3:.0f} ms before; its first "
            f"token after {first:.1f} s", during / before, during <= 2 * before)
    if "memory" in r:
        m = r["memory"]
        row(f"{args.forks} forks of one {args.prompt}-token prefix: the peer's memory <= 1.25x one copy",
            f"{m['all'] / 2**20:.1f} MiB vs {m['one'] / 2**20:.1f} MiB ({m['shared']:.0f} blocks shared)",
            m["all"] / m["one"], m["all"] <= 1.25 * m["one"])
        per_token = m["one"] / args.prompt
        row("memory per cached token within 10% of 2 x blocks x kv heads x head dim x 4 bytes",
            f"{per_token:,.0f} vs {theory:,} bytes", per_token / theory, abs(per_token / theory - 1) <= 0.1)
    if "swarm_users" in r:
        lines += ["", f"{args.users} users: each user's step {r['users_step'] * 1e3:.0f} ms while all decode (one user "
                  f"alone {r['swarm_one'] * 1e3:.0f} ms; transformers {r['local_batch'] * 1e3:.0f} ms per step of the "
                  f"batch, {r['local_one'] * 1e3:.0f} ms alone); their first token after {r['users_first']:.1f} s "
                  f"(median); same text as transformers: {r['users_same']}/{args.users}."]
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens of each user")
    ap.add_argument("--tokens", type=int, default=48, help="tokens each user streams")
    ap.add_argument("--long-context", type=int, default=2000)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--peer-threads", type=int, default=threads_per_peer(len(SPANS)),
                    help="compute threads of each peer (default: a share of the cores, as `swarm demo` gives)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    path, model_id, tokenizer, local = demo_model()
    r = measure(args, path, model_id, tokenizer, local)
    cfg = Checkpoint(path).text_config
    theory = 2 * 10 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # a peer: 10 blocks
    lines = table(args, r, theory)
    print("\n".join(lines) if args.no_write else write_section("serving", lines, args.out))
    return r


if __name__ == "__main__":
    main()
