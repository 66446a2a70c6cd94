"""Speculative decoding through the swarm: tokens/s of greedy chat answers with prompt-lookup drafts and
without, on a copying task and an open-ended one, next to transformers locally (plain and with its own
prompt lookup).

The demo model on a bootstrap and 3 peers on 127.0.0.1 (no added delay), behind two gateways: one with
`--speculative-tokens 0` (plain) and one with the default drafting. Each request is streamed at temperature
0 with `max_tokens` tokens; tokens/s counts from the request to the last token; runs interleaved, medians of
`--runs`. The acceptance rate is the share of drafted tokens the model kept (from `/metrics`). Writes its
table into docs/benchmarks.md.

    python benchmarks/speculative.py [--runs 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from report import machine, write_section  # noqa: E402

TASKS = {
    "copying": "Rewrite this paragraph word for word: The old lighthouse stood at the edge of the cliff for more "
               "than a hundred years. Every night its keeper climbed the narrow stairs, lit the lamp and watched "
               "the ships pass safely through the dark and stormy water below.",
    "open-ended": "Write a short story about a robot who learns to paint.",
}


def drafted(api: str) -> dict[str, float]:
    with urllib.request.urlopen(api.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {o: float(v) for o, v in re.findall(r'^swarm_api_drafted_tokens_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def main() -> int:
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from client.demo import start_swarm
    from swarm.cli import cache_home
    from swarm.demo_model import default_demo_dir, prepare_demo_model
    from swarm.launch import LocalSwarm
    from swarm.records import default_model_id

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    model_id = default_model_id(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rates: dict[tuple[str, str], list[float]] = {}
    accepted: dict[str, list[float]] = {task: [0.0, 0.0] for task in TASKS}
    with tempfile.TemporaryDirectory(prefix="swarm-spec-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", model_id)
        apis = {"plain": net.start_api("plain", path, "--speculative-tokens", "0").extra["url"],
                "speculative": net.start_api("speculative", path).extra["url"]}
        clients = {k: openai.OpenAI(base_url=u, api_key="unused", max_retries=0, timeout=300) for k, u in apis.items()}
        for run in range(args.runs + 1):  # the first round warms routes; not counted
            for task, text in TASKS.items():
                messages = [{"role": "user", "content": text}]
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
                for how in ("transformers", "transformers + prompt lookup"):
                    extra = {"prompt_lookup_num_tokens": 8} if "lookup" in how else {}
                    started = time.perf_counter()
                    with torch.no_grad():
                        out = local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                             do_sample=False, pad_token_id=0, **extra)
                    if run:
                        rates.setdefault((task, how), []).append((out.shape[1] - ids.shape[1]) /
                                                                 (time.perf_counter() - started))
                for how, oai in clients.items():
                    before = drafted(apis[how])
                    started, count = time.perf_counter(), 0
                    for chunk in oai.chat.completions.create(model=model_id, messages=messages, temperature=0,
                                                             max_tokens=args.tokens, stream=True,
                                                             stream_options={"include_usage": True}):
                        if chunk.usage is not None:
                            count = chunk.usage.completion_tokens
                    if run:
                        rates.setdefault((task, f"swarm, {how}"), []).append(count / (time.perf_counter() - started))
                        if how == "speculative":
                            after = drafted(apis[how])
                            accepted[task][0] += after.get("accepted", 0) - before.get("accepted", 0)
                            accepted[task][1] += sum(after.values()) - sum(before.values())
                print(f"[spec] run {run} {task}: " + ", ".join(f"{k[1]} {v[-1]:.1f}" for k, v in rates.items()
                                                              if k[0] == task and v), file=sys.stderr, flush=True)
    lines = ["### Speculative decoding: prompt lookup through the swarm", "",
             f"Machine: {machine()}. Demo model on a bootstrap and 3 peers on 127.0.0.1 (no added delay) behind "
             f"`swarm api`, greedy chat answers of at most {args.tokens} tokens streamed; tokens/s from the request "
             f"to the last token, median of {args.runs} interleaved runs; transformers locally in the same process "
             "(`benchmarks/speculative.py`).", "",
             "| task | transformers | transformers + prompt lookup | swarm, plain | swarm, speculative | "
             "speculative vs plain | drafts kept |", "|---|---|---|---|---|---|---|"]
    for task in TASKS:
        med = {how: statistics.median(v) for (t, how), v in rates.items() if t == task}
        kept, total = accepted[task]
        lines.append(f"| {task} | {med['transformers']:.1f} | {med['transformers + prompt lookup']:.1f} | "
                     f"{med['swarm, plain']:.1f} | {med['swarm, speculative']:.1f} | "
                     f"{med['swarm, speculative'] / med['swarm, plain']:.2f}x | "
                     f"{(kept / total if total else 0):.0%} of {int(total)} |")
    print("\n".join(lines) if args.no_write else write_section("speculative", lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
