"""Distances, measured in an internet in a box with two regions (`tests/netbox.py`): whether routes stay in the
client's region, and what a token costs against the best route's floor.

    python benchmarks/regions.py [--parts routes relays] [--runs 5] [--tokens 24] [--within-ms 2] [--between-ms 30] [--root DIR] [--no-write]

The demo model (SmolLM2-135M-Instruct, 30 blocks) in float32. Two regions, `eu` and `us`: every packet
between hosts of one region is held `--within-ms` one way, between the regions `--between-ms` (a round trip
is twice that). In each region a public peer serves [0:15) and a NAT'd peer (behind a home router of its own)
[15:30); the bootstrap is a public host in `eu`; a NAT'd client in each region. Peers and clients start
with the bootstrap as their only initial peer; the public peers start first, the NAT'd ones once the
bootstrap remembers the public ones (as in a swarm that had public peers before), and choose their relays.

Each run starts a fresh client process in each region (it measures everything anew), which routes and
generates `--tokens` greedy tokens; after the first half, every delay of the box is set to 0 while the
session goes on over the same route, then set back. So each run gives, on one route: the per-token time
with the distances (median decode gap of the first half), and without them (the second half: the peers'
compute, the client's own work and the box's forwarding). The route's floor is that time without distances
plus one way around the route's loop (client -> first peer -> ... -> last peer -> client), each leg as its
packets go: straight, or through the relay its connection runs over (read from the nodes' transport
daemons after the run). The best route's floor: the least such floor over every route of the swarm, each
leg straight where one end is public and else through the public node that makes it shortest (the best relay
the NAT'd end could hold). The greedy tokens must equal local transformers' in every run.

Needs root (network namespaces), `ip`, `nft` and `tc`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

from box_links import Daemons, End, SlotWatch, identify  # noqa: E402
from box_swarm import note_lines, wait_until  # noqa: E402
from home_routers import machine_line  # noqa: E402

PEER_OPTIONS = ("--cache-tokens", "4096", "--announce-interval", "3", "--record-ttl", "20")
REGIONS = ("eu", "us")
SPANS = {"pub": "0:15", "nat": "15:30"}
START_S = 300
REACH_S = 60
RUN_S = 300


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- the client, inside the box ----

def worker(argv: list[str]) -> int:
    """`--worker`: a client in its own namespace. Joins, says `ready`, then runs one generation as stdin asks
    ({"prompt": ids, "tokens": n, "pause_after": k}): after k tokens it says `paused` (the route and what it
    predicts a token costs) and waits for a line; at the end, `run` with the tokens, the gaps between tokens
    (ms) and the addresses of its connections to the route's peers; it exits at the next line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from client.model import DistributedModelForCausalLM

    def say(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    started = time.monotonic()
    try:
        model = DistributedModelForCausalLM.from_pretrained(args.model, args.initial_peers, model_id=args.model_id,
                                                            verify_fraction=0)
    except Exception as e:  # boundary: the parent reports it
        say("error", message=f"{type(e).__name__}: {e}")
        return 1
    say("ready", join_s=time.monotonic() - started)
    command = json.loads(sys.stdin.readline())
    ids = torch.tensor([command["prompt"]])
    times: list[float] = []

    class Timed:
        def __init__(self, session):
            self.session = session

        def put(self, value) -> None:
            times.append(time.perf_counter())
            if len(times) == command["pause_after"] + 1:  # the first put is the prompt
                route = self.session.route
                say("paused", route=[[h.peer, str(h.span)] for h in route],
                    predicted_ms=model.connection.client.route_cost_ms(list(route)))
                sys.stdin.readline()
                times.extend([None, time.perf_counter()])  # the pause is no token's: the next gap starts here

        def end(self) -> None:
            pass

    with model:
        try:
            with model.inference_session(max_length=ids.shape[1] + command["tokens"]) as session:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=command["tokens"],
                                     min_new_tokens=command["tokens"], do_sample=False, pad_token_id=0,
                                     streamer=Timed(session))
                peers = [h.peer for h in session.route]
                conns = model.connection.run(model.connection.node.peer_addrs(), timeout=10)
                say("run", tokens=out[0, ids.shape[1]:].tolist(), route=[[h.peer, str(h.span)] for h in session.route],
                    gaps=[[(b - a) * 1e3 for a, b in zip(part, part[1:])] for part in split(times)],
                    connections={p: a for p, a in conns.items() if p in peers}, failovers=len(session.failovers))
            sys.stdin.readline()  # its daemon stays until the parent has read its connections
        except Exception as e:  # boundary: reported, the parent decides
            say("error", message=f"{type(e).__name__}: {e}")
            return 1
    return 0


