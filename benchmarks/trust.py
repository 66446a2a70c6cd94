"""What trust costs and what it catches, on the demo model: checked outputs, detection of a lying peer, and
fair shares under a cache hog.

Verification (`verify`): a bootstrap and two peer processes on 127.0.0.1, each serving all 30 blocks of the
demo model (float32, one core each), so every hop has a replica to be checked against. The client generates
`--tokens` greedy tokens (a streamer times each token as users get it: after its check) for each
`--fractions` (0: no checks), median of `--runs`: decode tokens/s, time to first token, and the held-back
lag (time from the last token made to its release, at the end). Then the split case: one peer serves all
30 blocks and two others [0:15) and [15:30), so the route's one hop is checked through a chain of two.

Detection (`detect`): the same, with one peer lying (noise on its outputs, on every step or on 10% of
steps: `tests/adversary.py`) and made the client's first choice; each trial a fresh session steps the
prompt, then one token at a time until the lie is caught (`Rewound`), at most `--max-steps`: steps until
caught, over `--trials` trials. Then the split case: honest peers serve [0:15) and [15:30), the liar (its
stateless forwards lie too) all 30 blocks; once as the route's first choice, once as the only checker of
the honest pieces (steps until it is convicted, and whether the text was the honest one).

Fairness (`fair`): the demo swarm as `swarm demo` starts it (3 peers [0:10) [10:20) [20:30)); an honest
client's time to first token (greedy, `--runs` runs, median) on the idle swarm, then while a hog (its own
client identity, in this process) holds as many sessions at every peer as the peers let it open (each
filled with a `--hog-prompt`-token prompt, at the peer's longest max length) and keeps stepping them.

    python benchmarks/trust.py [--sections verify detect fair]

Writes its tables into docs/benchmarks.md between its markers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
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

from client.cli import TimedStreamer  # noqa: E402
from client.demo import DEMO_CACHE_TOKENS  # noqa: E402
from swarm.cli import cache_home  # noqa: E402
from swarm.local.demo_model import default_demo_dir, prepare_demo_model  # noqa: E402
from swarm.errors import Rewound  # noqa: E402
from swarm.local.launch import LocalSwarm  # noqa: E402
from swarm.weights.models import local_model_id  # noqa: E402

PROMPT = "Give three tips for staying healthy."


def log(message: str) -> None:
    print(f"[trust] {message}", file=sys.stderr, flush=True)


def start(net: LocalSwarm, path: Path, programs: dict[str, tuple[str, ...]],
          halves: dict[str, tuple[str, ...]] | None = None) -> None:
    """Peers `programs` serving all 30 blocks, and `halves` (two: [0:15), then [15:30))."""
    net.start_bootstrap()
    spans = {**{name: "0:30" for name in programs}, **dict(zip(halves or {}, ("0:15", "15:30")))}
    for name, program in {**programs, **(halves or {})}.items():
        net.start_peer(name, path, "--blocks", spans[name], "--model-id", local_model_id(path), "--cache-tokens",
                       str(DEMO_CACHE_TOKENS), "--threads", "1", wait=False, program=program)
    for name in spans:
        net.wait_serving(net.procs[name], timeout=600)


def client(net: LocalSwarm, path: Path, **options):
    from client.model import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=local_model_id(path),
                                                       **options)


def timed(net: LocalSwarm, path: Path, ids: torch.Tensor, tokenizer, fractions: list[float], args) -> list[tuple]:
    """Per fraction: (fraction, overall tokens/s, first token s, held back s, decode tokens/s), medians of
    `--runs` runs interleaved across fractions."""
    from transformers import LogitsProcessorList

    rows = []
    with contextlib.ExitStack() as stack:  # one client per fraction; runs interleaved, so drift hits all alike
        models = {f: stack.enter_context(client(net, path, verify_fraction=f)) for f in fractions}
        got = {f: ([], [], [], []) for f in fractions}  # rates, decodes, first tokens, lags
        for model in models.values():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm: routes, streams
        for _ in range(args.runs):
            for fraction, model in models.items():
                rates, decodes, ttfts, lags = got[fraction]
                streamer = TimedStreamer(tokenizer, out=io.StringIO())
                made: list[float] = []  # when each token's logits came

                def stamp(input_ids, scores):
                    made.append(time.perf_counter())
                    return scores

                started = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                               min_new_tokens=args.tokens, do_sample=False, pad_token_id=0, streamer=streamer,
                               logits_processor=LogitsProcessorList([stamp]))
                stats = streamer.stats(started)
                rates.append(args.tokens / (streamer.times[-1] - started))
                decodes.append(stats["tokens_per_s"])
                ttfts.append(stats["ttft_s"])
                lags.append(streamer.times[-1] - made[-1])
    for fraction in fractions:
        rates, decodes, ttfts, lags = got[fraction]
        rows.append((fraction, statistics.median(rates), statistics.median(ttfts), statistics.median(lags),
                     statistics.median(decodes)))
        log(f"fraction {fraction}: {rows[-1][1]:.1f} tokens/s, first token {rows[-1][2] * 1e3:.0f} ms")
    return rows


def verify(path: Path, args) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with tempfile.TemporaryDirectory(prefix="swarm-trust-") as root, LocalSwarm(Path(root)) as net:
        start(net, path, {"a": ("-m", "swarm.cli"), "b": ("-m", "swarm.cli")})
        rows = [("replica", *row) for row in timed(net, path, ids, tokenizer, args.fractions, args)]
    split = [f for f in args.fractions if f in (0.0, 0.1)]
    with tempfile.TemporaryDirectory(prefix="swarm-trust-") as root, LocalSwarm(Path(root)) as net:
        start(net, path, {"whole": ("-m", "swarm.cli")}, {"front": ("-m", "swarm.cli"), "back": ("-m", "swarm.cli")})
        rows += [("split", *row) for row in timed(net, path, ids, tokenizer, split, args)]
    lines = ["### Trust: the cost of checked outputs", "",
             f"Machine: {machine()}. Demo model on 127.0.0.1: a bootstrap and 2 peers each serving all 30 blocks "
             "(one core each), so the route's hop has a replica to check against; then (split) one peer serving all "
             "30 blocks and two serving [0:15) and [15:30), so the route's one hop is checked through a chain of "
             f"two. {args.tokens} greedy tokens, median of {args.runs} runs, interleaved across fractions; times as "
             "a streamer receives the tokens (checked output only). Overall tokens/s counts from the request to the "
             "last token (first token and final check included); decode tokens/s from the first token to the last. "
             "The peers and the client share this machine's 2 cores, so checking takes CPU from the route and the "
             "client: an upper bound of the cost on separate machines.", "",
             "| checkers | verify fraction | tokens/s overall | vs no checks | decode tokens/s | vs no checks | "
             "first token (ms) | held back at the end (ms) |", "|---|---|---|---|---|---|---|---|"]
    base = {}
    for layout, fraction, rate, ttft, lag, decode in rows:
        base.setdefault(layout, (rate, decode))
        lines.append(f"| {'one replica' if layout == 'replica' else '[0:15) + [15:30)'} | {fraction:g} | "
                     f"{rate:.1f} | {rate / base[layout][0]:.2f}x | {decode:.1f} | {decode / base[layout][1]:.2f}x | "
                     f"{ttft * 1e3:.0f} | {lag * 1e3:.0f} |")
    return lines


def detect(path: Path, args) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    rows = []
    for mode in ("noisy", "noisy:0.1"):
        with tempfile.TemporaryDirectory(prefix="swarm-trust-") as root, LocalSwarm(Path(root)) as net:
            start(net, path, {"honest": ("-m", "swarm.cli"), "liar": adversary(mode)})
            caught, never, elsewhere = [], 0, 0
            for trial in range(args.trials):
                with client(net, path, route_seed=trial) as model:
                    liar, honest = net.procs["liar"].peer_id, net.procs["honest"].peer_id
                    looks_fast(model, liar, [honest])
                    if model.route()[0].peer != liar:
                        elsewhere += 1
                        continue
                    steps = steps_until_caught(model, ids, args.max_steps)
                if steps is None:
                    never += 1
                else:
                    caught.append(steps)
            rows.append(("every step" if mode == "noisy" else "10% of steps", "one replica, the route's hop",
                         caught, never, "-"))
            log(f"{mode}: caught after {caught} steps; never in {never}; {elsewhere} routed elsewhere (not counted)")
    rows += detect_split(path, ids, args)
    lines = ["### Trust: steps until a lying peer is caught", "",
             f"Machine: {machine()}. Demo model; a lying peer adds noise of half the mean magnitude to its outputs. "
             "One replica: an honest peer and the liar each serve all 30 blocks, and the client's route goes "
             "through the liar first. Split: honest peers serve [0:15) and [15:30) and the liar all 30 blocks "
             "(its stateless forwards lie too), and the client's route goes either through the liar (checked "
             "through the two honest pieces) or through the honest pieces (the liar is their only checker: it "
             "must be found out as a checker, and the text must stay honest). Default verify fraction; each trial "
             "a fresh client and session steps the prompt (step 1), then one token at a time until the liar is "
             f"caught (rewound, or convicted as a checker), at most {args.max_steps} steps; {args.trials} trials.",
             "", "| liar | checkers | caught in | steps until caught: median | max | not caught | honest text |",
             "|---|---|---|---|---|---|---|"]
    for what, layout, caught, never, honest in rows:
        lines.append(f"| {what} | {layout} | {len(caught)}/{len(caught) + never} | "
                     f"{statistics.median(caught) if caught else '-'} | {max(caught) if caught else '-'} | {never} | "
                     f"{honest} |")
    return lines


def looks_fast(model, fast: str, slow: list[str]) -> None:
    """Make `fast` look fastest to the client's routing, and the peers `slow` slow (as if measured so)."""
    measurements = model.connection.client.measurements
    for _ in range(3):
        measurements.step(fast, rtt_ms=1.0, compute_ms=0.5, tokens=1, blocks=30)
        for peer in slow:
            measurements.step(peer, rtt_ms=50.0, compute_ms=40.0, tokens=1, blocks=15)


