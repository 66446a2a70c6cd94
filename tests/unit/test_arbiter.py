"""Settling a failed check (`client.inference.arbiter`) and the dispute rule (`FailurePolicy.dispute`), with peers
as functions: an honest peer adds 1 per block to every hidden value; a liar adds noise."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.inference import arbiter
from client.inference.failures import FailurePolicy
from client.inference.routing import Hop
from swarm.errors import StepTimeout
from swarm.span import Span

pytestmark = pytest.mark.unit

TOL = 1e-3
X = torch.randn(1, 5, 8)


class Swarm:
    """Who serves what (`spans`), who lies in forwards (`liars`), who fails (`failing`); the client's side:
    `checkers`, `failures`, `ban`."""

    def __init__(self, spans: dict[str, Span], liars: set[str] = frozenset(), failing: set[str] = frozenset(),
                 session_liars: set[str] = frozenset()):
        self.spans, self.liars, self.failing = spans, set(liars), set(failing)
        self.session_liars = set(session_liars) | self.liars  # they lie in sessions (the outputs checked)
        self.banned: list[tuple[str, str]] = []
        self.failures = FailurePolicy(lambda peer, reason, seconds=None: self.banned.append((peer, reason)), 8)

    def ban(self, peer: str, reason: str, seconds: float | None = None) -> None:
        self.banned.append((peer, reason))

    def checkers(self, span: Span, *, exclude: set[str], fmt: str, cache_tokens: int = 0, rng=None):
        whole = [p for p, s in self.spans.items() if p not in exclude and s.start <= span.start and span.end <= s.end]
        return [Hop(sorted(whole)[0], span)] if whole else None

    def compute(self, hop: Hop, x: torch.Tensor) -> torch.Tensor:
        if hop.peer in self.failing:
            raise StepTimeout("no answer")
        out = x + len(hop.span)
        return out + torch.randn_like(x) if hop.peer in self.liars else out


@pytest.fixture
def forwards(monkeypatch):
    """`arbiter.recompute` by the test swarm given to `settle`."""
    async def recompute(client, hop, x, mask):
        return client.compute(hop, x)

    monkeypatch.setattr(arbiter, "recompute", recompute)


def settle(swarm: Swarm, primary: str, checkers: list[Hop]):
    """A check of `primary` against `checkers`: each checker's inputs and outputs as it computed, and what the
    primary's session returned."""
    inputs, outputs, x = [], [], X
    for hop in checkers:
        inputs.append(x)
        x = swarm.compute(hop, x)
        outputs.append(x)
    claimed = X + checkers[-1].span.end - checkers[0].span.start
    if primary in swarm.session_liars:
        claimed = claimed + torch.randn_like(claimed)
    return asyncio.run(arbiter.settle(swarm, primary, "float32", checkers, inputs, outputs, claimed, None, TOL))


def test_a_hop_two_different_checkers_disagree_with_is_the_liar(forwards):
    swarm = Swarm({"liar": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)}, liars={"liar"})
    verdict = settle(swarm, "liar", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))])
    assert verdict.liar == "liar" and verdict.convicted


def test_a_hop_whose_own_recomputation_agrees_with_its_checkers_lied_in_its_session(forwards):
    swarm = Swarm({"p": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)}, session_liars={"p"})  # honest forwards
    assert settle(swarm, "p", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))]).liar == "p"
    assert settle(swarm, "p", [Hop("a", Span(0, 4))]).liar == "p"


def test_when_every_piece_and_the_hop_itself_agree_nobody_lied(forwards):
    """Rounding of several pieces added up past the tolerance: no verdict against anyone."""
    swarm = Swarm({"p": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)})
    verdict = settle(swarm, "p", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))])
    assert (verdict.liar, verdict.other) == (None, None) and not swarm.banned


def test_a_third_opinion_settles_one_checker_against_the_hop(forwards):
    swarm = Swarm({"p": Span(0, 2), "liar": Span(0, 4), "third": Span(0, 2)}, liars={"liar"})
    verdict = settle(swarm, "p", [Hop("liar", Span(0, 2))])
    assert verdict.liar == "liar" and verdict.convicted
    swarm = Swarm({"p": Span(0, 2), "c": Span(0, 2), "third": Span(0, 2)}, liars={"p"})
    assert settle(swarm, "p", [Hop("c", Span(0, 2))]).liar == "p"


def test_with_no_third_peer_a_dispute_stays_open_until_one_side_disputes_a_second_peer(forwards):
    swarm = Swarm({"a": Span(0, 2), "b": Span(2, 4), "liar": Span(0, 4)}, liars={"liar"})
    first = settle(swarm, "a", [Hop("liar", Span(0, 2))])
    assert (first.liar, first.other, first.span) == (None, "liar", Span(0, 2))
    assert swarm.failures.disputed("a") == {"liar"} and not swarm.banned
    second = settle(swarm, "b", [Hop("liar", Span(2, 4))])
    assert second.liar == "liar"
    assert swarm.failures.convicted == {"liar"} and swarm.banned == [("liar", "wrong_output")]
    assert swarm.failures.disputed("a") == swarm.failures.disputed("b") == set()  # cleared


def test_a_hop_that_cannot_recompute_loses_without_being_convicted(forwards):
    swarm = Swarm({"p": Span(0, 2), "c": Span(0, 2)}, failing={"p"})
    verdict = settle(swarm, "p", [Hop("c", Span(0, 2))])
    assert verdict.liar == "p" and not verdict.convicted
    assert swarm.banned == [("p", "timeout")] and not swarm.failures.convicted