def split(times: list) -> list[list[float]]:
    """The token times before the pause (from the first new token: the gap after the prompt is its prefill), and
    after it (from the moment it ended)."""
    cut = times.index(None) if None in times else len(times)
    return [times[1:cut], times[cut + 1:]]


class Worker:
    def __init__(self, sw, name: str, host, model: Path, model_id: str, initial: list[str]):
        from box_swarm import ClientRun

        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(model), "--model-id",
                model_id, "--initial-peers", *initial]
        self.proc = sw.spawn(name, host, argv, client=True)
        self.events = ClientRun(self.proc)

    def expect(self, event: str) -> dict:
        got = self.events.expect(event, RUN_S)
        if got["event"] != event:
            raise RuntimeError(f"{self.proc.name}: expected {event}, got {got}\n{self.proc.tail()}")
        return got

    def send(self, obj) -> None:
        self.proc.popen.stdin.write((json.dumps(obj) if not isinstance(obj, str) else obj) + "\n")
        self.proc.popen.stdin.flush()


# ---- distances ----

class Distances:
    """One-way delays between the box's hosts, by region (ms)."""

    def __init__(self, within: float, between: float):
        self.within, self.between = within, between

    def one_way(self, a: str, b: str) -> float:
        return self.within if a == b else self.between


def leg_ms(dist: Distances, region: dict[str, str], a: str, b: str, relay: str | None) -> float:
    """One way from node a to node b: straight, or through `relay`."""
    if relay is None or relay in (a, b):
        return dist.one_way(region[a], region[b])
    return dist.one_way(region[a], region[relay]) + dist.one_way(region[relay], region[b])


def relay_of(addrs: list[str], by_id: dict[str, str]) -> str | None | bool:
    """The node a connection with these remote addresses runs through: None when straight, the relay's name
    when relayed, False when there is no connection."""
    if not addrs:
        return False
    if any("/p2p-circuit" not in a for a in addrs):
        return None
    relay = addrs[0].split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1]
    return by_id.get(relay, relay)


def best_floor_ms(dist: Distances, region: dict[str, str], public: set[str], client: str,
                  spans: dict[str, list[str]]) -> tuple[float, list[str]]:
    """The least one way around any route of the swarm (one peer per span, in order), each leg straight where
    one end is public, else through the public node that makes it shortest (a relay the NAT'd end could
    hold: the best relay choice); and that route."""
    def leg(a: str, b: str) -> float:
        if a in public or b in public:
            return dist.one_way(region[a], region[b])
        return min(leg_ms(dist, region, a, b, r) for r in public)

    best = (math.inf, [])
    for route in itertools.product(*spans.values()):
        loop = [client, *route, client]
        total = sum(leg(a, b) for a, b in zip(loop, loop[1:]))
        best = min(best, (total, list(route)))
    return best


# ---- the run ----

