"""Honest clients in a swarm with a dishonest peer, for real on 127.0.0.1: a peer that alters what it pushes
to the next hop of a chained route (relayed around, nobody framed), one that returns wrong outputs (and claims
to be very fast), one that takes session streams and never answers, and one that says it forgot busy sessions.
In each case the client gets the same tokens and logits as transformers locally, and the culprit is banned or
routed around. The dishonest peers are test helpers (`tests/adversary.py`), not options of the real peer."""

from __future__ import annotations

import logging

import pytest
import torch

from adversary import adversary
from client.inference.routing import Hop
from client.model import DistributedModelForCausalLM
from swarm.local.launch import wait_until
from swarm.span import Span
from swarm_harness import MODEL_ID, PEER_OPTIONS, LocalSwarm

pytestmark = pytest.mark.integration

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 64, 200, 11]])
DECODE = 6


@pytest.fixture(scope="module")
def trust_swarm(tmp_path_factory, tiny_llama):
    """[0:3) six times: honest, altering its pushes, lying about its outputs, a black hole, one that forgets
    sessions and one that stalls its steps; [3:6) once, honest."""
    net = LocalSwarm(tmp_path_factory.mktemp("trust-swarm"))
    try:
        net.start_bootstrap()
        net.start_peer("honest", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS)
        net.start_peer("tamper", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS, program=adversary("tamper-push"))
        net.start_peer("hole", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS, program=adversary("blackhole"))
        net.start_peer("noisy", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS, program=adversary("noisy"))
        net.start_peer("forgetful", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS, program=adversary("forgetful"))
        net.start_peer("stall", tiny_llama, "--blocks", "0:3", *PEER_OPTIONS, program=adversary("stall"))
        net.start_peer("tail", tiny_llama, "--blocks", "3:6", *PEER_OPTIONS)
        yield net
    finally:
        net.stop_all()


def only_through(model: DistributedModelForCausalLM, net: LocalSwarm, first: str, fallback: str,
                 fallback_ban: float = 3.0) -> None:
    """Make the client's first route go through peer `first` for [0:3): the other dishonest ones are banned for
    the test, and `fallback` for `fallback_ban` seconds (a set ban, which no ping lifts), so a replacement after
    `first` fails waits for it, bounded."""
    client = model.connection.client
    model.connection.run(client.refresh(force=True))
    for name in ("honest", "tamper", "hole", "noisy", "forgetful", "stall"):
        if name not in (first, fallback):
            client.ban(net.procs[name].peer_id, "test", 600.0)
    if fallback_ban:
        client.ban(net.procs[fallback].peer_id, "test", fallback_ban)


def through(client, peer: str, net: LocalSwarm) -> None:
    """Make the client's first route for all blocks go through `peer` for [0:3), then `tail` (as its claim would,
    whatever a loaded machine made of its ping)."""
    original, tail = client.route, net.procs["tail"].peer_id
    client.bans.lift(peer)

    async def first(span=None, **kwargs):
        if span is None or span == client.span:
            client.route = original
            await client.refresh()
            return [Hop(peer, Span(0, 3)), Hop(tail, Span(3, 6))]
        return await original(span, **kwargs)

    client.route = first


def greedy_logits(model, steps: int = DECODE):
    with model.inference_session(max_length=32) as session:
        out = [session.step(PROMPT)]
        for _ in range(steps):
            out.append(session.step(out[-1][:, -1:].argmax(-1)))
        return torch.cat(out, 1), list(session.failovers), dict(session.session.hop_inputs)


def assert_local(got: torch.Tensor, local) -> None:
    with torch.inference_mode():
        full = local(torch.cat([PROMPT, got[:, PROMPT.shape[1] - 1:-1].argmax(-1)], 1)).logits
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)


def test_a_peer_altering_its_pushes_frames_nobody_and_is_relayed_around(trust_swarm, tiny_llama, local):
    """Its next hop says it got other input than the client got: word against word, so nobody is banned (a lying
    next hop could otherwise frame an honest one); the client sends the next hop its input itself from then on,
    and the logits are exact."""
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, trust_swarm.bootstrap_addrs,
                                                     model_id=MODEL_ID) as model:
        only_through(model, trust_swarm, "tamper", "honest")
        got, failovers, hops = greedy_logits(model)
        client = model.connection.client
        tamper, tail = trust_swarm.procs["tamper"].peer_id, trust_swarm.procs["tail"].peer_id
        assert not client.bans.banned(tamper) and not client.bans.banned(tail)
        assert not client.failures.chainable(tamper, tail)
    assert_local(got, local)
    assert failovers == []
    assert hops["pushed"] == 0 and hops["sent"] >= 2 * DECODE  # its push was not taken: the client relays


