"""A NAT'd peer's only relay dies: how long until it takes another and serves again, measured in an internet in
a box (`tests/netbox.py`).

    python benchmarks/relay_loss.py [--runs 5] [--tokens 16] [--root DIR] [--no-write]

The demo model (SmolLM2-135M-Instruct, 30 blocks) in float32. Two regions, 2 ms one way within each, 30 ms
between; the bootstrap is public in us. Per run, a fresh box: in eu, the public peer pub-a [0:15), then a
NAT'd peer nat [15:30), which starts when pub-a is the only public peer near it (the bootstrap is 60 ms away:
not near) and so holds a slot on pub-a only; then the public peer pub-b [0:15). A NAT'd client in eu
generates through nat (its connection to nat relayed by pub-a) and pauses after 4 tokens; pub-a is killed and the generation goes on. Timed
from the kill: nat's daemon holding a slot on pub-b (its own addresses, read every 0.5 s), and the first token
of the first of fresh NAT'd clients started one after another from the kill (each joins through the bootstrap
alone and can reach nat only through a relay; one that finds no live server of [15:30) fails at once, as a
new generation does, and the next starts). Both generations must
give local transformers' greedy tokens. Needs root (network namespaces), `ip`, `nft` and `tc`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

from box_links import relays  # noqa: E402
from box_swarm import wait_until  # noqa: E402
from home_routers import machine_line  # noqa: E402
from regions import demo_greedy  # noqa: E402

PEER_OPTIONS = ("--cache-tokens", "4096", "--announce-interval", "3", "--record-ttl", "20")
START_S, RUN_S = 300, 300
DEBUG = False  # the running client's log at debug level
NEW_CLIENTS_S = 90  # fresh clients are started one after another for this long after the kill


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def slots(proc) -> list[str]:
    try:
        return asyncio.run(relays(proc.popen.pid))
    except Exception:  # its daemon starting again: no answer yet
        return []


def one_run(args, bench, want: list[int], root: Path) -> dict:
    from box_swarm import BoxSwarm
    from netbox import Box

    prompt = bench.prompt[0].tolist()
    with Box(regions={"eu": 2.0, "us": 2.0}, between_ms=30.0) as box:
        sw = BoxSwarm(box, root, bench.path, bench.model_id, PEER_OPTIONS)
        try:
            boot = sw.bootstrap(box.public("boot", region="us"))
            pub_a = sw.peer("pub-a", box.public("pub-a", region="eu"), "0:15", [boot.addr])
            sw.wait_serving([pub_a], START_S)
            met = root / "bootstrap" / "identity.key.known-peers.json"
            wait_until(lambda: met.exists() and pub_a.peer_id in met.read_text(), 150, "the bootstrap to remember pub-a")
            nat = sw.peer("nat", box.home("nat", region="eu"), "15:30", [boot.addr])
            sw.wait_serving([nat], START_S)
            held = wait_until(lambda: slots(nat), 60, "nat to hold a slot", interval=0.5, diagnostics=nat.tail)
            if held != [pub_a.peer_id]:
                raise RuntimeError(f"nat holds slots on {held}, not on pub-a alone")
            pub_b = sw.peer("pub-b", box.public("pub-b", region="eu"), "0:15", [boot.addr])
            sw.wait_serving([pub_b], START_S)
            for attempt in range(1, 4):  # a new generation fails at once when its first dial of the NAT'd peer fails
                running = sw.client(f"cli-run{attempt}", box.home(f"cli-run{attempt}", region="eu"), [boot.addr], prompt,
                                    args.tokens, pause_after=4, wait_for_blocks=120.0, debug=DEBUG)
                started = running.expect("paused", RUN_S)
                if started["event"] == "paused":
                    break
                log(f"cli-run{attempt} did not start: {started.get('type')}: {started.get('message')}")
            else:
                raise RuntimeError(f"cli-run did not start: {started}\n{running.proc.tail()}")
            sw.kill(pub_a)
            killed = time.time()
            running.go()
            slot: list[float] = []
            watch = threading.Thread(target=lambda: slot.append(wait_until(
                lambda: slots(nat) == [pub_b.peer_id] and time.time(), 60, "nat to hold a slot on pub-b", interval=0.5)),
                daemon=True)
            watch.start()
            fresh, first, tries = None, {}, 0
            while time.time() - killed < NEW_CLIENTS_S:  # fresh clients one after another from the kill on
                tries += 1
                fresh = sw.client(f"cli-new{tries}", box.home(f"cli-new{tries}", region="eu"), [boot.addr], prompt,
                                  args.tokens, pause_after=1)
                first = fresh.expect("paused", RUN_S)
                if first["event"] == "paused":
                    break
            if first.get("event") != "paused":
                raise RuntimeError(f"no fresh client got a token within {NEW_CLIENTS_S} s: {first}")
            fresh.go()
            fresh_done, done = fresh.expect("done", RUN_S), running.expect("done", RUN_S)
            watch.join(60)
            if not slot:
                raise RuntimeError(f"nat held no slot on pub-b within 60 s of the kill\n{nat.tail()}")
            slot_s = slot[0] - killed
            out = {"slot_s": slot_s, "first_s": first.get("at", float("nan")) - killed,
                   "same": done.get("tokens", [[]])[0][len(prompt):] == want,
                   "fresh_same": fresh_done.get("tokens", [[]])[0][len(prompt):] == want,
                   "through_nat": nat.peer_id in [p for p, _ in first.get("route", [])],
                   "failovers": len(done.get("failovers", [])), "clients": tries, "running_starts": attempt}
            if not (out["same"] and out["fresh_same"]):
                raise SystemExit(f"tokens differ from local transformers': {done}\n{fresh_done}")
            return out
        except BaseException:
            log("failed; the processes' last lines:\n" + sw.diagnostics())
            raise


def report(args, rows: list[dict]) -> list[str]:
    slot, first = [r["slot_s"] for r in rows], [r["first_s"] for r in rows]
    return [f"`python benchmarks/relay_loss.py --runs {args.runs}` on {machine_line()}. Two regions (2 ms one way "
            "within, 30 ms between), the bootstrap in us; in eu a public peer pub-a [0:15), a NAT'd peer [15:30) "
            "whose only relay is pub-a, a second public peer pub-b [0:15) started after it; a generation through "
            "the NAT'd peer (relayed by pub-a) paused after 4 tokens when pub-a is killed, then resumed; fresh NAT'd "
            "clients started one after another from the kill, each joining through the bootstrap alone (the first "
            f"to get a token counts; its start, about 5 s, included). {args.tokens} greedy tokens each, equal to local transformers' in every run. "
            "Seconds from the kill.", "",
            "| runs | NAT'd peer holds a slot on pub-b (median s) | slowest | within 30 s | fresh client's first token "
            "(median s) | slowest | through the NAT'd peer | running generations: same tokens | fresh clients started "
            "(median) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {len(rows)} | {statistics.median(slot):.1f} | {max(slot):.1f} | {sum(s <= 30 for s in slot)}/{len(slot)} "
            f"| {statistics.median(first):.1f} | {max(first):.1f} | {sum(r['through_nat'] for r in rows)}/{len(rows)} "
            f"| {sum(r['same'] for r in rows)}/{len(rows)} | {statistics.median(r['clients'] for r in rows):g} |", "",
            f"The running generation's client was started again {sum(r['running_starts'] - 1 for r in rows)} times in "
            f"{len(rows)} runs, before any fault: its first dial of the NAT'd peer failed (connection lost) and a new "
            "generation whose only server just failed ends at once (NoRoute)."]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh boxes")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generation")
    parser.add_argument("--root", type=Path, help="keep the processes' logs here (default: a temporary folder)")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import netbox

    if reason := netbox.available():
        raise SystemExit(f"relay_loss: {reason}")
    from report import write_section

    started = time.monotonic()
    root = args.root or Path(tempfile.mkdtemp(prefix="swarm-relay-loss-"))
    try:
        bench, want = demo_greedy(root, args.tokens)
        rows = []
        for i in range(args.runs):
            rows.append(one_run(args, bench, want, root / f"run{i}"))
            log(f"run {i + 1}: {rows[-1]}")
        lines = ["### Regions: a relay's loss", "", *report(args, rows)]
        print("\n".join(lines) + "\n")
        if not args.no_write:
            write_section("regions-relay-loss", lines)
        log(f"done in {time.monotonic() - started:.0f} s")
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