def run(args, bench, want: list[int], root: Path) -> list[str]:
    from box_swarm import BoxSwarm
    from netbox import Box

    dist = Distances(args.within_ms, args.between_ms)
    rows = []
    with Box(regions={r: args.within_ms for r in REGIONS}, between_ms=args.between_ms) as box:
        sw = BoxSwarm(box, root, bench.path, bench.model_id, PEER_OPTIONS)
        try:
            boot = sw.bootstrap(box.public("boot", region="eu"))
            procs = {f"pub-{r}": sw.peer(f"pub-{r}", box.public(f"pub-{r}", region=r), SPANS["pub"], [boot.addr])
                     for r in REGIONS}
            sw.wait_serving(list(procs.values()), START_S)
            # a swarm whose public peers were there first: the bootstrap remembers them (it asks the peers it is
            # connected to at 5, 20 and 60 s), and a NAT'd peer starting now learns of them from it
            met = root / "bootstrap" / "identity.key.known-peers.json"
            wait_until(lambda: met.exists() and all(p.peer_id in met.read_text() for p in procs.values()), 120,
                       "the bootstrap to remember the public peers")
            for r in REGIONS:
                procs[f"nat-{r}"] = sw.peer(f"nat-{r}", box.home(f"nat-{r}", region=r), SPANS["nat"], [boot.addr])
            sw.wait_serving(list(procs.values()), START_S)
            watches = [SlotWatch(p) for p in procs.values()]
            note_lines(list(procs.values()), ("reachable through relay",), lambda: all(w() for w in watches), REACH_S)
            region = {"boot": "eu", **{n: n.split("-")[1] for n in procs}}
            public = {"boot"} | {n for n, p in procs.items() if p.host.public}
            ends = {n: End(n, p.peer_id, not p.host.public, p.popen.pid) for n, p in procs.items()}
            ends["boot"] = End("boot", boot.peer_id, False, boot.popen.pid)
            by_id = {e.peer_id: n for n, e in ends.items()}
            spans = {s: [n for n in procs if n.startswith(k)] for k, s in (("pub", "0:15"), ("nat", "15:30"))}
            for i in range(args.runs):
                for r in REGIONS:
                    cli = f"cli-{r}-{i}"
                    host = box.home(cli, region=r)
                    region[cli] = r
                    rows.append(one_run(args, box, sw, bench, want, cli, host, boot, ends, by_id, region, public,
                                        spans, dist))
                    row = rows[-1]
                    log(f"run {i + 1}, client in {r}: route {' '.join(row['route'])}, {row['ms']:.1f} ms per token "
                        f"(floor {row['floor']:.1f}, best {row['best']:.1f}, predicted {row['predicted']:.1f}); legs "
                        + ", ".join(f"{leg} {'via ' + via if via else 'straight'}" for leg, via in row["legs"].items()))
        except BaseException:
            log("failed; the processes' last lines:\n" + sw.diagnostics())
            raise
    return report(args, bench, rows)


