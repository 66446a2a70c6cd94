"""Weight formats and wire encodings on the demo model: quality, memory and speed, side by side.

Quality and cost (`quality`): for each weight format a bootstrap and three peer processes on 127.0.0.1
serve the demo model's blocks [0:10) [10:20) [20:30) in that format (`--dtype`, `--quant`; each with its
share of the machine's cores, `--threads`, as `swarm demo` starts them); the client
(float32 head, wire encodings chosen by default from the peers' formats) measures
- perplexity on the first `--ppl-tokens` tokens of tests/data/english.txt (one session step: the prompt's
  logits through the swarm, as a prefill travels);
- greedy agreement with the float32 swarm over `--prompts` prompts of `--tokens` new tokens each: prompts
  whose tokens are all the same, and the mean share of tokens before the first difference (the float32
  swarm itself is checked against transformers locally: it must agree on every prompt);
- memory per block: the weights of one block as loaded in that format (`SpanBlocks.weight_bytes`);
- decode tokens/s through the three peers (`--decode-tokens` greedy tokens, median of `--runs`), and the
  peers' compute per token (their live per-block decode cost times their blocks): the rest of a token's
  time is the client's float32 head (12 ms on the demo model), the hops and the processes' overhead.

Wire (`wire`): float32 peers, each behind a delay proxy of its own adding `--rtt-ms` and capping each
direction of every connection at `--rate-mbit`; for each encoding (the client's `--wire`/`--prefill-wire`):
time to first token of a `--long-prompt`-token prompt (median of `--runs`), bytes per token per hop of
decode steps and bytes per hop of the prefill (everything every process wrote, from the peers' and the
client's wire counters, over the hops), and whether the greedy tokens equal the float32 wire's.

    python benchmarks/precision.py [--sections quality wire] [--formats float32 bfloat16 int8]

Writes its tables into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from delay_proxy import ProxyProcess  # noqa: E402
from report import machine, write_section  # noqa: E402

from client.cli import TimedStreamer  # noqa: E402
from client.demo import DEMO_CACHE_TOKENS, threads_per_peer  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402
from swarm.span import Span  # noqa: E402

TEXT = REPO / "tests" / "data" / "english.txt"
SPANS = ["0:10", "10:20", "20:30"]
FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"),
           "float16": ("float16", "none"), "nf4": ("bfloat16", "nf4")}
GPU_FORMATS = {**FORMATS, "int8": ("float16", "int8")}  # bitsandbytes' int8 computes in 16 bits
ENCODINGS = {"float32": ("float32", "float32"), "float16": ("float16", "float16"), "8-bit": ("int8", "int8")}
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in our solar system is",
    "def fibonacci(n):", "import numpy as np\n\narr =", "Once upon a time, in a small village,",
    "The three primary colors are", "To make a cup of tea, first", "Photosynthesis is the process by which",
    "The main difference between a list and a tuple in Python is", "In 1969, the first humans",
    "A good way to learn a new language is", "The quick brown fox", "SELECT name FROM users WHERE",
    "The heart pumps blood through", "My favourite recipe for pancakes:", "The theory of relativity states that",
    "Dear hiring manager,", "The stock market is", "Here is a haiku about autumn:",
]


def log(message: str) -> None:
    print(f"[precision] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def swarm(path: Path, peer_args: list[str], rtt_ms: float = 0.0, rate_mbit: float = 0.0):
    """A bootstrap and three peers; with a delay (or rate), each peer behind a delay proxy of its own."""
    with tempfile.TemporaryDirectory(prefix="swarm-precision-") as root, LocalSwarm(Path(root)) as net:
        proxy, names = None, [f"peer{i}" for i in range(len(SPANS))]
        try:
            net.start_bootstrap()
            extra = {name: [] for name in names}
            if rtt_ms or rate_mbit:
                real = {name: free_port() for name in names}
                proxy = ProxyProcess(list(real.values()), rtt_ms=rtt_ms, rate_mbit=rate_mbit)
                extra = {n: ["--port", str(real[n]), "--announce-port", str(proxy.ports[real[n]])] for n in names}
            for name, span in zip(names, SPANS):
                net.start_peer(name, path, "--blocks", span, "--model-id", local_model_id(path), "--cache-tokens",
                               str(DEMO_CACHE_TOKENS), "--threads", str(threads_per_peer(len(SPANS))), *peer_args,
                               *extra[name], wait=False)
            for name in names:
                net.wait_serving(net.procs[name], timeout=600)
            yield net
        finally:
            net.stop_all()
            if proxy is not None:
                proxy.close()


def client(net: LocalSwarm, path: Path, **options):
    from client.model import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=local_model_id(path),
                                                       **options)


def greedy(model, tokenizer, prompt: str, tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def perplexity(model, ids: torch.Tensor) -> float:
    with model.inference_session(max_length=ids.shape[1]) as session:
        logits = session.step(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:].to(logits.device))
    return math.exp(float(nll))


def decode_rate(model, tokenizer, tokens: int, runs: int) -> float:
    ids = tokenizer("Give three tips for staying healthy.", return_tensors="pt").input_ids
    rates = []
    for _ in range(runs):
        streamer = TimedStreamer(tokenizer, out=io.StringIO())
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0, streamer=streamer)
        rates.append(streamer.stats(started)["tokens_per_s"])
    return statistics.median(rates)


def peers_compute_ms(model, net: LocalSwarm) -> float:
    """A decode token's compute in all peers together: each peer's live per-block decode cost (`info`'s
    `block_ms`, a moving average of its real steps) times its blocks."""
    from swarm.net.calls import info

    async def peers():
        return [await info(model.connection.client.node, net.procs[n].peer_id) for n in net.procs
                if n.startswith("peer")]

    return sum((i.block_ms or 0.0) * (i.end - i.start) for i in model.connection.run(peers()))


def block_bytes(path: Path, dtype: str, quant: str, device: str) -> int:
    from swarm.model.blocks import SpanBlocks
    from swarm.model.precision import resolve_device

    return SpanBlocks(path, Span(0, 1), dtype, resolve_device(device), quant=quant).weight_bytes()


def agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    same = sum(g == r for g, r in zip(got, ref))
    prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) / len(r) for g, r in zip(got, ref)]
    return same, statistics.mean(prefix)


def quality(path: Path, args) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt").input_ids[:, :args.ppl_tokens]
    prompts = PROMPTS[:args.prompts]
    # the ground truth computes where the swarm does: float32 on another device may round a near tie apart
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    with torch.no_grad():
        expected = [greedy(local, tokenizer, p, args.tokens) for p in prompts]
        local_ppl = math.exp(float(local(ids.to(local.device), labels=ids.to(local.device)).loss))
    del local
    rows, ref = [], None
    formats = GPU_FORMATS if args.device.startswith("cuda") else FORMATS
    for name in args.formats:
        dtype, quant = formats[name]
        log(f"{name}: 3 peers with --device {args.device} --dtype {dtype} --quant {quant}")
        with swarm(path, ["--device", args.device, "--dtype", dtype, "--quant", quant]) as net, \
                client(net, path, device=args.head_device or args.device) as model:
            ppl = perplexity(model, ids)
            got = [greedy(model, tokenizer, p, args.tokens) for p in prompts]
            rate = decode_rate(model, tokenizer, args.decode_tokens, args.runs)
            compute_ms = peers_compute_ms(model, net)
        if name == "float32":
            ref = got
            same_local = agreement(got, expected)[0]
            log(f"float32 swarm vs transformers locally: {same_local}/{len(prompts)} prompts identical")
            # on the CPU the swarm's float32 is transformers' to the bit; a GPU's kernels may differ with the
            # shapes of the work (a span of blocks, not the whole model), so there it is reported, not required
            if same_local != len(prompts) and args.device == "cpu":
                raise SystemExit("the float32 swarm does not give transformers' tokens: see the log")
        rows.append(dict(name=name, ppl=ppl, got=got, rate=rate, bytes=block_bytes(path, dtype, quant, args.device),
                         compute=compute_ms))
        log(f"{name}: perplexity {ppl:.3f}, {rate:.1f} tokens/s")
    base = next(r for r in rows if r["name"] == "float32")
    where = "" if args.device == "cpu" else f" on {args.device} ({torch.cuda.get_device_name()})"
    head = args.head_device or args.device
    head_where = "" if head == args.device else f" on {head}"
    lines = [f"### Precision: weight formats on the demo model{where}", "",
             f"{machine()}; demo model (SmolLM2-135M-Instruct), 3 peers{where} on 127.0.0.1 ([0:10) [10:20) "
             f"[20:30)), float32 head{head_where}, wire encodings by default; perplexity over the first {ids.shape[1]} tokens of "
             f"`tests/data/english.txt` (transformers locally, float32: {local_ppl:.3f}; greedy tokens identical to "
             f"it on {same_local}/{len(prompts)} prompts); agreement over "
             f"{len(prompts)} prompts x {args.tokens} greedy tokens against the float32 swarm; decode: "
             f"{args.decode_tokens} tokens, median of {args.runs}.", "",
             "| weights | perplexity | vs float32 | prompts identical | mean prefix matched | memory per block | "
             "vs float32 | decode tokens/s | vs float32 | peers' compute per token | vs float32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same, prefix = agreement(r["got"], ref)
        lines.append(f"| {r['name']} | {r['ppl']:.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f}% | "
                     f"{same}/{len(prompts)} | {100 * prefix:.0f}% | {r['bytes'] / 2**20:.2f} MiB | "
                     f"{r['bytes'] / base['bytes']:.2f}x | {r['rate']:.1f} | {r['rate'] / base['rate']:.2f}x | "
                     f"{r['compute']:.1f} ms | {base['compute'] / r['compute']:.2f}x faster |")
    return lines


def traffic(model, net: LocalSwarm) -> int:
    """Bytes every process of the swarm and this client wrote so far."""
    from swarm.net import wire
    from swarm.net.calls import info

    async def peers():
        return [await info(model.connection.client.node, net.procs[n].peer_id) for n in net.procs
                if n.startswith("peer")]

    return wire.traffic()["sent"] + sum(i.wire_bytes.get("sent", 0) for i in model.connection.run(peers()))


def wire_table(path: Path, args) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    words = TEXT.read_text()
    long_ids = tokenizer(words, return_tensors="pt").input_ids[:, :args.long_prompt]
    rows = []
    with swarm(path, ["--dtype", "float32"], rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit) as net:
        for name, (decode, prefill) in ENCODINGS.items():
            with client(net, path, wire=decode, prefill_wire=prefill) as model:
                kw = dict(attention_mask=torch.ones_like(long_ids), do_sample=False, pad_token_id=0)
                model.generate(long_ids, max_new_tokens=1, **kw)  # warm: routes measured, streams open
                reading = -traffic(model, net) + traffic(model, net)  # what reading the counters itself costs
                ttfts, before = [], traffic(model, net)
                for _ in range(args.runs):
                    started = time.perf_counter()
                    model.generate(long_ids, max_new_tokens=1, **kw)
                    ttfts.append(time.perf_counter() - started)
                prefill_bytes = (traffic(model, net) - before - reading) / args.runs
                before = traffic(model, net)
                out = model.generate(long_ids, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, **kw)
                decode_bytes = (traffic(model, net) - before - reading - prefill_bytes) / args.tokens
            hops = len(SPANS)
            rows.append(dict(name=name, ttft=statistics.median(ttfts), prefill=prefill_bytes / hops,
                             decode=decode_bytes / hops, tokens=out[0, long_ids.shape[1]:].tolist()))
            log(f"{name}: first token {rows[-1]['ttft'] * 1e3:.0f} ms, {rows[-1]['decode']:.0f} B/token/hop")
    base = rows[0]
    lines = ["### Precision: hidden states on the wire", "",
             f"{machine()}; demo model, 3 float32 peers each behind a delay proxy adding {args.rtt_ms:g} ms round "
             f"trip and capping each direction of every connection at {args.rate_mbit:g} Mbit/s; a "
             f"{long_ids.shape[1]}-token prompt (time to first token: median of {args.runs}); decode bytes over "
             f"{args.tokens} tokens; bytes are everything the client and the peers wrote, per hop.", "",
             "| wire (decode / prefill) | time to first token | vs float32 | prefill bytes per hop | vs float32 | "
             "decode bytes per token per hop | vs float32 | same greedy tokens as float32 wire |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        decode, prefill = ENCODINGS[r["name"]]
        lines.append(f"| {decode} / {prefill} | {r['ttft'] * 1e3:.0f} ms | {r['ttft'] / base['ttft']:.2f}x | "
                     f"{r['prefill'] / 2**20:.2f} MiB | {r['prefill'] / base['prefill']:.2f}x | {r['decode']:.0f} B | "
                     f"{r['decode'] / base['decode']:.2f}x | {'yes' if r['tokens'] == base['tokens'] else 'no'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=["quality", "wire"], choices=["quality", "wire"])
    parser.add_argument("--formats", nargs="*", default=["float32", "bfloat16", "int8"], choices=list(FORMATS))
    parser.add_argument("--device", default="cpu", help="the peers' and the client head's device (cpu, cuda, ...)")
    parser.add_argument("--head-device", help="the client head's device, if not --device's")
    parser.add_argument("--section-suffix", default="", help="written between markers precision-SECTION+SUFFIX")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt, and decode tokens whose "
                        "bytes the wire section counts")
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave docs/benchmarks.md as is")
    args = parser.parse_args()
    if "float32" not in args.formats:
        args.formats.insert(0, "float32")
    args.formats.sort(key=lambda f: f != "float32")
    torch.set_num_threads(2)
    path = prepare_demo_model(default_demo_dir(cache_home()))
    for section, build in (("quality", quality), ("wire", wire_table)):
        if section in args.sections:
            lines = build(path, args)
            print("\n".join(lines) + "\n")
            if not args.no_write:
                write_section(f"precision-{section}{args.section_suffix}", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
