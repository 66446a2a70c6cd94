"""Checked outputs for any split of the route, for real on 127.0.0.1: honest peers serve [0:2) [2:4) [4:6) of the tiny
llama and a liar (noise on every output, its stateless forwards included, and a claim of 100x its speed) serves a span
that no single honest peer covers: at the start of the route, in the middle, at the end, and all of it. The liar's
hop is checked against the honest pieces that cover it, and when the liar is the checker of honest hops, its
disagreeing with two different peers exposes it. Every generation is transformers' own and the liar is banned. With
no liar, every hop is a sole server: unchecked, said plainly in the SDK and the API, refused with
`require_checked` (the API's side: tests/integration/test_api.py). The liars are test helpers (`tests/adversary.py`), not options of the real peer."""

from __future__ import annotations

import pytest
import torch

from adversary import adversary
from client.checked import UncheckedOutputWarning
from client.inference.routing import Hop
from client.model import DistributedModelForCausalLM
from swarm.errors import Unchecked
from swarm.local.launch import wait_until
from swarm.span import Span
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
NEW = 10
HONEST = {"a": "0:2", "b": "2:4", "c": "4:6"}


@pytest.fixture(scope="module")
def pieces(tmp_path_factory, tiny_llama):
    net = LocalSwarm(tmp_path_factory.mktemp("split-checks"))
    try:
        net.start_bootstrap()
        for name, blocks in HONEST.items():
            net.start_peer(name, tiny_llama, "--blocks", blocks, *PEER_OPTIONS)
        yield net
    finally:
        net.stop_all()


@pytest.fixture(scope="module")
def want(local):
    return local.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def generate(model, **kwargs):
    with model.inference_session(max_length=PROMPT.shape[1] + NEW) as session:
        got = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)
        return got, list(session.failovers)


def seen(model, peer: str) -> None:
    """Wait (bounded) until the client's view has `peer`'s record: it announces just after it starts serving."""
    client = model.connection.client
    wait_until(lambda: model.connection.run(client.refresh(force=True)) or peer in client.offers, 30,
               f"peer {peer} to be seen", interval=0.5)


def honest_ids(net) -> set[str]:
    return {net.procs[name].peer_id for name in HONEST}


def route_first(model, hops: list[Hop]) -> None:
    """Make the client's first route for all blocks `hops` (a failover's routes are its own)."""
    client = model.connection.client
    original = client.route

    async def first(span=None, **kwargs):
        if span is None or span == client.span:
            client.route = original
            await client.refresh()
            return list(hops)
        return await original(span, **kwargs)

    client.route = first


def pieces_of(net, first: int, last: int) -> list[Hop]:
    """The honest peers' hops covering blocks `[first, last)`."""
    hops = []
    for name, blocks in HONEST.items():
        start, end = map(int, blocks.split(":"))
        if start < last and first < end:
            hops.append(Hop(net.procs[name].peer_id, Span(max(start, first), min(end, last))))
    return hops


@pytest.mark.parametrize("blocks", ["0:4", "1:5", "2:6", "0:6"], ids=["start", "middle", "end", "whole"])
def test_a_liar_whose_span_no_honest_peer_covers_alone_is_caught_by_the_pieces(pieces, tiny_llama, want, blocks):
    """The route goes through the liar (as its claim would have it); honest pieces check it."""
    name = f"liar-{blocks.replace(':', '-')}"  # an identity of its own: a record of an earlier liar is no help
    liar = pieces.start_peer(name, tiny_llama, "--blocks", blocks, *PEER_OPTIONS, program=adversary("liar"))
    span = Span(*map(int, blocks.split(":")))
    try:
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs,
                                                         model_id=MODEL_ID) as model:
            client = model.connection.client
            seen(model, liar.peer_id)
            route_first(model, pieces_of(pieces, 0, span.start) + [Hop(liar.peer_id, span)]
                        + pieces_of(pieces, span.end, 6))
            got, failovers = generate(model)
            assert liar.peer_id in client.failures.convicted
            assert client.bans.reasons[liar.peer_id] == "wrong_output"
            assert not honest_ids(pieces) & client.failures.convicted
            assert [(f.failed_peer, f.reason) for f in failovers] == [(liar.peer_id, "wrong_output")]
            assert liar.peer_id not in {h.peer for h in model.route()}
    finally:
        pieces.stop(name)
    assert got.tolist() == want.tolist()


def test_a_liar_checking_honest_hops_disagrees_with_two_peers_and_is_the_one_banned(pieces, tiny_llama, want):
    """The route goes through the honest pieces; the liar, serving all blocks, is the only other peer to check
    them. Its word against one honest peer settles nothing; against a second one it is plain."""
    liar = pieces.start_peer("checker-liar", tiny_llama, "--blocks", "0:6", *PEER_OPTIONS, program=adversary("liar"))
    try:
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs, model_id=MODEL_ID,
                                                         verify_fraction=0.5) as model:
            client = model.connection.client
            seen(model, liar.peer_id)
            route_first(model, pieces_of(pieces, 0, 6))
            got, failovers = generate(model)
            assert liar.peer_id in client.failures.convicted
            assert not honest_ids(pieces) & client.failures.convicted
            assert not any(client.bans.banned(p) for p in honest_ids(pieces))
            assert failovers == []  # no honest hop was replaced
    finally:
        pieces.stop("checker-liar")
    assert got.tolist() == want.tolist()


def test_sole_servers_are_said_unchecked_and_refused_when_checks_are_required(pieces, tiny_llama, want):
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs, model_id=MODEL_ID) as model:
        with pytest.warns(UncheckedOutputWarning, match=r"\[0:2\).*\[2:4\).*\[4:6\)") as caught:
            got = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert len([w for w in caught if w.category is UncheckedOutputWarning]) == 1  # once per generation
        assert got.tolist() == want.tolist()
        ids = {name: pieces.procs[name].peer_id[-8:] for name in HONEST}
        assert got.unchecked_blocks == [f"[{b}) at {ids[n]}" for n, b in HONEST.items()]
        with pytest.warns(UncheckedOutputWarning):  # the next generation says it again
            model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs, model_id=MODEL_ID,
                                                     require_checked=True) as model:
        with pytest.raises(Unchecked, match=r"served by peer .* alone.*--require-checked"):
            model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
