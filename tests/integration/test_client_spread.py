"""Load in the route: eight concurrent sessions of one client over two replicas of the whole model split
about evenly (each session's hops count toward its peer's load), and every session's greedy tokens
still equal transformers run locally; `swarm status` shows the load peers announce.

A swarm of its own: two peers, both with `--blocks 0:6` (the whole of a wider tiny llama), started one
after the other so that the second reuses the first's measured speed (the peers' capacity cache): equal
replicas announce equal figures. The client pings both a few times before the sessions start, as a client
running for a while would have, so that its delay figures are settled rather than one noisy ping each.
The model is wider than the other tests' (hidden 512: ~2.3 ms per block and decode step, ~14 ms a token):
on the usual one (~0.4 ms per block) a session's share of load (0.2 x 2.6 ms) was smaller than the noise
of loopback pings on a busy machine, and once put six sessions of eight on one replica.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.inference import peer_session
from client.model import DistributedModelForCausalLM
from client.inference.routing import REROUTE_AFTER
from client.inference.session import InferenceSession
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm
from tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
SESSIONS = 8
DECODE = REROUTE_AFTER - 1  # decode steps per session: fewer than trigger the route's second look


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt-wide-llama"), seed=0, hidden_size=512,
                                 intermediate_size=2048, head_dim=128)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, wide_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("spread"))
    try:
        net.start_bootstrap()
        for name in ("replica-a", "replica-b"):
            net.start_peer(name, wide_llama, "--blocks", "0:6", *PEER_OPTIONS)
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def expected(wide_llama):
    local = AutoModelForCausalLM.from_pretrained(wide_llama, dtype=torch.float32).eval()
    return local.generate(PROMPT, max_new_tokens=DECODE + 1, do_sample=False, pad_token_id=0)[0, PROMPT.shape[1]:]


async def greedy(session: InferenceSession, head, started: asyncio.Event, opened: list) -> list[int]:
    """The prompt, then `DECODE` greedy tokens; waits after the prompt until every session has its route."""
    out = await session.step(head.embed(PROMPT, 0))
    opened.append(session)
    if len(opened) == SESSIONS:
        started.set()
    await asyncio.wait_for(started.wait(), 60)
    tokens = []
    for step in range(DECODE + 1):
        tokens.append(int(head.logits(out[:, -1:]).argmax(-1)))
        if step < DECODE:
            out = await session.step(head.embed(torch.tensor([[tokens[-1]]]), PROMPT.shape[1] + step))
    return tokens


async def run_sessions(model) -> tuple[list[list[int]], list, dict[str, int]]:
    client = model.connection.client
    await client.refresh(force=True)
    for _ in range(5):
        await client.ping_all(list(client.offers))
    sessions = [InferenceSession(client, 32) for _ in range(SESSIONS)]
    started, opened = asyncio.Event(), []
    try:
        tokens = await asyncio.gather(*(greedy(s, model.head, started, opened) for s in sessions))
        routes = [s.route for s in sessions]
        peers = {h.peer for r in routes for h in r}
        infos = {p: (await peer_session.info(client.node, p, timeout=10)).sessions for p in peers}
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    return tokens, routes, infos


def test_concurrent_sessions_of_one_client_spread_over_replicas(replicas, wide_llama, expected):
    # no checked outputs: their shadow sessions on the other replica would count in the peers' sessions too
    with DistributedModelForCausalLM.from_pretrained(wide_llama, replicas.bootstrap_addrs, model_id=MODEL_ID,
                                                     route_seed=5, verify_fraction=0) as model:
        tokens, routes, infos = model.connection.run(run_sessions(model), timeout=180)
        assert not model.connection.client.own_load  # every session's load went with it
    assert all(t == expected.tolist() for t in tokens)
    assert all(len(r) == 1 and str(r[0].span) == "[0:6)" for r in routes)  # one hop is cheapest
    per_peer = {p.peer_id: sum(r[0].peer == p.peer_id for r in routes) for p in replicas.procs.values()
                if p.name.startswith("replica")}
    assert sorted(per_peer.values()) in ([4, 4], [3, 5]), per_peer
    assert {p: infos.get(p, 0) for p in per_peer} == per_peer  # the peers count the same sessions


def test_status_shows_the_load_peers_announce(replicas):
    def status(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "swarm.cli", "status", "--model-id", MODEL_ID, "--num-blocks",
                               "6", "--initial-peers", *replicas.bootstrap_addrs, *extra], capture_output=True,
                              text=True, timeout=120)

    done = status("--json")
    assert done.returncode == 0, done.stderr[-3000:]
    peers = json.loads(done.stdout)["peers"]
    assert len(peers) == 2 and all(type(p["sessions"]) is int and type(p["queued"]) is int for p in peers)
    assert all("links" in p and "since" in p for p in peers)
    table = status()
    assert table.returncode == 0 and "SESSIONS QUEUED" in table.stdout and table.stdout.count(" online ") == 2
