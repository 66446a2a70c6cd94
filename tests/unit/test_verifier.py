"""The verifier's bookkeeping (`client.inference.verify`) with peers as functions (an honest peer adds 1 per block
to every hidden value): a rollback during a check, outputs a replaced peer left behind, disputes settled by the
client's own computation or, without one, left open as unchecked outputs."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from client.inference import arbiter
from client.inference.failures import FailurePolicy
from client.inference.routing import Hop, Offer
from client.inference.verify import Verifier
from swarm.span import Span

pytestmark = pytest.mark.unit

SPAN = Span(0, 2)


class Session:
    def __init__(self, client, peer: str, span: Span):
        self.client, self.peer, self.span = client, peer, span

    async def step(self, x, start, mask, encoding):
        await self.client.gate.wait()
        return self.client.compute(Hop(self.peer, self.span), x)


class Referee:
    async def run(self, block, x, mask):
        return x + 1


class Client:
    """The verifier's view of the swarm: `spans` served, `liars` (noise in sessions and forwards; with no referee,
    another model's outputs, consistently)."""

    model_id = "m"

    def __init__(self, spans: dict[str, Span], liars: set[str] = frozenset(), referee: bool = True):
        self.spans, self.liars = spans, set(liars)
        self.referee = Referee() if referee else None
        self.failures = FailurePolicy(self.ban, 8)
        self.banned: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def compute(self, hop: Hop, x: torch.Tensor) -> torch.Tensor:
        out = x + len(hop.span)
        if hop.peer in self.liars:
            return out + torch.randn_like(x) if self.referee is not None else out + len(hop.span)
        return out

    def ban(self, peer: str, reason: str, seconds: float | None = None) -> None:
        self.banned.append(peer)

    def checkers(self, span: Span, *, exclude: set[str], fmt: str, cache_tokens: int = 0, rng=None):
        whole = sorted(p for p, s in self.spans.items() if p not in exclude and s.start <= span.start
                       and span.end <= s.end and p not in self.banned)
        return [Hop(whole[0], span)] if whole else None

    def offer(self, peer: str) -> Offer:
        return Offer(peer, self.spans.get(peer, SPAN))

    def deadline(self, hop: Hop, tokens: int) -> float:
        return 5.0

    async def open_session(self, hop: Hop, **kwargs) -> Session:
        return Session(self, hop.peer, hop.span)

    async def close_session(self, peer: str, session) -> None:
        pass


@pytest.fixture(autouse=True)
def forwards(monkeypatch):
    async def recompute(client, hop, x, mask):
        return client.compute(hop, x)

    monkeypatch.setattr(arbiter, "recompute", recompute)


class Recorded:
    """One hop over SPAN: what it was sent and what it returned, positions [0, length)."""

    def __init__(self, client: Client, peer: str, length: int):
        self.inputs = torch.randn(1, length, 4)
        self.outputs = client.compute(Hop(peer, SPAN), self.inputs)

    def views(self, span):
        return self.inputs, self.outputs, None


def verifier(client: Client, hop: Recorded) -> Verifier:
    return Verifier(client, 1.0, random.Random(0), 64, 1, hop.views, lambda span: ("float32",))


def test_a_rollback_during_a_check_verifies_only_the_positions_left():
    async def main():
        client = Client({"p": SPAN, "c": SPAN})
        hop = Recorded(client, "p", 6)
        v = verifier(client, hop)
        client.gate.clear()  # the checker holds the chunk
        task = v.start(SPAN, "p", 6)
        await asyncio.sleep(0)
        v.rollback(3)
        client.gate.set()
        await task
        return v.verified(SPAN, 6)

    assert asyncio.run(main()) == 3


def test_outputs_a_replaced_peer_left_are_blamed_on_it_not_on_its_replacement():
    async def main():
        client = Client({"old": SPAN, "new": SPAN, "c": SPAN}, liars={"old"})
        hop = Recorded(client, "old", 4)  # the old peer's (wrong) outputs stay at the boundary
        v = verifier(client, hop)
        v.replaced(SPAN, "old", 4)
        await v.flush([(SPAN, "new")], 4)
        return v.lie, client.failures.convicted

    lie, convicted = asyncio.run(main())
    assert lie.peer == "old" and lie.position == 0
    assert "new" not in convicted


def test_a_lying_checker_is_convicted_by_the_clients_own_computation_and_the_hop_verified():
    async def main():
        client = Client({"p": SPAN, "liar": Span(0, 4)}, liars={"liar"})
        hop = Recorded(client, "p", 4)
        v = verifier(client, hop)
        await v.flush([(SPAN, "p")], 4)  # the liar convicted; no other checker: unchecked from there
        return v.lie, v.unchecked, client.failures.convicted

    lie, unchecked, convicted = asyncio.run(main())
    assert lie is None and convicted == {"liar"} and unchecked == {SPAN: "p"}


def test_a_dispute_nothing_here_settles_leaves_the_hop_unchecked_and_a_later_chain_checks_it():
    async def main():
        client = Client({"p": SPAN, "liar": Span(0, 4)}, liars={"liar"}, referee=False)
        hop = Recorded(client, "p", 4)
        v = verifier(client, hop)
        await v.flush([(SPAN, "p")], 4)
        assert v.verified(SPAN, 4) == 4 and v.unchecked == {SPAN: "p"}  # given out, said unchecked
        assert not client.failures.convicted and not client.banned
        later = verifier(client, hop)  # a later session: the two are not used to check each other
        await later.flush([(SPAN, "p")], 4)
        assert later.unchecked == {SPAN: "p"} and not later.shadows
        client.spans["honest"] = SPAN  # another peer arrives: it checks the hop
        await later.flush([(SPAN, "p")], 4)
        return later.verified(SPAN, 4), later.unchecked, client.failures.convicted

    verified, unchecked, convicted = asyncio.run(main())
    assert verified == 4 and unchecked == {} and convicted == set()  # agreeing is no proof against the accuser
