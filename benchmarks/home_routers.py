"""Volunteers behind home routers, measured in an internet in a box (`tests/netbox.py`): who reaches whom,
how long a peer takes to serve, and what relayed hops cost a generation.

    python benchmarks/home_routers.py [--runs 3] [--tokens 32] [--prompt-tokens 1000] [--cap-mbit 20]
                                      [--parts matrix routes] [--root DIR] [--no-write]

Both parts run the demo model (SmolLM2-135M-Instruct, 30 blocks) in float32, every process in a host of the
box: public hosts on one segment, homes each behind a router doing masquerade that drops what comes in
unasked (and, where said, an uplink capped with `tc`).

- `matrix`: a bootstrap, 2 public peers and 3 NAT'd peers (started one after another, each timed from its
  start to its `reachability`, `reachable through relay` and `serving blocks` log lines), and 2 NAT'd
  clients. Then, for every ordered pair of these 8 nodes, a stream is opened by the first node's own
  transport daemon to the second (the way the swarm's `Node.open` opens one: by peer id, the daemon
  finding the way) and the connection it ends up on is classified: *direct*, *hole-punched* (both ends
  NAT'd and yet a direct connection), *relayed* (`/p2p-circuit`) or *failed*. The daemons are reached from
  this process through their control sockets (hivemind's `P2P.replicate`), and answer on a probe protocol
  registered for the run.
- `routes`: 3 public peers and 3 NAT'd peers, each triple serving [0:10), [10:20), [20:30), and a NAT'd
  client; routes of 3 peers pinned with `allow_peers`: all public, all NAT'd (relayed), mixed (public,
  NAT'd, public). Each run: a decode run (the chat prompt, `--tokens` new tokens, greedy) and a prefill run
  (a `--prompt-tokens` prompt, 2 new tokens), with every home's uplink uncapped and capped at
  `--cap-mbit`, alternated. Decode tokens/s and per-hop overhead as in `swarm_bench.py` (the client's step
  time less the peers' reported compute, per hop, over one-token steps); prefill time is the time to the
  first token of the long prompt. Medians over `--runs`. Greedy tokens must equal local transformers' in
  every run, or the command fails. The links each route ended on are classified as in `matrix`.

Needs root (network namespaces), `ip`, `nft` and `tc`. A full run takes about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

from box_links import Daemons, End, SlotWatch, carrier, identify, kind  # noqa: E402
from box_swarm import note_lines, wait_until  # noqa: E402
from swarm.net.presence import PUNCH_AT_S  # noqa: E402

PEER_OPTIONS = ("--cache-tokens", "4096", "--announce-interval", "5", "--record-ttl", "20")
START_S = 300  # one peer's start on a busy 2-core machine
REACH_S = 20  # after serving, a NAT'd peer's relay slot (logged within a second or two when it comes)
RUN_S = 300  # one generation, or a client's join
CAPPED_S = 600


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- the client, inside the box ----

def worker(argv: list[str]) -> int:
    """`--worker`: a client in its own namespace. Joins, says `ready`, then runs what stdin asks, one JSON
    command a line ({"prompt": ids, "tokens": n}), answering one JSON line each; `quit` (or EOF) ends it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--allow-peers", nargs="*", default=[])
    args = parser.parse_args(argv)
    import torch

    from bench_probe import StepTimer, TokenTimes
    from client.model import DistributedModelForCausalLM

    def say(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    started = time.monotonic()
    try:
        model = DistributedModelForCausalLM.from_pretrained(args.model, args.initial_peers, model_id=args.model_id,
                                                            allow_peers=tuple(args.allow_peers), verify_fraction=0)
    except Exception as e:  # boundary: the parent reports it
        say("error", message=f"{type(e).__name__}: {e}")
        return 1
    say("ready", join_s=time.monotonic() - started)
    with model:
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            ids = torch.tensor([command["prompt"]])
            times = TokenTimes()
            try:
                with model.inference_session(max_length=ids.shape[1] + command["tokens"]) as session:
                    timer = StepTimer(session.session)
                    session.session = timer
                    begun = time.perf_counter()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=command["tokens"],
                                         min_new_tokens=command["tokens"], do_sample=False, pad_token_id=0,
                                         streamer=times)
                    say("run", tokens=out[0, ids.shape[1]:].tolist(), **times.stats(begun),
                        steps=[[s.tokens, s.ms, s.compute_ms, s.hops] for s in timer.steps],
                        route=[[h.peer, str(h.span)] for h in session.route],
                        failovers=len(timer.inner.failovers))
            except Exception as e:  # boundary: one failed run is reported, the next may work
                say("error", message=f"{type(e).__name__}: {e}")
    return 0


