"""Placement that keeps regions whole, measured in an internet in a box with two regions (`tests/netbox.py`).

    python benchmarks/regions_placement.py [--placements 3] [--runs 2] [--tokens 24] [--baseline-repo DIR] [--no-write]

The regions of `benchmarks/regions.py` (2 ms one way within each, 30 ms between); the bootstrap is public, in
eu. Per region a public peer and a NAT'd one, each with room for half the demo model (`--num-blocks 15`),
none told which blocks: they join one after another, eu's public peer, us's, then eu's NAT'd peer and us's
(each once the one before serves), and the placement chooses their spans. Then per run a fresh client in each
region measures as in regions.py's routes part: the per-token time with the distances, against the best
route's floor (the least one way around any route of the swarm, plus the peers' compute measured without
the distances). Each placement is a fresh box. The peers share one measured block cost (the first peer's): equal machines,
equal speeds, as on separate hosts; measured one after another on this machine's two shared cores, every
later peer found itself slower than the one before, and those differences decided the placement.

With `--baseline-repo DIR` (a checkout of an earlier version), the same first with that version's peers and
clients: e.g. the placement by throughput alone, before regions counted. The greedy tokens must equal local
transformers' in every run. Needs root (network namespaces), `ip`, `nft` and `tc`.
"""

from __future__ import annotations

import argparse
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

from box_links import End, SlotWatch  # noqa: E402
from box_swarm import note_lines, wait_until  # noqa: E402
from home_routers import machine_line  # noqa: E402
from regions import REGIONS, RUN_S, START_S, REACH_S, Distances, demo_greedy, log, one_run  # noqa: E402

PEER_OPTIONS = ("--cache-tokens", "4096", "--announce-interval", "3", "--record-ttl", "20", "--num-blocks", "15")
ORDER = (("pub-eu", "eu", True), ("pub-us", "us", True), ("nat-eu", "eu", False), ("nat-us", "us", False))


def one_placement(args, bench, want: list[int], root: Path, repo: Path, k: int) -> dict:
    from box_swarm import BoxSwarm
    from netbox import Box

    dist = Distances(args.within_ms, args.between_ms)
    with Box(regions={r: args.within_ms for r in REGIONS}, between_ms=args.between_ms) as box:
        # one block cost for every peer (measured by the first): equal machines, equal speeds. Measured one by one
        # on two shared cores, each later peer found itself slower than the one before, which decided the ties
        sw = BoxSwarm(box, root, bench.path, bench.model_id, PEER_OPTIONS + ("--capacity-cache", str(root / "cost.json")),
                      repo=repo)
        try:
            boot = sw.bootstrap(box.public("boot", region="eu"))
            procs = {}
            for name, r, public in ORDER:
                if not public:  # the NAT'd peers learn of the public ones (relay candidates) from the bootstrap
                    met = root / "bootstrap" / "identity.key.known-peers.json"
                    wait_until(lambda: met.exists() and all(p.peer_id in met.read_text() for p in procs.values() if p.host.public), 120,
                               "the bootstrap to remember the public peers")
                host = box.public(name, region=r) if public else box.home(name, region=r)
                procs[name] = sw.peer(name, host, None, [boot.addr])
                sw.wait_serving([procs[name]], START_S)
            watches = [SlotWatch(p) for p in procs.values()]
            note_lines(list(procs.values()), ("reachable through relay",), lambda: all(w() for w in watches), REACH_S)
            by_id = {p.peer_id: n for n, p in procs.items()}
            chosen = {by_id[p["peer"]]: f"{p['start']}:{p['end']}" for p in sw.status(box.hosts["boot"], [boot.addr])["peers"]
                      if p["state"] == "online" and p["peer"] in by_id}
            region = {"boot": "eu", **{n: n.split("-")[1] for n in procs}}
            whole = {r: covers([chosen[n] for n in chosen if region[n] == r]) for r in REGIONS}
            log(f"placement {k + 1}: {chosen}; regions whole: {whole}")
            public = {"boot"} | {n for n, p in procs.items() if p.host.public}
            ends = {n: End(n, p.peer_id, not p.host.public, p.popen.pid) for n, p in procs.items()}
            ends["boot"] = End("boot", boot.peer_id, False, boot.popen.pid)
            ids = {e.peer_id: n for n, e in ends.items()}
            spans: dict[str, list[str]] = {}
            for n, s in sorted(chosen.items(), key=lambda x: int(x[1].split(":")[0])):
                spans.setdefault(s, []).append(n)
            rows = []
            if not chain(list(spans)):
                log(f"placement {k + 1}: spans {sorted(spans)} are not two halves: no route floor computed")
                spans = {}
            for i in range(args.runs if spans else 0):
                for r in REGIONS:
                    cli = f"cli-{r}-{i}"
                    region[cli] = r
                    rows.append(one_run(args, box, sw, bench, want, cli, box.home(cli, region=r), boot, ends, ids,
                                        region, public, spans, dist))
                    row = rows[-1]
                    log(f"placement {k + 1}, run {i + 1}, client in {r}: route {' '.join(row['route'])}, "
                        f"{row['ms']:.1f} ms per token (best floor {row['best']:.1f})")
            light = [light_run(args, bench, want, sw, box, boot, ids, r, k) for r in REGIONS] if args.light else []
        except BaseException:
            log("failed; the processes' last lines:\n" + sw.diagnostics())
            raise
    return {"chosen": chosen, "whole": whole, "rows": rows, "light": light}


