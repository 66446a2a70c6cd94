"""The swarm benchmark, one command: a fresh local swarm against transformers in one process, written
into docs/benchmarks.md.

    python benchmarks/swarm_bench.py                    # every default section, ~6 min on 2 cores
    python benchmarks/swarm_bench.py --sections loopback --model demo --tokens 32 --runs 3
    python benchmarks/swarm_bench.py --smoke --out /tmp/bench.md   # tiny model, about a minute

Sections, each written between its own markers with the machine and the exact command:
- `loopback` (models `demo` and `large` by default): a bootstrap and peers on 127.0.0.1, the SDK in
  chained and relayed mode and transformers locally; greedy runs alternate between them. Time to
  first token, decode speed, per-hop overhead, bytes on the wire per token per hop, peer memory.
- `wan` (model `demo`): every peer behind its own delay proxy (`delay_proxy.py`) at each `--rtt-ms`;
  per-token decode time chained vs relayed, with a check that every client-peer and peer-peer
  connection crosses a proxy.
- `batching`: `peer_batching.py`'s own section, when that script is present.

Invariants:
- every process is started here (or by `LocalSwarm`) and stopped by PID whatever happens; the run ends
  by checking that none of them is left;
- the swarm's greedy tokens equal transformers' in every run, or the command fails before writing
  that section;
- timed runs read no counters: bytes come from one more, untimed run per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import shlex
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from bench_models import BenchModel, load, log, spans_of  # noqa: E402
from bench_probe import (StepTimer, TokenTimes, connection_audit, daemon_of, decode_bytes, info_ms,  # noqa: E402
                         memory)
from delay_proxy import ProxyProcess  # noqa: E402
from report import machine, write_section  # noqa: E402
from swarm.model.checkpoint import Checkpoint  # noqa: E402
from swarm.local.launch import LocalSwarm, pid_alive  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

MODES = ("chained", "relayed")
SECTION_MODELS = {"loopback": ("demo", "large"), "wan": ("demo",)}
RUNS = {"demo": (64, 5), "large": (32, 3), "tiny": (6, 2)}  # model -> (new tokens, runs) on loopback
WAN_RUNS = (32, 5)
CACHE_TOKENS = 4096
WARMUP_TOKENS = 4


# ---- the swarm and its clients ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Swarm:
    net: LocalSwarm
    peers: list[str]  # names, in route order
    proxy: ProxyProcess | None
    proxied: dict[str, int]  # peer name -> its proxy's listening port

    def peer_ids(self) -> list[str]:
        return [self.net.procs[p].peer_id for p in self.peers]


@contextlib.contextmanager
def swarm(model: BenchModel, spans: list[str], root: Path, started: set[int], proxied: bool):
    """A bootstrap and one peer per span; with `proxied`, each peer behind a delay proxy of its own."""
    net, proxy, ports = LocalSwarm(root), None, {}
    t0 = time.monotonic()
    try:
        net.start_bootstrap()
        names = [f"peer{i}" for i in range(len(spans))]
        if proxied:
            real = {name: free_port() for name in names}
            proxy = ProxyProcess(list(real.values()))
            started.add(proxy.popen.pid)
            ports = {name: proxy.ports[real[name]] for name in names}
        for name, span in zip(names, spans):
            extra = ["--port", str(real[name]), "--announce-port", str(ports[name])] if proxied else []
            net.start_peer(name, model.path, "--blocks", span, "--model-id", local_model_id(model.path),
                           "--cache-tokens", str(CACHE_TOKENS), *extra, wait=False)
        for name in names:
            net.wait_serving(net.procs[name], timeout=900)
        for proc in net.procs.values():
            started.update([proc.popen.pid, *proc.children()])
        log(f"swarm up in {time.monotonic() - t0:.0f} s: {len(spans)} peers serving {', '.join(spans)}"
            + (" behind delay proxies" if proxied else ""))
        yield Swarm(net, names, proxy, ports)
    finally:
        net.stop_all()
        if proxy is not None:
            proxy.close()


@contextlib.contextmanager
def clients(model: BenchModel, sw: Swarm, modes: list[str], started: set[int]):
    """One SDK model per mode, each with its own client node."""
    from client.model import DistributedModelForCausalLM

    remotes = {}
    try:
        for mode in modes:
            remotes[mode] = DistributedModelForCausalLM.from_pretrained(
                model.path, sw.net.bootstrap_addrs, model_id=local_model_id(model.path), chain=mode == "chained")
            started.add(remotes[mode].connection.node.daemon_pid)
        yield remotes
    finally:
        for remote in remotes.values():
            remote.close()


# ---- one generation ----

@dataclass
class Run:
    tokens: list[int]
    ttft_s: float
    tokens_per_s: float
    steps: list  # bench_probe.Step of every session step
    failovers: int = 0
    bytes: dict | None = None


def generate(model, ids: torch.Tensor, tokens: int, streamer) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, streamer=streamer)
    return out[0, ids.shape[1]:].tolist()


def run_local(local, ids: torch.Tensor, tokens: int) -> Run:
    times = TokenTimes()
    started = time.perf_counter()
    out = generate(local, ids, tokens, times)
    return Run(out, **times.stats(started), steps=[])


def run_remote(remote, ids: torch.Tensor, tokens: int, peers: list[str] = (), count_bytes: bool = False) -> Run:
    times = TokenTimes()
    with remote.inference_session(max_length=ids.shape[1] + tokens) as session:
        timer = StepTimer(session.session, remote.connection.node, peers, count_bytes)
        session.session = timer  # `generate` steps the active session: through the timer
        started = time.perf_counter()
        out = generate(remote, ids, tokens, times)
        stats = times.stats(started)
        last = remote.connection.run(timer.counters()) if count_bytes else None
        run = Run(out, **stats, steps=timer.steps, failovers=len(timer.inner.failovers))
    if count_bytes:
        run.bytes = decode_bytes(timer.snapshots[0], last)
    return run


def check_tokens(run: Run, reference: list[int], what: str) -> None:
    if run.tokens != reference:
        raise SystemExit(f"{what}: the swarm's greedy tokens differ from local transformers'\n"
                         f"  swarm: {run.tokens}\n  local: {reference}")


# ---- figures ----

def median(runs: list[Run], key: str) -> float:
    return statistics.median(getattr(r, key) for r in runs) if runs else math.nan


def hop_overhead_ms(runs: list[Run]) -> float:
    """Median over decode steps of (step time - the peers' compute) / hops."""
    per_hop = [(s.ms - s.compute_ms) / s.hops for r in runs for s in r.steps if s.tokens == 1 and s.hops]
    return statistics.median(per_hop) if per_hop else math.nan


def fmt(x: float, digits: int = 1) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def ms_per_token(runs: list[Run]) -> float:
    tps = median(runs, "tokens_per_s")
    return 1e3 / tps if tps and not math.isnan(tps) else math.nan


def ratio(a: float, b: float) -> str:
    return "–" if math.isnan(a) or math.isnan(b) or not b else f"{a / b:.2f}x"


def describe(model: BenchModel, spans: list[str]) -> str:
    served = ", ".join(f"[{s})" for s in spans)
    return f"{model.about[0].upper()}{model.about[1:]}; peers serve {served} as separate processes on 127.0.0.1"


# ---- sections ----

def loopback(model: BenchModel, spans: list[str], modes: list[str], tokens: int, runs: int, root: Path,
             started: set[int], command: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    ids = model.prompt
    results: dict[str, list[Run]] = {m: [] for m in (*modes, "local")}
    with swarm(model, spans, root / f"loopback-{model.name}", started, proxied=False) as sw:
        local = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
        with clients(model, sw, modes, started) as remotes:
            reference = run_local(local, ids, WARMUP_TOKENS).tokens  # warm-up: routes, pings, first calls
            for mode in modes:
                check_tokens(run_remote(remotes[mode], ids, WARMUP_TOKENS), reference, f"{mode} warm-up")
            for r in range(runs):
                results["local"].append(run_local(local, ids, tokens))
                reference = results["local"][0].tokens
                for mode in modes:
                    results[mode].append(run_remote(remotes[mode], ids, tokens))
                    check_tokens(results[mode][-1], reference, f"{model.name} {mode} run {r + 1}")
                log(f"{model.name} run {r + 1}/{runs}: " + ", ".join(
                    f"{k} {v[-1].tokens_per_s:.1f} tok/s" for k, v in results.items()))
            counted = {mode: run_remote(remotes[mode], ids, tokens, sw.peer_ids(), count_bytes=True)
                       for mode in modes}
            for mode, run in counted.items():
                check_tokens(run, reference, f"{model.name} {mode} counted run")
            mem = {name: memory(sw.net.procs[name]) for name in sw.peers}
        del local

    hops = len(spans)
    lines = [f"## Swarm vs transformers on loopback: {model.name} model, {hops} peers", "",
             f"`{command}` on {machine()}. {describe(model, spans)}; no added delay. Greedy, {tokens} new "
             f"tokens; {runs} runs of each row, alternated in one process; medians. The swarm's tokens equal local "
             "transformers' in every run.", "",
             "| | time to first token (ms) | decode tokens/s | decode ms/token | per-hop overhead (ms) | "
             "bytes/token/hop | of which peer to peer | failovers |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        rs, b = results[mode], counted[mode].bytes
        steps = len(counted[mode].steps) - 1  # decode steps after the prefill
        total = (b["client_sent"] + b["peers_sent"]) / steps / hops
        lines.append(f"| swarm, {mode} | {fmt(median(rs, 'ttft_s') * 1e3, 0)} | {fmt(median(rs, 'tokens_per_s'))} "
                     f"| {fmt(ms_per_token(rs))} | {fmt(hop_overhead_ms(rs), 2)} | {fmt(total, 0)} | "
                     f"{fmt(b['peer_to_peer'] / steps / hops, 0)} | {sum(r.failovers for r in rs)} |")
    loc = results["local"]
    lines.append(f"| transformers, local | {fmt(median(loc, 'ttft_s') * 1e3, 0)} | {fmt(median(loc, 'tokens_per_s'))} "
                 f"| {fmt(ms_per_token(loc))} | | | | |")
    lines.append("")
    per = {m: ms_per_token(results[m]) for m in modes}
    notes = [f"{m} / local {ratio(per[m], ms_per_token(loc))}" for m in modes]
    if len(modes) == 2:
        notes.insert(0, f"chained / relayed {ratio(per['chained'], per['relayed'])}")
    speed = [f"{m} {ratio(median(results[m], 'tokens_per_s'), median(loc, 'tokens_per_s'))}" for m in modes]
    lines += [f"Per-token decode time: {'; '.join(notes)}. Decode tokens/s vs local: {'; '.join(speed)}.", ""]
    for mode in modes:
        decode = [st for r in results[mode] for st in r.steps if st.tokens == 1 and st.hops]
        if decode:
            step_ms = statistics.median(st.ms for st in decode)
            compute = statistics.median(st.compute_ms for st in decode)
            lines.append(f"Where a {mode} decode token's {fmt(per[mode])} ms go (medians): the peers' compute "
                         f"{fmt(compute)} ms, the {hops} hops beyond compute {fmt(step_ms - compute)} ms, and the "
                         f"client's own work (embedding, head, sampling, `generate`) {fmt(per[mode] - step_ms)} ms.")
    lines += ["",
              "| peer | blocks | RSS (MiB) | peak RSS (MiB) | transport daemon RSS (MiB) |", "|---|---|---|---|---|"]
    for name, span in zip(sw.peers, spans):
        m = mem[name]
        lines.append(f"| {name} | [{span}) | {fmt(m['rss'], 0)} | {fmt(m['peak'], 0)} | {fmt(m['daemon'], 0)} |")
    return lines


def wan(model: BenchModel, spans: list[str], modes: list[str], rtts: list[float], tokens: int, runs: int,
        root: Path, started: set[int], command: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    ids = model.prompt
    local = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    reference = run_local(local, ids, tokens).tokens
    del local
    rows = []
    with swarm(model, spans, root / f"wan-{model.name}", started, proxied=True) as sw, \
            clients(model, sw, modes, started) as remotes:
        for rtt in rtts:
            sw.proxy.set_rtt(rtt)
            results: dict[str, list[Run]] = {m: [] for m in modes}
            for mode in modes:
                check_tokens(run_remote(remotes[mode], ids, WARMUP_TOKENS), reference[:WARMUP_TOKENS],
                             f"{mode} warm-up at {rtt:g} ms")
            for r in range(runs):
                for mode in modes:
                    results[mode].append(run_remote(remotes[mode], ids, tokens))
                    check_tokens(results[mode][-1], reference, f"{model.name} {mode} at {rtt:g} ms, run {r + 1}")
            first = remotes[modes[0]]
            info = statistics.median(first.connection.run(info_ms(first.connection.node, peer, 5))
                                     for peer in sw.peer_ids())
            rows.append((rtt, info, results))
            log(f"rtt {rtt:g} ms: info call {info:.1f} ms, " + ", ".join(
                f"{m} {ms_per_token(v):.1f} ms/token" for m, v in results.items()))
        daemons = {f"client ({m})": remotes[m].connection.node.daemon_pid for m in modes}
        daemons.update({name: daemon_of(sw.net.procs[name]) for name in sw.peers})
        audit = connection_audit(daemons, sw.proxied)
        proxy_stats = sw.proxy.stats()

    pairs = {tuple(sorted(p)) for p in audit["via_proxy"]}
    client_pairs = {p for p in pairs if any(n.startswith("client") for n in p)}
    peer_pairs = pairs - client_pairs
    want_clients, want_peers = len(modes) * len(spans), len(spans) * (len(spans) - 1) // 2
    direct = sorted({tuple(sorted(p)) for p in audit["direct"]})
    accepted = sum(f["connections"] for f in proxy_stats["forwards"])
    lines = [f"## Wide-area emulation: {model.name} model, {len(spans)} peers behind delay proxies", "",
             f"`{command}` on {machine()}. {describe(model, spans)}. Each peer listens on a fixed port behind a "
             "delay proxy of its own (`benchmarks/delay_proxy.py`, rtt/2 each way) and announces the proxy's "
             "port, so every connection between the client and a peer or between two peers crosses one proxy "
             f"and gains the added round trip. Greedy, {tokens} new tokens; {runs} runs per mode and delay, "
             "alternated; medians. The swarm's tokens equal local transformers' in every run. The info call is "
             "the client's `info` request to a peer, stream opening included.", "",
             "| added RTT (ms) | info call (ms) | " + " | ".join(f"{m} ms/token" for m in modes)
             + (" | chained / relayed" if len(modes) == 2 else "")
             + " | " + " | ".join(f"{m} per-hop overhead (ms)" for m in modes)
             + " | " + " | ".join(f"{m} time to first token (ms)" for m in modes) + " |",
             "|" + "---|" * (2 + 3 * len(modes) + (len(modes) == 2))]
    for rtt, info, results in rows:
        per = [ms_per_token(results[m]) for m in modes]
        lines.append(f"| {rtt:g} | {fmt(info)} | " + " | ".join(fmt(p) for p in per)
                     + (f" | {ratio(per[0], per[1])}" if len(modes) == 2 else "")
                     + " | " + " | ".join(fmt(hop_overhead_ms(results[m]), 2) for m in modes)
                     + " | " + " | ".join(fmt(median(results[m], "ttft_s") * 1e3, 0) for m in modes) + " |")
    if len(rows) > 1 and rows[-1][0] > rows[0][0]:
        (lo, _, low), (hi, _, high) = rows[0], rows[-1]
        slopes = [f"{m} {(ms_per_token(high[m]) - ms_per_token(low[m])) / (hi - lo):.2f}" for m in modes]
        lines += ["", f"Each ms of added round trip costs per token (slope from {lo:g} to {hi:g} ms): "
                  f"{'; '.join(slopes)} ms (ideal: chained 2, four one-way crossings; relayed 3, a round trip "
                  "per hop)."]
    lines += ["", f"Connections checked after the runs (established TCP connections of the transport daemons): "
              f"client–peer pairs through a proxy {len(client_pairs)} of {want_clients}, peer–peer pairs through a "
              f"proxy {len(peer_pairs)} of {want_peers}, direct connections between them {len(direct)}; the proxies "
              f"accepted {accepted} connections in all."]
    if direct:
        raise SystemExit(f"connections bypass the delay proxies: {direct}")
    return lines


def batching(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("peer_batching") is None:
        log("benchmarks/peer_batching.py is not there: skipping the batching section")
        return
    import peer_batching

    if args.out and not args.no_write:
        log("peer_batching.py writes only docs/benchmarks.md: with --out its section is printed instead")
    peer_batching.main(shlex.split(args.batching_args) + (["--no-write"] if args.no_write or args.out else []))


# ---- command line ----

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=("loopback", "wan", "batching"),
                    default=["loopback", "wan", "batching"])
    ap.add_argument("--model", nargs="+", choices=("demo", "large", "tiny"),
                    help="models of the loopback and wan sections (default: demo and large; wan: demo)")
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--peers", type=int, help="peers serving equal shares of the blocks")
    shape.add_argument("--blocks-each", type=int, help="peers of this many blocks each (the last may have fewer)")
    shape.add_argument("--spans", nargs="+", metavar="START:END", help="one span per peer, in route order")
    ap.add_argument("--tokens", type=int, help="new tokens per generation (default: per model and section)")
    ap.add_argument("--runs", type=int, help="timed runs per row (default: per model and section)")
    ap.add_argument("--rtt-ms", nargs="+", type=float, default=[0, 5, 20, 50, 100],
                    help="added round trips of the wan section (0: through the proxies, no delay)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--no-write", action="store_true", help="print the sections only")
    ap.add_argument("--out", type=Path, help="write the sections into this file instead of docs/benchmarks.md")
    ap.add_argument("--root", type=Path, help="directory for the swarm's logs (default: a temporary one)")
    ap.add_argument("--batching-args", default="", help="arguments passed on to peer_batching.main")
    ap.add_argument("--smoke", action="store_true",
                    help="the CI run: loopback and wan sections, tiny model, 2 peers, 6 tokens, 2 runs, rtt 0 "
                    "and 10 ms; writes only with --out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.peers, args.tokens, args.runs = args.model or ["tiny"], args.peers or 2, \
            args.tokens or 6, args.runs or 2
        args.rtt_ms = [0, 10] if "--rtt-ms" not in (argv or sys.argv) else args.rtt_ms
        # batching needs the demo model (tests/integration/test_peer_batching.py covers it in CI)
        args.sections = ["loopback", "wan"] if "--sections" not in (argv or sys.argv) else args.sections
        args.no_write = args.no_write or args.out is None
    for name in ("peers", "blocks_each", "tokens", "runs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


def spans_for(model: BenchModel, args: argparse.Namespace) -> list[str]:
    n = Checkpoint(model.path).num_blocks
    if args.spans:
        return list(args.spans)
    if args.peers:
        return list(spans_of(n, args.peers))
    if args.blocks_each:
        return [f"{a}:{min(a + args.blocks_each, n)}" for a in range(0, n, args.blocks_each)]
    return list(model.spans)


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    args = parse(argv)
    hf_logging.disable_progress_bar()  # progress of loading small checkpoints would drown the benchmark's
    command = "python benchmarks/swarm_bench.py" + "".join(f" {shlex.quote(a)}" for a in
                                                            (sys.argv[1:] if argv is None else argv))
    started: set[int] = set()
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = args.root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swarm-bench-")))
        try:
            for section in args.sections:
                if section == "batching":
                    batching(args)
                    continue
                for name in args.model or SECTION_MODELS[section]:
                    model = load(name, root)
                    spans = spans_for(model, args)
                    tokens, runs = WAN_RUNS if section == "wan" and name != "tiny" else RUNS[name]
                    tokens, runs = args.tokens or tokens, args.runs or runs
                    log(f"section {section}, model {name}: {len(spans)} peers, {tokens} tokens, {runs} runs")
                    if section == "loopback":
                        lines = loopback(model, spans, args.modes, tokens, runs, root, started, command)
                    else:
                        lines = wan(model, spans, args.modes, args.rtt_ms, tokens, runs, root, started, command)
                    marker = f"swarm_bench_{section}_{name}"
                    text = "\n".join(lines) if args.no_write else write_section(marker, lines, args.out)
                    print(text, flush=True)
        finally:
            left = sorted(p for p in started if p and pid_alive(p))
            deadline = time.monotonic() + 15  # daemons and reapers finish their exit
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = [p for p in left if pid_alive(p)]
    log(f"done in {time.monotonic() - t0:.0f} s; processes started: {len(started)}, left running: "
        f"{left or 'none'}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
