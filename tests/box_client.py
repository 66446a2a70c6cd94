"""A client run inside a box's namespace (see `box_swarm.py`): join the swarm, generate greedily, report.

    python tests/box_client.py --model DIR --model-id ID --initial-peers ADDR... --prompt 5,17,42
        --new-tokens 24 [--pause-after 8] [--config '{"wait_for_blocks": 0}']

Prints one JSON object per line on stdout: `joined` (seconds to join), `paused` (after `--pause-after` new
tokens: the route then; it then waits for a line on stdin before it goes on), then `done` (the whole output
ids, the route, the failovers, the addresses of its connections to the route's peers) or `error` (the
exception's type and message, with its causes, and what one more call to each `--probe` peer gives). Logs go
to stderr. Checked outputs are off (as in the
failover tests): the stream is timed token by token.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
import traceback


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def route_of(session) -> list[list[str]]:
    return [[h.peer, str(h.span)] for h in session.route] if session is not None else []


class Pause:
    """A streamer: after `after` new tokens, reports the route and waits for a line on stdin."""

    def __init__(self, session, after: int | None):
        self.session, self.after, self.puts = session, after, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.after is not None and self.puts == self.after + 1:  # the first put is the prompt
            emit("paused", route=route_of(self.session), at=time.time())
            sys.stdin.readline()

    def end(self) -> None:
        pass


async def connections(node, peers: list[str]) -> dict[str, list[str]]:
    """The remote addresses of this node's connections to `peers` (a relayed one ends in /p2p-circuit)."""
    if not hasattr(node, "peer_addrs"):  # the light client's node: direct connections only
        return {}
    return {peer: addrs for peer, addrs in (await node.peer_addrs()).items() if peer in peers}


async def probe(node, peers: list[str]) -> dict[str, str]:
    """What one `info` call to each peer gives now: "ok", or the transport's error (after a failed run, the
    error its own failure policy summarised)."""
    from swarm.net import calls

    out = {}
    for peer in peers:
        try:
            await calls.info(node, peer)
            out[peer] = "ok"
        except Exception as e:  # boundary: any failure is the answer
            out[peer] = f"{type(e).__name__}: {e}"
    return out


def causes(error: BaseException) -> list[str]:
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return chain


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pause-after", type=int)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--debug", action="store_true", help="log debug messages too")
    parser.add_argument("--probe", nargs="*", default=[], help="peers to call once more after a failure")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(1)
    from client.model import DistributedModelForCausalLM

    options = {"verify_fraction": 0, **json.loads(args.config)}
    started = time.monotonic()
    model = None
    try:
        model = DistributedModelForCausalLM.from_pretrained(args.model, args.initial_peers, model_id=args.model_id,
                                                            **options)
        emit("joined", seconds=time.monotonic() - started)
        prompt = torch.tensor([[int(t) for t in args.prompt.split(",")]])
        with model.inference_session(max_length=prompt.shape[1] + args.new_tokens) as session:
            streamer = Pause(session, args.pause_after)
            out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                                 streamer=streamer)
            peers = [h.peer for h in session.route]
            conns = model.connection.run(connections(model.connection.node, peers), timeout=10)
            emit("done", tokens=out.tolist(), route=route_of(session), connections=conns, at=time.time(),
                 failovers=[dataclasses.asdict(f) for f in session.failovers])
    except Exception as e:  # boundary: every failure is reported to the test as an event
        probes = {}
        if model is not None and args.probe:
            with contextlib.suppress(Exception):
                probes = model.connection.run(probe(model.connection.node, args.probe), timeout=30)
        emit("error", type=type(e).__name__, message=str(e), causes=causes(e), probes=probes,
             traceback=traceback.format_exc())
        return 1
    finally:
        if model is not None:
            model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
