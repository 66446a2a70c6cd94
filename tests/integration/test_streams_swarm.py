"""Families whose layers take more than the hidden states, served by real peers: what crosses the wire between
spans is the boundary tensor (hidden states, then the family's other per-token streams: `swarm.model.streams`),
so a swarm of three peers generates exactly the tokens transformers generates in this process.

ZAYA: each peer's last layer returns the router state the next peer's first layer takes (a span boundary that
carried only the hidden states would change every token after the first span).
"""

from __future__ import annotations

import pytest
import torch
from family_harness import build
from transformers import AutoModelForCausalLM

from client.model import DistributedModelForCausalLM
from swarm.model.checkpoint import Checkpoint
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
TOKENS = 10


@pytest.fixture(scope="module")
def streams_swarm(tmp_path_factory):
    """A tiny ZAYA checkpoint and a bootstrap with three peers serving [0:2), [2:4), [4:6) of it."""
    path = build("zaya", tmp_path_factory.mktemp("ckpt-zaya"))
    net = LocalSwarm(tmp_path_factory.mktemp("swarm-zaya"))
    try:
        net.start_bootstrap()
        for name, blocks in (("a", "0:2"), ("b", "2:4"), ("c", "4:6")):
            net.start_peer(name, path, "--blocks", blocks, *PEER_OPTIONS)
        yield path, net
    finally:
        net.stop_all()


def test_a_swarm_generates_what_transformers_generates(streams_swarm):
    path, net = streams_swarm
    boundary = Checkpoint(path).boundary
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = local.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kw)
    with DistributedModelForCausalLM.from_pretrained(path, net.bootstrap_addrs, model_id=MODEL_ID) as remote:
        got = remote.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kw)
        with remote.inference_session(max_length=32) as session:
            logits = session.step(PROMPT)
    assert got.tolist() == expected.tolist()
    with torch.no_grad():
        assert (logits - local(PROMPT).logits).abs().max().item() < 1e-4
    assert boundary.streams  # what the peers took and returned (they check its width) is wider than the hidden states