def one_run(args, box, sw, bench, want, cli, host, boot, ends, by_id, region, public, spans, dist) -> dict:
    w = Worker(sw, cli, host, bench.path, bench.model_id, [boot.addr])
    try:
        w.expect("ready")
        w.send({"prompt": bench.prompt[0].tolist(), "tokens": args.tokens, "pause_after": args.tokens // 2})
        paused = w.expect("paused")
        for a, b in itertools.combinations_with_replacement(REGIONS, 2):
            box.set_delay(a, b, 0.0)
        try:
            w.send("go")
            done = w.expect("run")
        finally:
            for a, b in itertools.combinations_with_replacement(REGIONS, 2):
                box.set_delay(a, b, args.within_ms if a == b else args.between_ms)
        if done["tokens"] != want:
            raise SystemExit(f"{cli}: the swarm's greedy tokens differ from local transformers'\n  swarm: "
                             f"{done['tokens']}\n  local: {want}")
        route = [by_id[p] for p, _ in done["route"]]
        client_end = End(cli, asyncio.run(identify(w.proc.popen.pid)), True, w.proc.popen.pid)
        by_id[client_end.peer_id] = cli
        relays_now = {n: [by_id.get(x, x) for x in rs]
                      for n, rs in asyncio.run(relays_of([ends[n] for n in ends if ends[n].nat])).items()}
        legs = asyncio.run(route_legs(client_end, [ends[n] for n in route], by_id))
    finally:
        with contextlib.suppress(OSError):
            w.proc.popen.stdin.close()
    loop = [cli, *route, cli]
    network = sum(leg_ms(dist, region, a, b, legs.get((a, b))) for a, b in zip(loop, loop[1:]))
    with_distance, without = (statistics.median(g) for g in done["gaps"])
    best, best_route = best_floor_ms(dist, region, public, cli, spans)
    return {"client": cli, "region": region[cli], "route": route, "in_region": all(region[n] == region[cli] for n in route),
            "ms": with_distance, "compute": without, "network": network, "floor": without + network,
            "best": without + best, "best_route": best_route, "predicted": paused["predicted_ms"],
            "legs": {f"{a}>{b}": v for (a, b), v in legs.items()}, "relays": relays_now}


async def relays_of(nat: list[End]) -> dict[str, list[str]]:
    from box_links import relays

    return {e.name: await relays(e.pid) for e in nat}


async def route_legs(client: End, hops: list[End], by_id: dict[str, str]) -> dict[tuple[str, str], str | None]:
    """Per leg of the route's loop, the relay its connection runs through (None: straight)."""
    chain = [client, *hops, client]
    out = {}
    async with Daemons([client, *hops]) as daemons:
        for a, b in zip(chain, chain[1:]):
            relay = relay_of(await daemons.addrs(a, b) or await daemons.addrs(b, a), by_id)
            out[a.name, b.name] = relay if relay is not False else None
    return out


# ---- relays: the first client through a NAT'd peer's relay, and a relay's loss ----

def relays_part(args, bench, want: list[int], root: Path) -> list[str]:
    """One region (`--within-ms`): a bootstrap and two public peers serving [0:15), all three relays; then, per
    run, a fresh NAT'd peer [15:30) (a home and an identity of its own), and a fresh NAT'd client started as
    soon as the peer says it serves (a new generation does not wait for blocks): the seconds from the peer's
    start to the client's first token through the peer's relay, the client's own start included. Then relay loss: a client generating through a NAT'd peer pauses, the
    relay its connection to that peer runs through is killed, the generation goes on (the same tokens), and a
    fresh client started at the kill times its first token through the peer's other relay."""
    from box_links import relays
    from box_swarm import BoxSwarm
    from netbox import Box

    first, losses = [], []
    prompt = bench.prompt[0].tolist()
    wait = {"wait_for_blocks": 120.0}
    with Box(regions={"eu": args.within_ms}) as box:
        sw = BoxSwarm(box, root / "relays", bench.path, bench.model_id, PEER_OPTIONS)
        try:
            boot = sw.bootstrap(box.public("boot", region="eu"))
            pubs = [sw.peer(f"pub{i}", box.public(f"pub{i}", region="eu"), SPANS["pub"], [boot.addr]) for i in (1, 2)]
            sw.wait_serving(pubs, START_S)
            met = root / "relays" / "bootstrap" / "identity.key.known-peers.json"
            wait_until(lambda: met.exists() and all(p.peer_id in met.read_text() for p in pubs), 120,
                       "the bootstrap to remember the public peers")
            for i in range(args.runs):
                started = time.time()
                nat = sw.peer(f"nat{i}", box.home(f"nat{i}", region="eu"), SPANS["nat"], [boot.addr])
                sw.wait_serving([nat], START_S)
                serving = time.time() - started
                run = sw.client(f"cli{i}", box.home(f"cli{i}", region="eu"), [boot.addr], prompt, args.tokens,
                                pause_after=1, **wait)
                event = run.expect("paused", RUN_S)
                if event["event"] != "paused":
                    raise RuntimeError(f"cli{i}: {event}\n{run.proc.tail()}\n{nat.tail()}")
                route = [p for p, _ in event["route"]]
                run.go()
                done = run.expect("done", RUN_S)
                if done.get("tokens", [[]])[0][len(prompt):] != want:
                    raise SystemExit(f"cli{i}: tokens differ from local transformers'\n{done}")
                first.append({"s": event["at"] - started, "serving": serving, "through_nat": nat.peer_id in route})
                log(f"relays: run {i + 1}: first token through the new NAT'd peer {first[-1]['s']:.1f} s after its start")
                sw.kill(nat)
            # relay loss: the last NAT'd peer's setup again, with a generation paused across the kill
            nat = sw.peer("nat-loss", box.home("nat-loss", region="eu"), SPANS["nat"], [boot.addr])
            sw.wait_serving([nat], START_S)
            held = asyncio.run(relays(nat.popen.pid))
            run = sw.client("cli-loss", box.home("cli-loss", region="eu"), [boot.addr], prompt, args.tokens,
                            pause_after=4, **wait)
            if run.expect("paused", RUN_S)["event"] != "paused":
                raise RuntimeError(f"cli-loss did not start\n{run.proc.tail()}")
            client = End("cli-loss", asyncio.run(identify(run.proc.popen.pid)), True, run.proc.popen.pid)
            via = asyncio.run(route_legs(client, [End("nat", nat.peer_id, True, nat.popen.pid)],
                                         {p.peer_id: p.name for p in [boot, *pubs]}))
            victim = next((v for v in via.values() if v), None)
            by_name = {"bootstrap": boot, **{p.name: p for p in pubs}}
            if victim not in by_name:
                raise RuntimeError(f"the client's connection to the NAT'd peer is not relayed ({via})")
            sw.kill(by_name[victim])
            killed = time.time()
            late = sw.client("cli-late", box.home("cli-late", region="eu"),
                             [p.addr for p in [boot, *pubs] if p.name != victim], prompt, args.tokens,
                             pause_after=1, **wait)
            run.go()
            done = run.expect("done", RUN_S)
            event = late.expect("paused", RUN_S)
            late.go()
            late_done = late.expect("done", RUN_S)
            losses.append({"victim": victim, "relays": len(held), "same": done.get("tokens", [[]])[0][len(prompt):] == want,
                           "failovers": len(done.get("failovers", [])), "late_s": event.get("at", math.nan) - killed,
                           "late_same": late_done.get("tokens", [[]])[0][len(prompt):] == want,
                           "late_route": [p for p, _ in event.get("route", [])]})
            log(f"relays: loss of {victim}: {losses[-1]}")
        except BaseException:
            log("failed; the processes' last lines:\n" + sw.diagnostics())
            raise
    return relays_report(args, first, losses)


def relays_report(args, first: list[dict], losses: list[dict]) -> list[str]:
    times = [x["s"] for x in first]
    lines = [f"`python benchmarks/regions.py --parts relays --runs {args.runs}` on {machine_line()}. One region, "
             f"{args.within_ms:g} ms one way; a bootstrap and 2 public peers serving [0:15), all of them relays. Per "
             "run, a fresh NAT'd peer serving [15:30), and a fresh NAT'd client started once the peer says it "
             "serves: seconds from the peer's start (imports, joining, choosing its relays, measuring and loading "
             "its blocks) to the client's first token through the peer's relay (the client's own start, about 5 s, "
             "included).", "",
             "| runs | through the new peer | peer serving after (median s) | first token after (median s) | "
             "slowest s | within 30 s |", "|---:|---:|---:|---:|---:|---:|",
             f"| {len(first)} | {sum(x['through_nat'] for x in first)} | "
             f"{statistics.median(x['serving'] for x in first):.1f} | {statistics.median(times):.1f} | "
             f"{max(times):.1f} | {sum(t <= 30 for t in times)}/{len(times)} |"]
    for loss in losses:
        lines += ["", f"Relay loss: the NAT'd peer held {loss['relays']} relays; {loss['victim']}, the one the paused "
                  f"client's connection ran through, was killed; the generation completed with "
                  f"{'the same' if loss['same'] else 'DIFFERENT'} tokens ({loss['failovers']} failovers); a fresh client "
                  f"started at the kill had its first token {loss['late_s']:.1f} s later, "
                  f"{'the same' if loss['late_same'] else 'DIFFERENT'} tokens."]
    return lines


def report(args, bench, rows: list[dict]) -> list[str]:
    lines = [f"`python benchmarks/regions.py --runs {args.runs}` on {machine_line()}. {bench.about}; two regions, "
             f"{args.within_ms:g} ms one way within each, {args.between_ms:g} ms between them; in each a public peer "
             "serving [0:15), a NAT'd peer serving [15:30) and NAT'd clients; the bootstrap is public, in eu; "
             f"every node starts with the bootstrap as its only initial peer. Each run: a fresh client per region, "
             f"{args.tokens} greedy tokens (the swarm's equal local transformers' in every run); per-token time "
             "with the distances (first half) and without (second half, same route); floor = that time without "
             "distances plus one way around the route's loop as its packets go; best = the same for the swarm's "
             "best route. Medians.", "",
             "| client region | runs | routes in region | ms per token | predicted (ms) | without distances (ms) | "
             "route's floor (ms) | best route's floor (ms) | vs best floor |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in REGIONS:
        mine = [x for x in rows if x["region"] == r]
        if not mine:
            continue

        def med(key):
            return statistics.median(x[key] for x in mine)

        ratio = statistics.median(x["ms"] / x["best"] for x in mine)
        lines.append(f"| {r} | {len(mine)} | {sum(x['in_region'] for x in mine)}/{len(mine)} | {med('ms'):.1f} | "
                     f"{med('predicted'):.1f} | {med('compute'):.1f} | {med('floor'):.1f} | {med('best'):.1f} | "
                     f"{ratio:.2f}x |")
    if rows:
        share = sum(x["in_region"] for x in rows) / len(rows)
        taken = "; ".join(f"{route} ×{n}" for route, n in sorted(count_routes(rows).items()))
        relays = ", ".join(f"{n}: {', '.join(rs) or 'none'}" for n, rs in rows[-1]["relays"].items())
        lines += ["", f"Routes in the client's region: {share:.0%} of {len(rows)}. Routes taken: {taken}. Relays of "
                  f"the NAT'd peers at the end: {relays}."]
    return lines


def count_routes(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in rows:
        key = f"{x['region']}: " + " → ".join(x["route"])
        out[key] = out.get(key, 0) + 1
    return out


def demo_greedy(root: Path, tokens: int) -> tuple[types.SimpleNamespace, list[int]]:
    """The demo model (`path`, `prompt`, `about`, `model_id`) and local transformers' `tokens` greedy tokens after
    its prompt: the ground truth of every run."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench_models import load
    from swarm.weights.models import local_model_id

    demo = load("demo", root)
    bench = types.SimpleNamespace(path=demo.path, prompt=demo.prompt, about=demo.about, model_id=local_model_id(demo.path))
    local = AutoModelForCausalLM.from_pretrained(bench.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = local.generate(bench.prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)[0, bench.prompt.shape[1]:].tolist()
    return bench, want


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("routes", "relays"), default=["routes", "relays"])
    parser.add_argument("--runs", type=int, default=5, help="runs of each part")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per run (half with the distances)")
    parser.add_argument("--within-ms", type=float, default=2.0, help="one-way delay within a region")
    parser.add_argument("--between-ms", type=float, default=30.0, help="one-way delay between the regions")
    parser.add_argument("--root", type=Path, help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    args = parse(argv)
    import netbox

    if reason := netbox.available():
        raise SystemExit(f"regions: {reason}")
    from report import write_section

    started = time.monotonic()
    root = args.root or Path(tempfile.mkdtemp(prefix="swarm-regions-"))
    try:
        bench, want = demo_greedy(root, args.tokens)
        sections = {}
        if "routes" in args.parts:
            sections["regions-routes"] = ["### Regions: routes that stay near", "", *run(args, bench, want, root)]
        if "relays" in args.parts:
            sections["regions-relays"] = ["### Regions: relays", "", *relays_part(args, bench, want, root)]
        for name, lines in sections.items():
            print("\n".join(lines) + "\n")
            if not args.no_write:
                write_section(name, lines)
        log(f"done in {time.monotonic() - started:.0f} s")
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
