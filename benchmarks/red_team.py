"""Red team: what liars with fresh identities get out of the swarm, on the demo model.

Each attack starts its own swarm on 127.0.0.1 (a bootstrap and honest peers serving [0:15) and [15:30), one core
each) and the attack's liars (`tests/adversary.py`, real peer processes with one behaviour altered), then runs
`--generations` generations of `--tokens` greedy tokens, each by a fresh client (its own identity, no history)
whose routing is made to prefer the liars (as their claims would have it) when they serve a route, or the honest
pieces when the liars can only check them. Each generation's text is compared with transformers' own (the model
run locally): right, wrong with no error, or failed with an error. Also: clients that banned an honest peer (for
any reason, any length), clients that convicted every liar they met, the client's own block computations that
settled disputes, and the median time of a generation against the same swarm with no liar.

Attacks:
- `noise`: one liar adds noise to everything it computes, serving [15:30) beside the honest replica.
- `other-weights`: one liar computes with other weights (consistent everywhere), serving [15:30) beside it.
- `self-contradicting`: one liar serving [0:30), honest on parts, the same lie on its sessions and whole span.
- `framers-2`, `framers-5`: 2 or 5 identities with the same wrong weights, serving [0:30): the only checkers of
  the honest pieces, agreeing with each other against every honest hop.
- `stall-1`, `stall-10`: 1 or 10 identities serving [0:30) that claim 1e9 tokens/s, answer pings, open sessions
  and never answer a step; the client routes as it would (their claims are the attack).
- `slots-4`: 4 identities (in this process) each open 16 sessions at each honest peer (all 64 slots, each at its
  25% share) and step every one of them every 3 s, so none is idle; then the honest clients generate.

    python benchmarks/red_team.py [--attacks ...] [--generations 10] [--tokens 16]

Writes its table into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "tests")]

from adversary import adversary  # noqa: E402
from report import machine, write_section  # noqa: E402
from trust import PROMPT, client, log, looks_fast  # noqa: E402

from swarm.cli import cache_home  # noqa: E402
from swarm.errors import SwarmError  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

HONEST = {"front": "0:15", "back": "15:30"}
# attack -> (liars' program, how many, their blocks, whether the route goes through them: None, as it would)
ATTACKS = {
    "none": ("", 0, "", False),
    "noise": ("liar", 1, "15:30", True),
    "other-weights": ("other-weights", 1, "15:30", True),
    "self-contradicting": ("self-contradicting", 1, "0:30", True),
    "framers-2": ("other-weights:1", 2, "0:30", False),
    "framers-5": ("other-weights:1", 5, "0:30", False),
    "stall-1": ("stall", 1, "0:30", None),
    "stall-10": ("stall", 10, "0:30", None),
    "slots-4": ("", 0, "", None),
}
SLOT_HOLDERS, SLOTS_EACH, STEP_EVERY_S = 4, 16, 3.0


def swarm(net: LocalSwarm, path: Path, attack: str) -> tuple[list[str], list[str]]:
    """The honest peers and the attack's liars, serving: (honest ids, liar ids)."""
    program, count, blocks, _ = ATTACKS[attack]
    net.start_bootstrap()
    peers = {name: (span, ("-m", "swarm.cli")) for name, span in HONEST.items()}
    peers.update({f"liar{i}": (blocks, adversary(program)) for i in range(count)})
    for name, (span, prog) in peers.items():
        net.start_peer(name, path, "--blocks", span, "--model-id", local_model_id(path), "--threads", "1",
                       wait=False, program=prog)
    for name in peers:
        net.wait_serving(net.procs[name], timeout=600)
    return [net.procs[n].peer_id for n in HONEST], [net.procs[n].peer_id for n in peers if n.startswith("liar")]


def run(path: Path, attack: str, ids: torch.Tensor, want: list[int], args) -> dict:
    through = ATTACKS[attack][3]
    row = {"right": 0, "wrong": 0, "failed": 0, "framed": 0, "convicted": 0, "referee": 0, "times": [], "errors": []}
    with tempfile.TemporaryDirectory(prefix="swarm-redteam-") as root, LocalSwarm(Path(root)) as net, \
            contextlib.ExitStack() as stack:
        honest, liars = swarm(net, path, attack)
        if attack == "slots-4":
            stack.enter_context(slot_holders(net, path, honest))
        for trial in range(args.generations):
            with client(net, path, route_seed=trial) as model:
                swarm_client = model.connection.client
                model.connection.run(swarm_client.refresh(force=True))
                if through:
                    looks_fast(model, liars[0], honest)
                elif through is not None:
                    looks_fast(model, honest[0], liars)
                    looks_fast(model, honest[1], [])
                started = time.perf_counter()
                try:
                    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                         min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
                    right = got[0, ids.shape[1]:].tolist() == want
                    row["right" if right else "wrong"] += 1
                except SwarmError as e:
                    row["failed"] += 1
                    row["errors"].append(f"{type(e).__name__}: {e}"[:200])
                row["times"].append(time.perf_counter() - started)
                row["framed"] += any(swarm_client.bans.banned(p) for p in honest)
                row["convicted"] += len({p for p in liars if p in swarm_client.failures.convicted
                                         or swarm_client.bans.reasons.get(p) == "stalled"})
                row["referee"] += swarm_client.referee.runs
        log(f"{attack}: {row['right']} right, {row['wrong']} wrong, {row['failed']} failed, {row['framed']} framed, "
            f"median {statistics.median(row['times']):.1f} s; errors {row['errors'][:2]}")
    return row


