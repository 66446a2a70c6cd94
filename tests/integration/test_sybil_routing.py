"""Sybil records: many identities, each with a valid signature of its own and no process behind it, announce
every block at an absurd throughput. Fresh clients must still route through the honest peers only, get
transformers' local tokens, and ban the fakes they tried.

A swarm of its own: blocks [0:3) on one peer, [3:6) on another, both with fixed spans (the fakes would
otherwise sway where peers place themselves). The fakes are records stored by a test node, not peers.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client.model import DistributedModelForCausalLM
from client.inference.swarm_client import MAX_PINGS
from swarm import __version__
from swarm.net import records
from swarm.errors import NoRoute
from swarm.net.identity import Identity
from swarm.net.transport import key_id
from swarm.weights.digest import local_digest
from swarm_harness import LocalSwarm, MODEL_ID, client_node, start_split

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
NEW_TOKENS = 12
NUM_BLOCKS = 6
SYBILS = 48  # more than a client pings per refresh
CLAIMED_TPS = 1e9
FRESH_CLIENTS = 3


def sybil_records(identities: list[Identity], digest: str, ttl: float = 120.0) -> list[tuple[str, str, bytes, float]]:
    """One online record per fake for every block: the whole model, absurdly fast, with room for anything, and
    sequence numbers far above the honest peers' (readers see them first)."""
    now = time.time()
    items = []
    for identity in identities:
        ann = records.Announcement(identity.peer_id, MODEL_ID, 0, NUM_BLOCKS, "online", CLAIMED_TPS, CLAIMED_TPS,
                                   10**9, __version__, int(now * 1000) + 10**9, now, NUM_BLOCKS, sessions=0, queued=0,
                                   digest=digest)  # the honest peers' weights, copied
        for block in range(NUM_BLOCKS):
            key = records.block_key(MODEL_ID, block)
            items.append((key, identity.peer_id, records.seal(identity, ann, key_id(key), now + ttl), now + ttl))
    return items


@pytest.fixture(scope="module")
def honest_swarm(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("sybil"))
    try:
        start_split(net, tiny_llama)
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def sybils(honest_swarm, loop, tiny_llama) -> set[str]:
    """The fakes' peer ids, once their records can be read back."""
    identities = [Identity.generate() for _ in range(SYBILS)]
    with client_node(loop, honest_swarm.bootstrap_addrs) as node:
        stored = loop.run(node.put_records(sybil_records(identities, local_digest(tiny_llama, None))))
        assert sum(stored.values()) == SYBILS * NUM_BLOCKS
        found = loop.run(node.get_records([records.block_key(MODEL_ID, 0)]))[records.block_key(MODEL_ID, 0)]
        assert {i.peer_id for i in identities} <= set(found)
    return {i.peer_id for i in identities}


@pytest.fixture(scope="module")
def expected(tiny_llama):
    local = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return local.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()


def test_fresh_clients_route_around_record_only_sybils(honest_swarm, sybils, tiny_llama, expected, caplog):
    honest = {honest_swarm.procs[name].peer_id for name in ("head-span", "tail")}
    outcomes = []
    for _ in range(FRESH_CLIENTS):
        caplog.clear()
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, honest_swarm.bootstrap_addrs,
                                                         model_id=MODEL_ID) as model:
            started = time.monotonic()
            try:
                got = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0).tolist()
            except NoRoute as e:
                swarm = model.connection.client
                got = f"{e}; honest peers' bans: {[swarm.bans.reasons.get(p) for p in honest]}"
            outcomes.append((got == expected, round(time.monotonic() - started, 1), str(got)[-300:]))
            if got != expected:
                continue
            swarm = model.connection.client
            assert sybils <= set(swarm.offers)  # the fakes were read
            assert {h.peer for h in model.route()} == honest
            tried = {p for p in sybils if p in swarm.bans.failures}
            assert len(tried) >= min(SYBILS, MAX_PINGS) - len(honest)  # each fake it pinged failed and is banned
            assert all(swarm.bans.banned(p) for p in tried)
            assert not any(swarm.measurements.proven(p) for p in sybils)
            assert not any(swarm.bans.banned(p) for p in honest)
            # no session ever went to a fake: no hop failed, nothing was rerouted
            assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                        and r.name.startswith("client.")]
    assert all(ok for ok, _, _ in outcomes), outcomes
