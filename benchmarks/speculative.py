"""Speculative decoding through the swarm: tokens/s of chat answers with prompt-lookup drafts and without,
on a copying task and an open-ended one, at each added round trip, next to transformers locally (plain and
with its own prompt lookup).

For each `--rtt-ms`, a fresh demo swarm: a bootstrap and 3 peers on 127.0.0.1 (with an added delay, each
peer behind a delay proxy of its own, `delay_proxy.py`), behind two gateways: one with `--speculative-tokens
0` (plain) and one with the default drafting. Each request is streamed with `max_tokens` tokens, greedy and
sampled (temperature 0.7, a fixed seed: the same text either way); tokens/s counts from the request to the last
token; runs interleaved, medians of `--runs`. The acceptance rate is the share of drafted tokens the model
kept (from `/metrics`). Writes its table into docs/benchmarks.md.

    python benchmarks/speculative.py [--runs 3] [--tokens 64] [--rtt-ms 0 50]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from delay_proxy import ProxyProcess  # noqa: E402
from report import demo_model, machine, write_section  # noqa: E402

TASKS = {
    "copying": "Rewrite this paragraph word for word: The old lighthouse stood at the edge of the cliff for more "
               "than a hundred years. Every night its keeper climbed the narrow stairs, lit the lamp and watched "
               "the ships pass safely through the dark and stormy water below.",
    "open-ended": "Write a short story about a robot who learns to paint.",
}


def drafted(api: str) -> dict[str, float]:
    with urllib.request.urlopen(api.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^swarm_api_drafted_tokens_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    return {outcome: float(value) for outcome, value in found}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def swarm(path: Path, model_id: str, rtt_ms: float):
    """The demo swarm (3 peers) and the two gateways; each peer behind a delay proxy when `rtt_ms`."""
    from client.demo import DEMO_CACHE_TOKENS, threads_per_peer
    from swarm.model.checkpoint import Checkpoint
    from swarm.local.launch import LocalSwarm
    from swarm.span import split_evenly

    with tempfile.TemporaryDirectory(prefix="swarm-spec-") as root, LocalSwarm(Path(root)) as net:
        proxy = None
        try:
            net.start_bootstrap()
            spans = split_evenly(Checkpoint(path).num_blocks, 3)
            names = [f"peer{i}" for i in range(len(spans))]
            extra = {name: [] for name in names}
            if rtt_ms:
                real = {name: free_port() for name in names}
                proxy = ProxyProcess(list(real.values()), rtt_ms=rtt_ms)
                extra = {n: ["--port", str(real[n]), "--announce-port", str(proxy.ports[real[n]])] for n in names}
            for name, span in zip(names, spans):
                net.start_peer(name, path, "--blocks", f"{span.start}:{span.end}", "--model-id", model_id,
                               "--dtype", "float32", "--threads", str(threads_per_peer(len(spans))),
                               "--cache-tokens", str(DEMO_CACHE_TOKENS), *extra[name], wait=False)
            for name in names:
                net.wait_serving(net.procs[name], timeout=300)
            yield {"plain": net.start_api("plain", path, "--speculative-tokens", "0").extra["url"],
                   "speculative": net.start_api("speculative", path).extra["url"]}
        finally:
            net.stop_all()
            if proxy is not None:
                proxy.close()


def main() -> int:
    import openai
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 50.0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path, model_id, tokenizer, local = demo_model()
    rates: dict[tuple, list[float]] = {}  # (rtt, task, mode, how) -> tokens/s
    kept: dict[tuple, list[float]] = {}  # (rtt, task, mode) -> [accepted, drafted]
    for rtt in args.rtt_ms:
        with swarm(path, model_id, rtt) as apis:
            clients = {k: openai.OpenAI(base_url=u, api_key="unused", max_retries=0, timeout=600)
                       for k, u in apis.items()}
            for run in range(args.runs + 1):  # the first round warms routes; not counted
                for task, text in TASKS.items():
                    messages = [{"role": "user", "content": text}]
                    if rtt == args.rtt_ms[0]:
                        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                            return_dict=True)["input_ids"]
                        for how in ("transformers", "transformers + prompt lookup"):
                            extra = {"prompt_lookup_num_tokens": 8} if "lookup" in how else {}
                            started = time.perf_counter()
                            with torch.no_grad():
                                out = local.generate(ids, attention_mask=torch.ones_like(ids),
                                                     max_new_tokens=args.tokens, do_sample=False, pad_token_id=0,
                                                     **extra)
                            if run:
                                rates.setdefault((None, task, "greedy", how), []).append(
                                    (out.shape[1] - ids.shape[1]) / (time.perf_counter() - started))
                    for mode, sampling in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=0.7, seed=7))):
                        texts = {}
                        for how, oai in clients.items():
                            before = drafted(apis[how])
                            started, count, pieces = time.perf_counter(), 0, []
                            for chunk in oai.chat.completions.create(model=model_id, messages=messages,
                                                                     max_tokens=args.tokens, stream=True,
                                                                     stream_options={"include_usage": True},
                                                                     **sampling):
                                if chunk.usage is not None:
                                    count = chunk.usage.completion_tokens
                                if chunk.choices:
                                    pieces.append(chunk.choices[0].delta.content or "")
                            texts[how] = "".join(pieces)
                            if run:
                                rates.setdefault((rtt, task, mode, how), []).append(
                                    count / (time.perf_counter() - started))
                                if how == "speculative":
                                    after = drafted(apis[how])
                                    tally = kept.setdefault((rtt, task, mode), [0.0, 0.0])
                                    tally[0] += after.get("accepted", 0) - before.get("accepted", 0)
                                    tally[1] += sum(after.values()) - sum(before.values())
                        if texts["plain"] != texts["speculative"]:
                            raise SystemExit(f"{task}, {mode}, {rtt:g} ms: the texts differ with and without drafts")
                    print(f"[spec] {rtt:g} ms, run {run} {task}: " + ", ".join(
                        f"{k[2]} {k[3]} {v[-1]:.1f}" for k, v in rates.items() if k[:2] in ((rtt, task), (None, task))
                        and v and run), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    lines = ["### Speculative decoding: prompt lookup through the swarm", "",
             f"Machine: {machine()}. Demo model on a bootstrap and 3 peers on 127.0.0.1 behind `swarm api` (with an "
             "added round trip: each peer behind a delay proxy of its own); chat answers of at most "
             f"{args.tokens} tokens streamed, greedy and sampled (temperature 0.7, seed 7: the same text with and "
             "without drafts, checked); tokens/s from the request to the last token, median of "
             f"{args.runs} interleaved runs; transformers locally in the same process, greedy "
             f"(`python benchmarks/speculative.py --runs {args.runs} --tokens {args.tokens} --rtt-ms "
             f"{' '.join(f'{r:g}' for r in args.rtt_ms)}`).", "",
             "| added round trip | task | sampling | swarm, plain | swarm, speculative | speculative vs plain | "
             "drafts kept | transformers | transformers + prompt lookup | speculative vs transformers + prompt "
             "lookup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rtt in args.rtt_ms:
        for task in TASKS:
            for mode in ("greedy", "sampled"):
                plain, spec = med[(rtt, task, mode, "plain")], med[(rtt, task, mode, "speculative")]
                accepted, total = kept.get((rtt, task, mode), (0, 0))
                local_row = ["", "", ""]
                if mode == "greedy" and (None, task, "greedy", "transformers") in med:
                    t, tl = med[(None, task, "greedy", "transformers")], med[(None, task, "greedy",
                                                                              "transformers + prompt lookup")]
                    local_row = [f"{t:.1f}", f"{tl:.1f}", f"{spec / tl:.2f}x"]
                lines.append(f"| {rtt:g} ms | {task} | {mode} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | "
                             f"{(accepted / total if total else 0):.0%} of {int(total)} | " + " | ".join(local_row)
                             + " |")
    print("\n".join(lines) if args.no_write else write_section("speculative", lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