@contextlib.contextmanager
def slot_holders(net: LocalSwarm, path: Path, peers: list[str]):
    """`SLOT_HOLDERS` identities holding `SLOTS_EACH` sessions at each of `peers`, each stepped every
    `STEP_EVERY_S` seconds, for the block."""
    import asyncio

    from client.inference.peer_session import PeerSession
    from client.loop import LoopThread
    from swarm.net.calls import info
    from swarm.net.identity import Identity
    from swarm.net.transport import Node
    from swarm.span import Span

    async def hold(node, stop: asyncio.Event) -> int:
        sessions = []
        for peer in peers:
            about = await info(node, peer)
            for _ in range(SLOTS_EACH):
                session = await PeerSession.open(node, peer, local_model_id(path), Span(about.start, about.end),
                                                 max_length=256)
                sessions.append([session, about.hidden_size, 0])
        steps = 0
        while not stop.is_set():
            for entry in list(sessions):
                session, hidden, length = entry
                try:
                    await session.step(torch.randn(1, 1, hidden), length)
                    entry[2] += 1
                    steps += 1
                except SwarmError:  # reclaimed for another client: open it again, as a holder would
                    sessions.remove(entry)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), STEP_EVERY_S)
        await asyncio.gather(*(s[0].close() for s in sessions), return_exceptions=True)
        return steps

    with LoopThread() as loop:
        nodes = [Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True)
                 for _ in range(SLOT_HOLDERS)]
        for node in nodes:
            loop.run(node.__aenter__(), timeout=60)
        stop = asyncio.Event()
        tasks = [asyncio.run_coroutine_threadsafe(hold(node, stop), loop.loop) for node in nodes]
        time.sleep(10)  # every session open and stepped once
        log(f"slot holders: {SLOT_HOLDERS} x {SLOTS_EACH} sessions at each of {len(peers)} peers")
        try:
            yield
        finally:
            loop.loop.call_soon_threadsafe(stop.set)
            steps = [t.result(120) for t in tasks]
            log(f"slot holders stepped {sum(steps)} times")
            for node in nodes:
                loop.run(node.__aexit__(None, None, None), timeout=30)


def cpu() -> str:
    """The CPU's model and the flags that decide its speed here (`lscpu` says the same)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "CPU unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{model}, {' '.join(f for f in ('avx2', 'avx512_vnni', 'avx512_bf16', 'amx_tile') if f in flags)}"


def honest_tokens(path: Path, ids: torch.Tensor, count: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--generations", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    want = honest_tokens(path, ids, args.tokens)
    rows = {attack: run(path, attack, ids, want, args) for attack in args.attacks}
    base = statistics.median(rows["none"]["times"]) if "none" in rows else None
    lines = [f"Machine: {machine()} ({cpu()}). `python benchmarks/red_team.py` (the module docstring says each "
             "attack). Demo "
             "model on 127.0.0.1, honest peers serving [0:15) and [15:30) (one core each); each generation "
             f"({args.tokens} greedy tokens) by a fresh client that prefers the liars' route when they serve one. "
             "Right / wrong with no error / failed with an error: the text against transformers'. Honest peers "
             "banned: clients that banned an honest peer (for any reason). Liars convicted: over all clients. "
             "Attackers caught: over all clients, liars convicted and stalling peers avoided (`stalled`: by the first "
             "client that met them, then by the machine's later clients from their start). Blocks computed here: the "
             "clients' own block computations that settled disputes. Time: median and slowest generation, and the "
             "median against the same swarm with no liar.", "",
             "| attack | identities | right | wrong, no error | failed, with error | clients that banned an honest "
             "peer | attackers caught | blocks computed here | median time (s) | slowest (s) | vs no liar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for attack, row in rows.items():
        count = ATTACKS[attack][1]
        median = statistics.median(row["times"])
        ratio = f"{median / base:.2f}x" if base else "-"
        lines.append(f"| {attack} | {count} | {row['right']} | {row['wrong']} | {row['failed']} | {row['framed']} | "
                     f"{row['convicted']} of {count * args.generations} | {row['referee']} | {median:.1f} | "
                     f"{max(row['times']):.1f} | {ratio} |")
    print(write_section("red-team", lines))


if __name__ == "__main__":
    main()