def light_run(args, bench, want, sw, box, boot, ids: dict[str, str], region: str, k: int) -> dict:
    """A light client (py-libp2p, `--transport libp2p`) in a NAT'd home of `region`: it dials peers directly and
    so routes around the NAT'd ones. Its route and its time per token after the first."""
    name = f"light-{region}-{k}"
    prompt = bench.prompt[0].tolist()
    run = sw.client(name, box.home(name, region=region), [boot.addr], prompt, args.tokens, pause_after=1,
                    transport="libp2p")
    first = run.expect("paused", RUN_S)
    if first["event"] != "paused":
        log(f"{name}: {first.get('type')}: {first.get('message')}")
        return {"region": region, "error": f"{first.get('type')}: {first.get('message')}"}
    run.go()
    done = run.expect("done", RUN_S)
    if done["event"] != "done" or done["tokens"][0][len(prompt):] != want:
        raise SystemExit(f"{name}: {done}")
    route = [ids.get(p, p) for p, _ in done["route"]]
    out = {"region": region, "route": route, "ms": (done["at"] - first["at"]) / (args.tokens - 1) * 1e3}
    log(f"{name}: route {' '.join(route)}, {out['ms']:.1f} ms per token")
    return out


def covers(spans: list[str], num_blocks: int = 30) -> bool:
    held = set()
    for s in spans:
        a, b = map(int, s.split(":"))
        held.update(range(a, b))
    return held == set(range(num_blocks))


def chain(spans: list[str]) -> bool:
    """Whether the distinct spans tile the model in order (the route floor assumes one peer per span)."""
    bounds = [tuple(map(int, s.split(":"))) for s in spans]
    return bool(bounds) and bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def light_lines(placements: list[dict]) -> list[str]:
    runs = [x for p in placements for x in p["light"]]
    if not runs:
        return []
    full = {r: [x["ms"] for p in placements for x in p["rows"] if x["region"] == r] for r in REGIONS}
    lines = ["", "The light client (py-libp2p) in a NAT'd home of each region, once per placement: it dials peers "
             "directly, so it routes around the NAT'd peers (through the public peers, across the regions where "
             "they are), and never bans them.", "",
             "| light client in | runs | routes | ms per token (median) | full client there (median ms) |",
             "|---|---:|---|---:|---:|"]
    for r in REGIONS:
        mine = [x for x in runs if x["region"] == r]
        ok = [x for x in mine if "ms" in x]
        routes = "; ".join(sorted({" → ".join(x["route"]) for x in ok} | {x["error"][:80] for x in mine if "error" in x}))
        lines.append(f"| {r} | {len(mine)} | {routes} | {statistics.median(x['ms'] for x in ok) if ok else math.nan:.1f} | "
                     f"{statistics.median(full[r]) if full[r] else math.nan:.1f} |")
    return lines