class Worker:
    """The parent's side of a `--worker` process."""

    def __init__(self, sw, name: str, host, model: Path, model_id: str, initial: list[str], allow: list[str] = ()):
        from box_swarm import ClientRun

        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model), "--model-id",
                model_id, "--initial-peers", *initial, "--allow-peers", *allow]
        self.proc = sw.spawn(name, host, argv, client=True)
        self.events = ClientRun(self.proc)

    def ready(self) -> float:
        event = self.events.expect("ready", RUN_S)
        if event["event"] != "ready":
            raise RuntimeError(f"{self.proc.name} did not join: {event}\n{self.proc.tail()}")
        return event["join_s"]

    def run(self, prompt: list[int], tokens: int, timeout: float = RUN_S) -> dict:
        try:
            self.proc.popen.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
            self.proc.popen.stdin.flush()
        except OSError:
            return {"event": "error", "message": f"{self.proc.name} exited\n{self.proc.tail()}"}
        return self.events.expect("run", timeout)

    def quit(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.popen.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.popen.stdin.flush()


# ---- the box ----

@contextlib.contextmanager
def boxed(root: Path, model: Path, model_id: str, between_ms: float = 0.0):
    """A box and a swarm in it; with `between_ms`, two regions (`eu`, `us`: 2 ms one way within each)."""
    from box_swarm import BoxSwarm
    from netbox import Box

    regions = {"eu": 2.0, "us": 2.0} if between_ms else {}
    with Box(regions=regions, between_ms=between_ms) as box:
        sw = BoxSwarm(box, root, model, model_id, PEER_OPTIONS)
        try:
            yield box, sw
        except BaseException:
            log("failed; the processes' last lines:\n" + sw.diagnostics())
            raise


LINES = ("reachability: \\w+", "reachable through relay", "serving blocks")


def reachability(proc) -> str:
    found = re.search(r"reachability: (\w+)", proc.text())
    return found.group(1) if found else "–"


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


# ---- part 1: the connectivity matrix ----

MATRIX_PEERS = (("pub1", True, "0:15"), ("pub2", True, "15:30"), ("nat1", False, "0:10"), ("nat2", False, "10:20"),
                ("nat3", False, "20:30"))
LETTER = {"direct": "D", "hole-punched": "H", "relayed": "R", "failed": "✗"}


def matrix_peers(extra_public: int) -> tuple:
    """The matrix's peers: `MATRIX_PEERS` with `extra_public` more public peers (serving [0:15)) before the NAT'd."""
    extra = tuple((f"pub{i}", True, "0:15") for i in range(3, 3 + extra_public))
    return MATRIX_PEERS[:2] + extra + MATRIX_PEERS[2:]


def matrix(args, model: Path, model_id: str, root: Path) -> list[str]:
    where = {}  # host name -> region, with distances: eu and us in turn

    def region(name: str) -> dict:
        if not args.between_ms:
            return {}
        where[name] = ("eu", "us")[len(where) % 2]
        return {"region": where[name]}

    with boxed(root / "matrix", model, model_id, args.between_ms) as (box, sw):
        boot = sw.bootstrap(box.public("boot", **region("bootstrap")))
        peers = []
        for name, public, blocks in matrix_peers(args.extra_public):
            if not public and args.extra_public and not any(not p.host.public for p in peers):
                # the NAT'd peers learn of every public peer from the bootstrap (their relay candidates, which they
                # dial: each connection's far end tells the daemon its outside address, which it must hear from 4
                # distinct hosts before it punches holes)
                met = root / "matrix" / "bootstrap" / "identity.key.known-peers.json"
                wait_until(lambda: met.exists() and all(p.peer_id in met.read_text() for p in peers), 150,
                           "the bootstrap to remember the public peers")
            host = box.public(name, **region(name)) if public else box.home(name, **region(name))
            proc = sw.peer(name, host, blocks, [boot.addr])
            slot = SlotWatch(proc)
            note_lines([proc], LINES, lambda: [slot(), "serving blocks" in proc.extra or not proc.alive()][1], START_S)
            if "serving blocks" not in proc.extra:
                raise RuntimeError(f"{name} did not serve within {START_S} s\n{proc.tail()}")
            if not public:
                note_lines([proc], LINES, lambda: slot() and "reachable through relay" in proc.extra, REACH_S)
            log(f"{name}: {reachability(proc)}, serving after {proc.extra['serving blocks']:.1f} s")
            peers.append(proc)
        # each NAT'd peer closes its relayed connections once, PUNCH_AT_S after its start, so that they open again
        # when its daemon can punch holes (swarm.net.presence.reopen): the clients come after that
        time.sleep(max(0.0, PUNCH_AT_S + 5 - (time.monotonic() - max(p.started for p in peers))))
        clients = [Worker(sw, name, box.home(name, **region(name)), model, model_id, [boot.addr])
                   for name in ("cli1", "cli2")]
        for w in clients:
            w.ready()
        nodes = [End("bootstrap", boot.peer_id, False, boot.popen.pid)]
        nodes += [End(p.name, p.peer_id, not p.host.public, p.popen.pid) for p in peers]
        nodes += [End(w.proc.name, asyncio.run(identify(w.proc.popen.pid)), True, w.proc.popen.pid) for w in clients]
        results = asyncio.run(probe_all(nodes, args.open_timeout, args.punch_wait, args.fresh_links))
        for w in clients:
            w.quit()
    return matrix_report(args, nodes, peers, results, where)


async def probe_all(nodes: list[End], timeout: float, punch_wait: float, fresh: bool = False) -> dict:
    """For every ordered pair: the probe's time and error, and the link right after it and `punch_wait` later.
    `fresh`: a connection between two NAT'd ends is closed before its probe (a relayed connection is punched
    only when it opens, and the swarm's own traffic opened most before the daemons could punch)."""
    from swarm.net.dht_glue import hm

    out = {}
    async with Daemons(nodes) as daemons:
        for a in nodes:
            for b in nodes:
                if a is not b:
                    if fresh and a.nat and b.nat:
                        with contextlib.suppress(Exception):  # not connected: nothing to close
                            await a.p2p._client.disconnect(hm().PeerID.from_base58(b.peer_id))
                    ms, error = await daemons.probe(a, b, timeout)
                    addrs = await daemons.addrs(a, b)
                    out[a, b] = {"ms": ms, "error": error, "over": carrier(addrs),
                                 "at_open": kind(a, b, addrs) if ms is not None else "failed"}
        await asyncio.sleep(punch_wait)  # a relayed connection between two NAT'd nodes may be upgraded meanwhile
        for (a, b), row in out.items():
            row["final"] = await daemons.link(a, b) if row["ms"] is not None else "failed"
    return {(a.name, b.name): row for (a, b), row in out.items()}


def matrix_report(args, nodes: list[End], peers: list, results: dict, regions: dict | None = None) -> list[str]:
    names = [n.name for n in nodes]
    where = {n.name: ("NAT'd" if n.nat else "public") + (f", {regions[n.name]}" if regions else "") for n in nodes}
    if regions:  # pairs are counted by kind of ends and whether they share a region
        kinds = {n.name: "NAT'd" if n.nat else "public" for n in nodes}
        pair_of = {(a, b): f"{kinds[a]} → {kinds[b]}, {'same region' if regions[a] == regions[b] else 'across'}"
                   for a in names for b in names}
    else:
        pair_of = {(a, b): f"{where[a]} → {where[b]}" for a in names for b in names}
    distances = (f" Two regions, eu and us, 2 ms one way within each and {args.between_ms:g} ms between, the "
                 "nodes in each in turn." if regions else "")
    command = "--parts matrix" + (f" --between-ms {args.between_ms:g}" if regions else "") + \
        (f" --extra-public {args.extra_public}" if args.extra_public else "")
    waited = " (the NAT'd ones once the bootstrap remembered the public ones)" if args.extra_public else ""
    lines = [f"`python benchmarks/home_routers.py {command}` on {machine_line()}. The demo model; a "
             f"bootstrap, {2 + args.extra_public} public peers and 3 NAT'd peers started one after another{waited}, "
             "then 2 NAT'd clients, each "
             f"NAT'd node behind a router of its own (masquerade, nothing in unasked).{distances} For every ordered pair, the "
             "first node's transport daemon opens a stream to the second by peer id and a byte is echoed; the "
             f"connection it ends on, {args.punch_wait:.0f} s later: **D** direct, **H** hole-punched (both "
             "NAT'd, direct), **R** relayed (`/p2p-circuit`), **✗** failed "
             f"(no echo within {args.open_timeout:.0f} s).", "",
             "| from \\ to | " + " | ".join(f"{n} ({where[n]})" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for a in names:
        cells = ["·" if a == b else LETTER[results[a, b]["final"]] for b in names]
        lines.append(f"| {a} ({where[a]}) | " + " | ".join(cells) + " |")
    counts: dict[str, dict[str, int]] = {}
    for (a, b), row in results.items():
        pair = pair_of[a, b]
        counts.setdefault(pair, {}).setdefault(row["final"], 0)
        counts[pair][row["final"]] += 1
    lines += ["", "| pair | direct | hole-punched | relayed | failed | median open + echo (ms) |",
              "|---|---:|---:|---:|---:|---:|"]
    for pair, c in sorted(counts.items()):
        ms = [row["ms"] for (a, b), row in results.items() if pair_of[a, b] == pair and row["ms"]]
        lines.append(f"| {pair} | {c.get('direct', 0)} | {c.get('hole-punched', 0)} | {c.get('relayed', 0)} | "
                     f"{c.get('failed', 0)} | {fmt(statistics.median(ms) if ms else None)} |")
    upgraded = sum(r["at_open"] == "relayed" and r["final"] == "hole-punched" for r in results.values())
    lines += ["", f"Relayed at first and hole-punched {args.punch_wait:.0f} s later: {upgraded} pairs."]
    over: dict[str, list[int]] = {}
    for r in results.values():
        over.setdefault(r["over"], [0, 0])[r["ms"] is None] += 1
    lines.append("By what the pair's connection ran on when probed: " + "; ".join(
        f"{carrier_} {ok + bad} pairs, {bad} failed" for carrier_, (ok, bad) in sorted(over.items())) + ".")
    failures: dict[str, list[str]] = {}
    for (a, b), r in sorted(results.items()):
        if r["final"] == "failed":
            failures.setdefault(f"over {r['over']}: `{r['error'][:90]}`", []).append(f"{a} → {b}")
    if failures:
        lines.append("Failures: " + "; ".join(f"{why} ({len(pairs)}: {', '.join(pairs[:4])}"
                                              f"{', ...' if len(pairs) > 4 else ''})" for why, pairs in failures.items())
                     + ".")
    lines += ["", "| peer | where | blocks | reachability (logged) | relay slot held after (s) | ... logged after (s) "
              "| serving after (s) |", "|---|---|---|---|---:|---:|---:|"]
    for proc, (name, public, blocks) in zip(peers, matrix_peers(args.extra_public)):
        lines.append(f"| {name} | {where[name]} | [{blocks}) | {reachability(proc)} | "
                     f"{fmt(proc.extra.get('relay slot'))} | {fmt(proc.extra.get('reachable through relay'))} | "
                     f"{fmt(proc.extra.get('serving blocks'))} |")
    lines += ["", "Times from the process's start (imports, joining, the dial-back check, measuring a block, loading "
              "its blocks), peers started one at a time; the slot is read from the daemon's own addresses (every "
              "0.5 s), the log line from the peer's log (– : not within "
              f"{REACH_S} s of serving)."]
    return lines


# ---- part 2: routes through the box ----

ROUTES = {"all public": ("pub-a", "pub-b", "pub-c"), "all NAT'd (relayed)": ("nat-a", "nat-b", "nat-c"),
          "mixed": ("pub-a", "nat-b", "pub-c")}
SPANS = {"a": "0:10", "b": "10:20", "c": "20:30"}


@dataclass
class Row:
    runs: list[dict] = field(default_factory=list)
    prefills: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def set_cap(box, homes: list, mbit: float | None) -> None:
    for home in homes:
        if mbit:
            box.cap(home.router_ns, "wan0", mbit)
        else:
            subprocess.run(["ip", "netns", "exec", home.router_ns, "tc", "qdisc", "del", "dev", "wan0", "root"],
                           capture_output=True, timeout=30)


def long_prompt(tokenizer, n: int) -> list[int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    ids = tokenizer(text).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def routes(args, bench, local, root: Path) -> list[str]:
    import torch

    prompt = bench.prompt[0].tolist()
    long = long_prompt(bench.tokenizer, args.prompt_tokens)
    with torch.inference_mode():
        want = local.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        want_long = local.generate(torch.tensor([long]), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                                   pad_token_id=0)[0, len(long):].tolist()
    rows: dict[tuple[str, float | None], Row] = {}
    links: dict[str, list[str]] = {}
    with boxed(root / "routes", bench.path, bench.model_id) as (box, sw):
        boot = sw.bootstrap(box.public("boot"))
        procs = {}
        for name in ("pub-a", "pub-b", "pub-c", "nat-a", "nat-b", "nat-c"):
            host = box.public(name) if name.startswith("pub") else box.home(name)
            procs[name] = sw.peer(name, host, SPANS[name[-1]], [boot.addr])
        sw.wait_serving(list(procs.values()), START_S)
        nat = [p for p in procs.values() if not p.host.public]
        with contextlib.suppress(TimeoutError):
            for p in nat:
                sw.wait_log(p, "reachable through relay", REACH_S)
        home = box.home("user")
        homes = [p.host for p in nat] + [home]
        workers = {label: Worker(sw, f"client-{i}", home, bench.path, bench.model_id, [boot.addr],
                                 [procs[n].peer_id for n in names])
                   for i, (label, names) in enumerate(ROUTES.items())}
        for w in workers.values():
            w.ready()
            w.run(prompt, 4)  # warm-up, untimed
        caps = (None, args.cap_mbit)
        for run in range(args.runs):
            for cap in caps:
                set_cap(box, homes, cap)
                for label, w in workers.items():
                    row = rows.setdefault((label, cap), Row())
                    timeout = CAPPED_S if cap else RUN_S
                    for kind_, ids, tokens, expect, into in (("decode", prompt, args.tokens, want, row.runs),
                                                             ("prefill", long, 2, want_long, row.prefills)):
                        event = w.run(ids, tokens, timeout)
                        if event["event"] != "run":
                            row.errors.append(event.get("message", str(event)))
                            log(f"run {run + 1}, {label}, cap {cap}: {kind_} failed: {row.errors[-1]}")
                            continue
                        if event["tokens"] != expect:
                            raise SystemExit(f"{label}, cap {cap}, {kind_}: the swarm's greedy tokens differ from "
                                             f"local transformers'\n  swarm: {event['tokens']}\n  local: {expect}")
                        into.append(event)
                    done = row.runs[-1] if row.runs else None
                    log(f"run {run + 1}, {label}, uplinks {'capped at %g Mbit/s' % cap if cap else 'uncapped'}: "
                        + (f"{done['tokens_per_s']:.1f} tokens/s" if done else "failed"))
        set_cap(box, homes, None)
        links = asyncio.run(route_links(sw, procs, workers))
    return routes_report(args, bench, rows, links, len(long))


async def route_links(sw, procs: dict, workers: dict) -> dict[str, list[str]]:
    """Per route, how each link is carried: client → first peer, and each peer → the next (the pushes)."""
    out = {}
    for label, w in workers.items():
        client = End("client", await identify(w.proc.popen.pid), True, w.proc.popen.pid)
        hops = [End(n, procs[n].peer_id, not procs[n].host.public, procs[n].popen.pid) for n in ROUTES[label]]
        chain = [client, *hops]
        described = []
        async with Daemons(chain) as daemons:
            for a, b in [*zip(chain, chain[1:]), (client, hops[-1])]:
                addrs = await daemons.addrs(a, b)
                described.append(f"{a.name}→{b.name} {kind(a, b, addrs)} ({carrier(addrs)})")
        out[label] = described
    return out


def hop_overhead(runs: list[dict]) -> float:
    per_hop = [(ms - compute) / hops for r in runs for tokens, ms, compute, hops in r["steps"] if tokens == 1 and hops]
    return statistics.median(per_hop) if per_hop else math.nan


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) if runs else math.nan


def routes_report(args, bench, rows: dict, links: dict, prompt_tokens: int) -> list[str]:
    base = {cap: med(rows[("all public", cap)].runs, "tokens_per_s") for cap in (None, args.cap_mbit)}
    lines = [f"`python benchmarks/home_routers.py --parts routes` on {machine_line()}. {bench.about}; 3 public "
             "peers and 3 NAT'd peers (each behind its own router) serve [0:10), [10:20), [20:30); the client is NAT'd "
             "too, behind a router of its own; routes pinned with `allow_peers`. Uplinks: every home's router's "
             f"egress uncapped, or capped at {args.cap_mbit:g} Mbit/s (`tc tbf`). Greedy, {args.tokens} new tokens "
             f"(decode) and a {prompt_tokens}-token prompt (prefill, time to its first token); medians of "
             f"{args.runs} runs, alternated; the swarm's tokens equal local transformers' in every run.", "",
             "| route | uplinks | decode tokens/s | vs all public | decode ms/token | per-hop overhead (ms) | "
             f"time to first token (ms) | prefill {prompt_tokens} tokens (s) | failed runs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (label, cap), row in rows.items():
        tps = med(row.runs, "tokens_per_s")
        ratio = f"{tps / base[cap]:.2f}x" if base[cap] and not math.isnan(tps) and not math.isnan(base[cap]) else "–"
        lines.append(f"| {label} | {'%g Mbit/s' % cap if cap else 'uncapped'} | {fmt(tps)} | {ratio} | "
                     f"{fmt(1e3 / tps if tps and not math.isnan(tps) else None)} | {fmt(hop_overhead(row.runs), 2)} | "
                     f"{fmt(med(row.runs, 'ttft_s') * 1e3, 0)} | {fmt(med(row.prefills, 'ttft_s'), 2)} | "
                     f"{len(row.errors)} |")
    lines += ["", "Links each route ended on (the client's daemon and each peer's, after the runs): "
              + "; ".join(f"{label}: {', '.join(described)}" for label, described in links.items()) + "."]
    errors = sorted({e for row in rows.values() for e in row.errors})
    if errors:
        lines.append("Errors: " + "; ".join(f"`{e[:200]}`" for e in errors[:3]) + ".")
    return lines


# ---- the machine ----

FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"),
         ("amx_tile", "AMX"))


def machine_line() -> str:
    """The CPU's model and its vector extensions (from `lscpu`), the cores and torch: what the numbers depend on."""
    from report import machine

    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        info = ""
    found = dict(re.findall(r"^([^:\n]+):\s*(.*)$", info, re.M))
    flags = set(found.get("Flags", "").split())
    have = [label for flag, label in FLAGS if flag in flags]
    cpu = found.get("Model name", "unknown CPU").strip()
    return f"{cpu} ({', '.join(have) or 'no AVX2'}), {machine()}"


# ---- main ----

def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("matrix", "routes"), default=["matrix", "routes"])
    parser.add_argument("--between-ms", type=float, default=0.0,
                        help="matrix: two regions (eu, us: 2 ms one way within each), this far apart one way")
    parser.add_argument("--extra-public", type=int, default=0,
                        help="matrix: this many more public peers (a NAT'd node punches holes only once 4 hosts saw "
                             "its outside address)")
    parser.add_argument("--fresh-links", action="store_true",
                        help="matrix: close each NAT'd pair's connection before its probe (punched only when it opens)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens of a decode run")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="the prefill run's prompt")
    parser.add_argument("--cap-mbit", type=float, default=20.0, help="the homes' capped uplink")
    parser.add_argument("--open-timeout", type=float, default=10.0, help="seconds a probe stream may take")
    parser.add_argument("--punch-wait", type=float, default=5.0,
                        help="seconds between the probes and reading which connection each pair ended on")
    parser.add_argument("--root", type=Path, help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--no-write", action="store_true", help="print the sections only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    args = parse(argv)
    import netbox

    reason = netbox.available()
    if reason:
        raise SystemExit(f"home_routers: {reason}")
    from bench_models import load
    from report import write_section
    from swarm.weights.models import local_model_id

    started = time.monotonic()
    keep = args.root is not None
    root = args.root or Path(tempfile.mkdtemp(prefix="swarm-home-routers-"))
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        demo = load("demo", root)
        bench = types.SimpleNamespace(path=demo.path, prompt=demo.prompt, about=demo.about,
                                      model_id=local_model_id(demo.path),
                                      tokenizer=AutoTokenizer.from_pretrained(demo.path))
        sections = {}
        if "matrix" in args.parts:
            name, title = (("home-routers-matrix-regions", "### Home routers: who reaches whom, across regions")
                           if args.between_ms else ("home-routers-matrix", "### Home routers: who reaches whom"))
            if args.extra_public:
                name, title = f"{name}-punch", f"{title}, with {2 + args.extra_public} public peers"
            sections[name] = [title, "", *matrix(args, bench.path, bench.model_id, root)]
        if "routes" in args.parts:
            local = AutoModelForCausalLM.from_pretrained(bench.path, dtype=torch.float32).eval()
            sections["home-routers-routes"] = ["### Home routers: relayed routes", "", *routes(args, bench, local, root)]
        for name, lines in sections.items():
            print("\n".join(lines) + "\n")
            if not args.no_write:
                write_section(name, lines)
        log(f"done in {time.monotonic() - started:.0f} s")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