def test_a_black_hole_costs_one_open_deadline_and_is_banned(trust_swarm, tiny_llama, local):
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, trust_swarm.bootstrap_addrs,
                                                     model_id=MODEL_ID) as model:
        only_through(model, trust_swarm, "hole", "honest")
        got, failovers, _ = greedy_logits(model)
        client = model.connection.client
        hole = trust_swarm.procs["hole"].peer_id
        assert client.bans.banned(hole) and client.bans.reasons[hole] == "stalled"  # never served us: avoided long
        deadline = client.open_deadline(hole)
    assert_local(got, local)
    assert [(f.failed_peer, f.reason) for f in failovers] == [(hole, "timeout")]
    assert deadline < model.connection.client.config.open_timeout  # measured by its ping: not the full timeout


def test_a_peer_forgetting_busy_sessions_is_banned_not_replayed_again_and_again(trust_swarm, tiny_llama, local,
                                                                                 caplog):
    """A session a peer says it forgot while it was busy is that peer's failure: rerouted once, not reopened and
    replayed at every other step."""
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, trust_swarm.bootstrap_addrs,
                                                     model_id=MODEL_ID) as model:
        only_through(model, trust_swarm, "forgetful", "honest", fallback_ban=0)
        client = model.connection.client
        forgetful = trust_swarm.procs["forgetful"].peer_id
        wait_until(lambda: model.connection.run(client.refresh(force=True)) or forgetful in client.offers, 30,
                   "the forgetful peer's record to be seen", interval=0.5)
        through(client, forgetful, trust_swarm)
        with caplog.at_level(logging.INFO, logger="client"):
            got, failovers, _ = greedy_logits(model)
        assert client.bans.reasons.get(forgetful) == "unknown_session", caplog.text
    assert_local(got, local)
    assert [(f.failed_peer, f.reason) for f in failovers] == [(forgetful, "unknown_session")]


def test_a_peer_that_stalls_costs_a_machine_one_deadline(trust_swarm, tiny_llama, local):
    """It opens sessions, never answers a step and claims to be very fast: the first client pays one deadline and
    avoids it; the machine's next client does not try it at all."""
    stall = trust_swarm.procs["stall"].peer_id
    for first in (True, False):
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, trust_swarm.bootstrap_addrs,
                                                         model_id=MODEL_ID) as model:
            only_through(model, trust_swarm, "stall", "honest", fallback_ban=0)
            client = model.connection.client
            wait_until(lambda: model.connection.run(client.refresh(force=True)) or stall in client.offers, 30,
                       "the stalling peer's record to be seen", interval=0.5)
            if first:
                through(client, stall, trust_swarm)
            assert client.bans.banned(stall) is not first  # the second client knows it from the first
            got, failovers, _ = greedy_logits(model)
            assert client.bans.reasons[stall] == "stalled"
        assert_local(got, local)
        assert [(f.failed_peer, f.reason) for f in failovers] == ([(stall, "timeout")] if first else [])


class Seen:
    """A streamer recording what it was given after the prompt."""

    def __init__(self):
        self.tokens, self.ended, self.prompt = [], False, None

    def put(self, value):
        if self.prompt is None:
            self.prompt = value
        else:
            self.tokens += value.flatten().tolist()

    def end(self):
        self.ended = True


def test_a_peer_lying_about_its_outputs_is_caught_by_a_replica_and_users_see_only_checked_tokens(
        trust_swarm, tiny_llama, local):
    """The liar looks fastest, so the client routes through it; a replica's recomputation catches it, it is
    banned, the session rewinds to its first wrong position, and generate goes on from there: the tokens streamed
    and returned are transformers' own."""
    with DistributedModelForCausalLM.from_pretrained(tiny_llama, trust_swarm.bootstrap_addrs, model_id=MODEL_ID,
                                                     verify_fraction=0.5) as model:
        only_through(model, trust_swarm, "noisy", "honest", 0)  # the honest one is not banned: it checks
        noisy, honest = trust_swarm.procs["noisy"].peer_id, trust_swarm.procs["honest"].peer_id
        measurements = model.connection.client.measurements  # as if the liar had been fast so far
        for _ in range(3):
            measurements.step(noisy, rtt_ms=2.0, compute_ms=0.3, tokens=1, blocks=3)
            measurements.step(honest, rtt_ms=40.0, compute_ms=30.0, tokens=1, blocks=3)
        assert model.route()[0].peer == noisy
        seen = Seen()
        got = model.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0, streamer=seen)
        bans = model.connection.client.bans
        assert bans.banned(noisy) and bans.reasons[noisy] == "wrong_output"
    want = local.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    assert seen.tokens == want[0, PROMPT.shape[1]:].tolist() and seen.ended