def detect_split(path: Path, ids: torch.Tensor, args) -> list[tuple]:
    """The split rows of `detect`: the liar as the route's hop, then as the honest pieces' only checker."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-trust-") as root, LocalSwarm(Path(root)) as net:
        start(net, path, {"liar": adversary("liar")}, {"front": ("-m", "swarm.cli"), "back": ("-m", "swarm.cli")})
        liar, pieces = net.procs["liar"].peer_id, [net.procs[n].peer_id for n in ("front", "back")]
        want = None
        for role in ("hop", "checker"):
            caught, never, honest = [], 0, 0
            for trial in range(args.trials):
                with client(net, path, route_seed=trial) as model:
                    if role == "hop":
                        looks_fast(model, liar, pieces)
                    else:
                        looks_fast(model, pieces[0], [liar])  # slow, so the pieces make the route
                        looks_fast(model, pieces[1], [])
                    route = {h.peer for h in model.route()}
                    if (liar in route) != (role == "hop"):
                        log(f"split, liar as {role}: trial {trial} routed otherwise ({route}); not counted")
                        continue
                    if role == "hop":
                        steps = steps_until_caught(model, ids, args.max_steps)
                    else:
                        steps, text = steps_until_convicted(model, ids, args.max_steps, liar)
                        want = want if want is not None else honest_tokens(net, path, ids, args.max_steps)
                        honest += text == want
                (never := never + 1) if steps is None else caught.append(steps)
            rows.append(("every step", "[0:15) + [15:30), the route's hop" if role == "hop"
                         else "the liar, checking the honest pieces", caught, never,
                         "-" if role == "hop" else f"{honest}/{len(caught) + never}"))
            log(f"split, liar as {role}: caught after {caught} steps; never in {never}")
    return rows


def steps_until_convicted(model, ids: torch.Tensor, max_steps: int, liar: str) -> tuple[int | None, list[int]]:
    """Greedy steps a fresh session takes until the client convicts `liar` (a checker), and the tokens made
    (all `max_steps`, checked)."""
    convicted = model.connection.client.failures.convicted
    steps, tokens = None, []
    with model.inference_session(max_length=ids.shape[1] + max_steps + 1) as session:
        out = session.step(ids)
        for step in range(1, max_steps + 1):
            if steps is None and liar in convicted:
                steps = step
            tokens.append(int(out[0, -1].argmax()))
            if step < max_steps:
                out = session.step(out[:, -1:].argmax(-1))
        model.connection.run(session.session.verify())
        if steps is None and liar in convicted:
            steps = max_steps
    return steps, tokens


def honest_tokens(net: LocalSwarm, path: Path, ids: torch.Tensor, count: int) -> list[int]:
    """The greedy tokens of the model run locally by transformers: the honest text."""
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = []
    with torch.inference_mode():  # argmax at every step, as `steps_until_convicted` takes it (past an end token too)
        for _ in range(count):
            tokens.append(int(local(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens


def steps_until_caught(model, ids: torch.Tensor, max_steps: int) -> int | None:
    """Steps a fresh session takes (the prompt is step 1) before its next step finds the lie caught."""
    with model.inference_session(max_length=ids.shape[1] + max_steps + 1) as session:
        out, steps = session.step(ids), 1
        try:
            while steps < max_steps:
                out = session.step(out[:, -1:].argmax(-1))
                steps += 1
            model.connection.run(session.session.verify())
        except Rewound:
            return steps
    return None


async def hog_sessions(node, net: LocalSwarm, path: Path, prompt: int, limit: int = 64) -> list[list]:
    """As many sessions at every peer as it lets this client open (at most `limit` each), each filled with
    `prompt` tokens: [session, hidden size, length] each."""
    from client.inference.peer_session import PeerSession
    from swarm.net.calls import info
    from swarm.errors import SwarmError
    from swarm.span import Span

    sessions = []
    for name in ("peer0", "peer1", "peer2"):
        peer = net.procs[name].peer_id
        about = await info(node, peer)
        for _ in range(limit):
            try:
                session = await PeerSession.open(node, peer, local_model_id(path), Span(about.start, about.end),
                                                 max_length=about.max_length)
                await session.step(torch.randn(1, prompt, about.hidden_size), 0)
            except SwarmError:
                break
            sessions.append([session, about.hidden_size, prompt])
    return sessions


async def keep_stepping(sessions: list[list], stop) -> int:
    """One token at a time through every session, round and round, until `stop` is set; steps taken. A session
    the peer reclaimed for another client is dropped."""
    from swarm.errors import SwarmError

    steps = 0
    while not stop.is_set() and sessions:
        for entry in list(sessions):
            if stop.is_set():
                break
            session, hidden, length = entry
            try:
                await session.step(torch.randn(1, 1, hidden), length)
            except SwarmError:
                sessions.remove(entry)
                continue
            entry[2] += 1
            steps += 1
    return steps


async def close_all(sessions: list) -> None:
    import asyncio

    await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


def fair(path: Path, args) -> list[str]:
    import asyncio
    import threading

    from transformers import AutoTokenizer

    from client.demo import start_swarm
    from client.loop import LoopThread
    from swarm.net.identity import Identity
    from swarm.net.transport import Node

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids

    def ttfts(model) -> float:
        times = []
        for _ in range(args.runs):
            streamer = TimedStreamer(tokenizer, out=io.StringIO())
            started = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, pad_token_id=0, streamer=streamer)
            times.append(streamer.stats(started)["ttft_s"])
        return statistics.median(times)

    with tempfile.TemporaryDirectory(prefix="swarm-trust-") as root, LocalSwarm(Path(root)) as net:
        start_swarm(net, path, 3, "float32", local_model_id(path))
        with client(net, path) as model:
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm
            idle = ttfts(model)
        log(f"idle: first token {idle * 1e3:.0f} ms")
        with LoopThread() as loop:
            node = Node(Identity.generate(), initial_peers=net.bootstrap_addrs, client_mode=True)
            loop.run(node.__aenter__(), timeout=60)
            try:
                sessions = loop.run(hog_sessions(node, net, path, args.hog_prompt), timeout=600)
                held = len(sessions)
                log(f"the hog holds {held} sessions of {args.hog_prompt} tokens")
                stop = threading.Event()
                stepping = asyncio.run_coroutine_threadsafe(keep_stepping(sessions, stop), loop.loop)
                with client(net, path) as model:
                    busy = ttfts(model)
                stop.set()
                hog_steps = stepping.result(120)
                left = len(sessions)
                loop.run(close_all([e[0] for e in sessions]), timeout=60)
            finally:
                loop.run(node.__aexit__(None, None, None), timeout=30)
    log(f"with the hog: first token {busy * 1e3:.0f} ms ({busy / idle:.2f}x)")
    return ["### Trust: an honest client beside a cache hog", "",
            f"Machine: {machine()}. Demo swarm (3 peers [0:10) [10:20) [20:30), default peer options) on 127.0.0.1; "
            f"time to first token of an honest client (4 greedy tokens, median of {args.runs}), on the idle swarm and "
            f"while a hog that opened {held} sessions (as many as the peers let it open; {args.hog_prompt}-token prompts "
            "at the peers' longest max length) steps them one token at a time, round and round "
            f"({hog_steps} hog steps meanwhile; by the end the peers had reclaimed {held - left} of them, for the "
            "hog's own later sessions or for the honest client).", "",
            "| swarm | first token (ms) | vs idle |", "|---|---|---|",
            f"| idle | {idle * 1e3:.0f} | 1.00x |", f"| with the hog | {busy * 1e3:.0f} | {busy / idle:.2f}x |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", nargs="+", default=["verify", "detect", "fair"],
                        choices=["verify", "detect", "fair"])
    parser.add_argument("--hog-prompt", type=int, default=256)
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.1, 0.25, 1.0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=64)
    args = parser.parse_args()
    path = prepare_demo_model(default_demo_dir(cache_home()))
    for section in args.sections:
        lines = {"verify": verify, "detect": detect, "fair": fair}[section](path, args)
        print(write_section(f"trust-{section}", lines))


if __name__ == "__main__":
    main()