def section(args, label: str, placements: list[dict]) -> list[str]:
    rows = [r for p in placements for r in p["rows"]]
    whole = sum(all(p["whole"].values()) for p in placements)
    line = (f"| {label} | {len(placements)} | {whole}/{len(placements)} | "
            + " ; ".join(", ".join(f"{n} {s}" for n, s in sorted(p["chosen"].items())) for p in placements) + " | ")
    if rows:
        line += (f"{sum(r['in_region'] for r in rows)}/{len(rows)} | {statistics.median(r['ms'] for r in rows):.1f} | "
                 f"{statistics.median(r['best'] for r in rows):.1f} | "
                 f"{statistics.median(r['ms'] / r['best'] for r in rows):.2f}x |")
    else:
        line += "- | - | - | - |"
    return [line]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", type=int, default=3, help="fresh boxes, each placed anew")
    parser.add_argument("--runs", type=int, default=2, help="clients per region per placement")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per run (half with the distances)")
    parser.add_argument("--within-ms", type=float, default=2.0, help="one-way delay within a region")
    parser.add_argument("--between-ms", type=float, default=30.0, help="one-way delay between the regions")
    parser.add_argument("--baseline-repo", type=Path, help="a checkout of an earlier version, measured first")
    parser.add_argument("--no-light", dest="light", action="store_false",
                        help="skip the light client (one per region and placement, this version only)")
    parser.add_argument("--baseline-label", default="placed by throughput alone", help="the baseline's row label")
    parser.add_argument("--root", type=Path, help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        from regions import worker

        return worker(sys.argv[2:])
    args = parse(argv)
    import netbox

    if reason := netbox.available():
        raise SystemExit(f"regions_placement: {reason}")
    from report import write_section

    started = time.monotonic()
    root = args.root or Path(tempfile.mkdtemp(prefix="swarm-regions-placement-"))
    try:
        bench, want = demo_greedy(root, args.tokens)
        variants = ([(args.baseline_label, args.baseline_repo)] if args.baseline_repo else []) + \
            [("placed with regions (this version)", REPO)]
        table, light = [], []
        for label, repo in variants:
            light_too = args.light and repo == REPO
            done = [one_placement(types.SimpleNamespace(**{**vars(args), "light": light_too}), bench, want,
                                  root / f"{label[:8].replace(' ', '-')}-{k}", repo, k) for k in range(args.placements)]
            table += section(args, label, done)
            light += light_lines(done) if light_too else []
        lines = ["### Regions: placement that keeps regions whole", "",
                 f"`python benchmarks/regions_placement.py --placements {args.placements} --runs {args.runs}"
                 f"{' --baseline-repo DIR' if args.baseline_repo else ''}` on {machine_line()}. {bench.about}; two "
                 f"regions, {args.within_ms:g} ms one way within each, {args.between_ms:g} ms between; the bootstrap "
                 "public in eu; per region a public and a NAT'd peer with room for 15 of the 30 blocks each, joining "
                 "in turn (eu public, us public, eu NAT'd, us NAT'd), the placement choosing their spans (one measured "
                 "block cost shared by all: equal speeds); per "
                 f"placement (a fresh box) {args.runs} fresh clients per region, {args.tokens} greedy tokens each "
                 "(equal to local transformers' in every run). Per-token time with the distances against the best "
                 "route's floor (regions.py's routes part). Medians.", "",
                 "| peers | placements | both regions whole | spans chosen | routes in region | ms per token | "
                 "best route's floor (ms) | vs best floor |", "|---|---:|---:|---|---:|---:|---:|---:|", *table, *light]
        print("\n".join(lines) + "\n")
        if not args.no_write:
            write_section("regions-placement", lines)
        log(f"done in {time.monotonic() - started:.0f} s")
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
