"""Peer-to-peer chaining on real processes: peers pass a step's activations straight to the next peer
of the route. Chained steps give exactly the relayed steps' outputs (and local transformers' within
tolerance), a peer that does not push makes the client relay that hop only, and the push protocol
drops what it cannot trust without disturbing the sessions it serves."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.inference import peer_session
from client.model import DistributedModelForCausalLM
from swarm.net import discovery, messages, wire
from swarm.errors import BadRequest, NotServing
from swarm.net.identity import Identity
from swarm.net.integrity import push_tag
from swarm.net.records import LINK_ID_CHARS
from swarm.span import Span
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm, client_node, wait_until

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
DECODE = 6


@pytest.fixture(scope="module")
def chain_swarm(tmp_path_factory, tiny_llama):
    """[0:2) and [4:6) push; [2:4) runs with --no-push, so the client must relay the hop after it."""
    net = LocalSwarm(tmp_path_factory.mktemp("chain-swarm"))
    try:
        net.start_bootstrap()
        for name, blocks, extra in (("a", "0:2", ()), ("b", "2:4", ("--no-push",)), ("c", "4:6", ())):
            net.start_peer(name, tiny_llama, "--blocks", blocks, *extra, *PEER_OPTIONS)
        yield net
    finally:
        net.stop_all()


def logits_of(model, steps: int = DECODE) -> tuple[torch.Tensor, dict]:
    """The prompt, then `steps` greedy tokens one at a time; all logits, and where each hop's input came from."""
    with model.inference_session(max_length=32) as session:
        out = [session.step(PROMPT)]
        for _ in range(steps):
            out.append(session.step(out[-1][:, -1:].argmax(-1)))
        return torch.cat(out, 1), dict(session.session.hop_inputs)


def test_chained_steps_equal_relayed_and_local(swarm, tiny_llama, local):
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, swarm.bootstrap_addrs, model_id=MODEL_ID) as chained, \
            DistributedModelForCausalLM.from_pretrained(tiny_llama, swarm.bootstrap_addrs, model_id=MODEL_ID,
                                                        chain=False) as relayed:
        got, hops = logits_of(chained)
        want, relayed_hops = logits_of(relayed)
        expected = local.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert chained.generate(PROMPT, max_new_tokens=16, do_sample=False, pad_token_id=0).tolist() \
            == expected.tolist()
    assert torch.equal(got, want)  # the same peers compute the same function of the same inputs
    with torch.inference_mode():
        full = local(torch.cat([PROMPT, got[:, PROMPT.shape[1] - 1:-1].argmax(-1)], 1)).logits
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    # the prompt opens the sessions (relayed); the first decode step has the peers open their push streams
    # (relayed too); every decode step after that is one chain of 3 hops
    assert hops["sent"] + hops["pushed"] == 3 * (1 + DECODE) and hops["pushed"] >= 2 * (DECODE - 2), hops
    assert relayed_hops == {"sent": 3 * (1 + DECODE), "pushed": 0}


def test_a_peer_announces_its_round_trips_to_the_next_peers_before_any_client_chains_it(chain_swarm, loop):
    """A client prices a chained route by the links peers announce (`routing.chain_correction_ms`): a pushing
    peer measures the peers serving the block after its span, with no route through it yet; a peer that does
    not push announces none (its next hop is the client's)."""
    a, b = (chain_swarm.procs[n].peer_id for n in ("a", "b"))

    def links_once_a_names_b() -> dict[str, dict | None] | None:
        anns = loop.run(discovery.announcements(node, MODEL_ID, 6, [0, 2]))
        newest = {ann.peer: ann.links for block in (0, 2) for ann in anns[block][:1]}
        return newest if b[-LINK_ID_CHARS:] in (newest.get(a) or {}) else None

    with client_node(loop, chain_swarm.bootstrap_addrs) as node:
        found = wait_until(links_once_a_names_b, 15, "a's record to carry its round trip to b")
    assert 0 < found[a][b[-LINK_ID_CHARS:]] < 1000 and not found[b]


def test_a_peer_that_does_not_push_hands_its_next_hop_to_the_client(chain_swarm, tiny_llama, local):
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, chain_swarm.bootstrap_addrs,
                                                     model_id=MODEL_ID) as model:
        got, hops = logits_of(model)
        assert [str(h.span) for h in model.route()] == ["[0:2)", "[2:4)", "[4:6)"]
    with torch.inference_mode():
        full = local(torch.cat([PROMPT, got[:, PROMPT.shape[1] - 1:-1].argmax(-1)], 1)).logits
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    # a pushes to b; b does not push, so the client sends c its input: 2 sent and 1 pushed per decode step
    # (after the first decode step, which opens a's push stream)
    assert hops["sent"] + hops["pushed"] == 3 * (1 + DECODE) and DECODE - 2 <= hops["pushed"] <= DECODE, hops


@pytest.fixture(scope="module")
def probe(chain_swarm, loop):
    """A client node and the peer serving [0:2) (which pushes)."""
    with client_node(loop, chain_swarm.bootstrap_addrs) as node:
        yield node, chain_swarm.procs["a"].peer_id


