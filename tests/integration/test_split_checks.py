"""Checked outputs for any split of the route, for real on 127.0.0.1: honest peers serve [0:2) [2:4) [4:6) of the tiny
llama and a liar (noise on every output, its stateless forwards included, and a claim of 100x its speed) serves a span
that no single honest peer covers: at the start of the route, in the middle, at the end, and all of it. The liar's
hop is checked against the honest pieces that cover it, and when the liar is the checker of honest hops, the
dispute is narrowed down to one block that the client computes itself. Liars that agree with each other, compute
with other weights consistently, or contradict only themselves are convicted the same way, one liar beside one
honest replica holds no span hostage, and no honest peer is ever banned. Every generation is transformers' own. With
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


def framed(client, net) -> set[str]:
    """Honest peers the client convicted or banned as liars. (A loaded machine may make an honest peer miss a
    deadline, recomputing a piece in a settlement too: that is a failure with its usual short ban, not a verdict.)"""
    convicted = client.failures.convicted
    return {p for p in honest_ids(net) if p in convicted or client.bans.reasons.get(p) == "wrong_output"}


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


def test_a_liar_checking_honest_hops_is_the_one_convicted(pieces, tiny_llama, want):
    """The route goes through the honest pieces; the liar, serving all blocks, is the only other peer to check
    them. Its word against an honest peer is settled by the client's own computation of one block."""
    liar = pieces.start_peer("checker-liar", tiny_llama, "--blocks", "0:6", *PEER_OPTIONS, program=adversary("liar"))
    try:
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs, model_id=MODEL_ID,
                                                         verify_fraction=0.5) as model:
            client = model.connection.client
            seen(model, liar.peer_id)
            route_first(model, pieces_of(pieces, 0, 6))
            got, failovers = generate(model)
            assert liar.peer_id in client.failures.convicted
            assert not framed(client, pieces)
            assert not [f for f in failovers if f.reason == "wrong_output"]  # no honest hop replaced as a liar
    finally:
        pieces.stop("checker-liar")
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("mode", ["other-weights", "self-contradicting"])
def test_one_liar_beside_one_honest_replica_holds_no_span_hostage(pieces, tiny_llama, want, mode):
    """A liar serves [2:4) beside the honest peer b, and each fresh client's first route goes through it: every one
    gets transformers' text and convicts the liar (by its own computation of the block where they first disagree,
    or by the liar's own answers chained), never b."""
    name = f"hostage-{mode}"
    liar = pieces.start_peer(name, tiny_llama, "--blocks", "2:4", *PEER_OPTIONS, program=adversary(mode))
    try:
        for _ in range(2):
            with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs,
                                                             model_id=MODEL_ID) as model:
                client = model.connection.client
                seen(model, liar.peer_id)
                route_first(model, pieces_of(pieces, 0, 2) + [Hop(liar.peer_id, Span(2, 4))] + pieces_of(pieces, 4, 6))
                got, failovers = generate(model)
                assert got.tolist() == want.tolist()
                assert client.failures.convicted == {liar.peer_id} and not framed(client, pieces)
                assert [(f.failed_peer, f.reason) for f in failovers if f.reason == "wrong_output"] == \
                    [(liar.peer_id, "wrong_output")]
    finally:
        pieces.stop(name)


def test_a_liar_that_contradicts_only_itself_is_convicted_by_its_own_pieces(pieces, tiny_llama, want):
    """It serves all blocks, answers forwards of any part of them honestly and lies the same way each time on its
    sessions and on forwards of its whole span: its pieces chained contradict its whole."""
    liar = pieces.start_peer("self-contradicting", tiny_llama, "--blocks", "0:6", *PEER_OPTIONS,
                             program=adversary("self-contradicting"))
    try:
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs,
                                                         model_id=MODEL_ID) as model:
            client = model.connection.client
            client.referee = None  # its own answers are proof enough
            seen(model, liar.peer_id)
            route_first(model, [Hop(liar.peer_id, Span(0, 6))])
            got, failovers = generate(model)
            assert client.failures.convicted == {liar.peer_id}
            assert [(f.failed_peer, f.reason) for f in failovers] == [(liar.peer_id, "wrong_output")]
    finally:
        pieces.stop("self-contradicting")
    assert got.tolist() == want.tolist()


def test_two_colluding_liars_checking_honest_hops_frame_nobody(pieces, tiny_llama, want):
    """Two identities with the same wrong weights serve all blocks and are the only checkers of the honest pieces:
    they agree with each other against every honest hop, and each is convicted; no honest peer is banned."""
    names = ("collude-1", "collude-2")
    liars = [pieces.start_peer(n, tiny_llama, "--blocks", "0:6", *PEER_OPTIONS, program=adversary("other-weights:1"))
             for n in names]
    try:
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, pieces.bootstrap_addrs, model_id=MODEL_ID,
                                                         verify_fraction=1.0) as model:
            client = model.connection.client
            for liar in liars:
                seen(model, liar.peer_id)
            route_first(model, pieces_of(pieces, 0, 6))
            got, failovers = generate(model)
            assert client.failures.convicted and client.failures.convicted <= {liar.peer_id for liar in liars}
            assert not framed(client, pieces)
            assert not [f for f in failovers if f.reason == "wrong_output"], failovers  # no honest hop as a liar
    finally:
        for n in names:
            pieces.stop(n)
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