def test_a_push_that_cannot_leave_is_reported_and_the_session_goes_on(probe, loop):
    node, peer = probe

    async def scenario():
        session = await peer_session.PeerSession.open(node, peer, MODEL_ID, Span(0, 2), max_length=16)
        try:
            x = torch.randn(1, 1, 64)
            nowhere = [{"peer": Identity.generate().peer_id, "session": "s0-nothing", "step": 0, "tag": "00" * 16}]
            step = await session.send(x, 0, chain=[messages.ChainHop(**nowhere[0])])
            out = await session.receive(step, tuple(x.shape), 10)
            assert session.pushed is False
            torch.testing.assert_close(out, await session.step(x, 0))  # same output, no harm done
            for bad in ([dict(nowhere[0], peer="not a peer id!", step=1)],  # not base58
                        [dict(nowhere[0], peer=peer, step=1)],  # this peer itself: a loop
                        [dict(nowhere[0], step=1), dict(nowhere[0], step=2)]):  # one peer twice
                with pytest.raises(BadRequest, match="'next'"):  # as a client that builds its own messages sends it
                    step = session.reserve()
                    await wire.write_message(session.stream.writer, wire.Message(wire.STEP, {
                        "step": step, "position": 0, "encoding": "float32", "next": bad},
                        messages.Hidden.encode(x, "float32").blobs))
                    await session.receive(step, tuple(x.shape), 10)
            torch.testing.assert_close(await session.step(x, 0), out)
        finally:
            await session.close()

    loop.run(scenario(), timeout=60)


def test_pushed_steps_reach_the_session_and_stale_or_forged_ones_are_dropped(probe, loop):
    """A push of the session's next step, tagged by the client for the pushing peer, is answered on the
    session's own stream. Dropped without a trace: an unknown session id, a tag made for another sender or
    another step, an old step id, an id far ahead, a position other than the session's end (a rollback),
    and the second of two pushes with one id. The client's own steps go on regardless."""
    node, peer = probe

    async def scenario():
        session = await peer_session.PeerSession.open(node, peer, MODEL_ID, Span(0, 2), max_length=16)
        push = await node.open(peer, wire.PUSH_PROTOCOL)

        async def send(fields, x, sender=node.peer_id, tag_step=None):
            tag = push_tag(session.opened.push_key, fields["session"], fields["step"] if tag_step is None else tag_step,
                           sender)
            await wire.write_message(push.writer, wire.Message(wire.PUSH, {**fields, "encoding": "float32", "tag": tag},
                                                               (wire.blob_of(x),)))

        try:
            x0, x1, x2 = torch.randn(1, 3, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
            await session.step(x0, 0)  # step 0: the session's end is now 3
            ids = [session.reserve() for _ in range(2)]  # 1, 2
            sid = session.id
            await send({"session": sid[:-4] + "0000", "step": ids[1], "position": 3}, x1)  # unknown session
            await send({"session": sid, "step": ids[1] + 10**6, "position": 3}, x1)  # far ahead
            await send({"session": sid, "step": ids[1], "position": 0}, x1)  # a rollback
            await send({"session": sid, "step": ids[1], "position": 3}, x1, sender=peer)  # tagged for another sender
            await send({"session": sid, "step": ids[1], "position": 3}, x1, tag_step=ids[0])  # for another step
            await send({"session": sid, "step": ids[1], "position": 3}, x1)  # the real next step
            await send({"session": sid, "step": ids[0], "position": 4}, x2)  # an older id
            pushed = await session.receive(ids[1], tuple(x1.shape), 10)
            with pytest.raises(asyncio.TimeoutError):  # none of the others is answered
                await asyncio.wait_for(wire.read_message(session.stream.reader, 1 << 20), 1.0)
            torch.testing.assert_close(await session.step(x1, 3), pushed)  # recomputed at 3: the same output
            assert (await session.step(x2, 4)).shape == x2.shape
        finally:
            await push.aclose()
            await session.close()
        return await peer_session.info(node, peer)

    info = loop.run(scenario(), timeout=60)
    assert info.pushes["received"] >= 1 and info.pushes["stale"] >= 3 and info.pushes["dropped"] >= 1
    assert info.pushes["forged"] == 2


def test_a_peer_serves_no_one_it_blocks(chain_swarm, probe, loop, tiny_llama):
    """`--block-peers`: the probe's client id gets `not_serving` for sessions and info alike."""
    node, _ = probe
    proc = chain_swarm.start_peer("blocking", tiny_llama, "--blocks", "0:2", "--block-peers", node.peer_id,
                                  *PEER_OPTIONS)

    async def scenario():
        with pytest.raises(NotServing, match="does not serve you"):
            await peer_session.PeerSession.open(node, proc.peer_id, MODEL_ID, Span(0, 2), max_length=16)
        with pytest.raises(NotServing):
            await peer_session.info(node, proc.peer_id)

    try:
        loop.run(scenario(), timeout=60)
    finally:
        chain_swarm.stop("blocking")
