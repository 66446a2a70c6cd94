"""Settling a failed check (`client.inference.arbiter`) and the client's memory of verdicts (`FailurePolicy`), with
peers as functions: an honest peer adds 1 per block to every hidden value, and so does the client's referee; liars
add noise (`noisy`), compute another model consistently (`other`), or lie only for their whole span, the same lie
each time (`whole`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client.inference import arbiter
from client.inference.failures import DISPUTE_S, LIAR_BAN_S, FailurePolicy
from client.inference.routing import Hop
from swarm.errors import StepTimeout
from swarm.span import Span

pytestmark = pytest.mark.unit

TOL = 1e-3
X = torch.randn(1, 5, 8)


class Referee:
    def __init__(self):
        self.blocks: list[int] = []

    async def run(self, span, x, mask):
        self.blocks.append(span.start)
        return x + len(span)


class Swarm:
    """Who serves what (`spans`), how each liar lies (`liars`: peer -> kind), who fails (`failing`), who lies in
    its sessions only (`session_liars`); the client's side: `failures`, `ban`, `referee`."""

    def __init__(self, spans: dict[str, Span], liars: dict[str, str] | None = None, failing: set[str] = frozenset(),
                 session_liars: set[str] = frozenset(), referee: bool = True):
        self.spans, self.liars, self.failing = spans, dict(liars or {}), set(failing)
        self.session_liars = set(session_liars) | set(self.liars)  # they lie in sessions (the outputs checked)
        self.banned: list[tuple[str, str]] = []
        self.now = 0.0
        self.failures = FailurePolicy(lambda peer, reason, seconds=None: self.banned.append((peer, reason)), 8,
                                      clock=lambda: self.now)
        self.referee = Referee() if referee else None
        self.forwards = 0

    def ban(self, peer: str, reason: str, seconds: float | None = None) -> None:
        self.banned.append((peer, reason))

    def compute(self, hop: Hop, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if hop.peer in self.failing:
            raise StepTimeout("no answer")
        kind = self.liars.get(hop.peer)
        if kind == "noisy":
            return x + len(hop.span) + torch.randn_like(x)
        if kind == "other":
            return x + 2 * len(hop.span)
        if kind == "whole" and hop.span == self.spans[hop.peer]:
            return x + len(hop.span) + 0.5
        return x + len(hop.span)


@pytest.fixture(autouse=True)
def forwards(monkeypatch):
    """`arbiter.recompute` by the test swarm given to `settle`."""
    async def recompute(client, hop, x, mask):
        return client.compute(hop, x)

    monkeypatch.setattr(arbiter, "recompute", recompute)


def settle(swarm: Swarm, primary: str, checkers: list[Hop]):
    """A check of `primary` against `checkers`: each checker's inputs and outputs as it computed, and what the
    primary's session returned (a session liar's: noise; a `whole` or `other` liar's: what its forwards give)."""
    inputs, outputs, x = [], [], X
    for hop in checkers:
        inputs.append(x)
        x = swarm.compute(hop, x)
        outputs.append(x)
    whole = Span(checkers[0].span.start, checkers[-1].span.end)
    claimed = swarm.compute(Hop(primary, whole), X) if swarm.liars.get(primary) in ("whole", "other") else \
        X + len(whole) + (torch.randn_like(X) if primary in swarm.session_liars else 0)
    return asyncio.run(arbiter.settle(swarm, primary, checkers, inputs, outputs, claimed, None, TOL))


@pytest.mark.parametrize("kind", ["noisy", "other"])
def test_a_lying_hop_is_convicted_whatever_checks_it(kind):
    for checkers in ([Hop("a", Span(0, 2)), Hop("b", Span(2, 4))], [Hop("c", Span(0, 4))]):
        swarm = Swarm({"liar": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4), "c": Span(0, 4)}, liars={"liar": kind})
        verdict = settle(swarm, "liar", checkers)
        assert verdict.liar == "liar" and verdict.convicted, verdict


def test_a_consistent_liar_is_narrowed_down_to_one_block_which_the_client_computes():
    swarm = Swarm({"liar": Span(0, 8), "c": Span(0, 8)}, liars={"liar": "other"})
    verdict = settle(swarm, "liar", [Hop("c", Span(0, 8))])
    assert verdict.liar == "liar" and "own computation" in verdict.evidence
    assert swarm.referee.blocks == [0]  # it lies from the first block: bisected to it, computed here once
    # the check and the claim, both sides' recomputations, then two halves by each side per level
    assert swarm.forwards <= 2 + 2 + 2 * 2 * 3


def test_bisection_cuts_only_where_a_span_may_start_and_the_client_computes_the_blocks_between_two_starts():
    """Spans of this model start only at blocks 0, 1 and 5 (`swarm.span.span_starts`, as HY v4's "shared" indexer
    blocks make them): a peer lying about block 3 is bisected to [1:5), which the client computes whole; no side is
    ever asked for blocks starting elsewhere (a peer refuses them)."""
    class Shared(Swarm):
        starts = (0, 1, 5)

        def compute(self, hop, x):
            assert hop.span.start in self.starts, hop
            return super().compute(hop, x) + (0.5 if hop.peer == "liar" and 3 in hop.span else 0)

    swarm = Shared({"liar": Span(0, 8), "c": Span(0, 8)})
    whole = Span(0, 8)
    want, claimed = swarm.compute(Hop("c", whole), X), swarm.compute(Hop("liar", whole), X)  # it lies consistently
    verdict = asyncio.run(arbiter.settle(swarm, "liar", [Hop("c", whole)], [X], [want], claimed, None, TOL))
    assert verdict.liar == "liar" and verdict.span == Span(1, 5) and "own computation" in verdict.evidence
    assert set(swarm.referee.blocks) == {1}  # [1:5) on each side's input


def test_an_honest_checker_is_judged_on_its_own_answers_only():
    """The checker's outputs before the chunk are the hop's own (they agreed then, within the tolerance): a hop that
    skewed them by half the tolerance and lies from the chunk on cannot make the checker look self-contradicting."""
    swarm = Swarm({"liar": Span(0, 4), "c": Span(0, 4)}, liars={"liar": "other"})
    start = 2
    want = swarm.compute(Hop("c", Span(0, 4)), X)
    skewed = want[:, :start] * (1 + TOL / 2)  # what the hop returned before, kept as the checker's
    claimed = swarm.compute(Hop("liar", Span(0, 4)), X)
    claimed[:, :start] = skewed
    verdict = asyncio.run(arbiter.settle(swarm, "liar", [Hop("c", Span(0, 4))], [X],
                                         [torch.cat([skewed, want[:, start:]], 1)], claimed, None, TOL, start))
    assert verdict.liar == "liar" and "c" not in swarm.failures.convicted


def test_a_hop_whose_own_recomputation_agrees_with_its_checkers_lied_in_its_session():
    swarm = Swarm({"p": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)}, session_liars={"p"})  # honest forwards
    assert settle(swarm, "p", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))]).liar == "p"
    assert settle(swarm, "p", [Hop("a", Span(0, 4))]).liar == "p"


def test_a_liar_that_contradicts_only_itself_is_convicted_by_its_own_pieces():
    """Honest on forwards of parts of its span, the same lie on its whole span (its sessions and forwards)."""
    swarm = Swarm({"liar": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)}, liars={"liar": "whole"}, referee=False)
    verdict = settle(swarm, "liar", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))])
    assert verdict.liar == "liar" and "pieces chained" in verdict.evidence
    swarm = Swarm({"liar": Span(0, 4), "c": Span(0, 4)}, liars={"liar": "whole"}, referee=False)
    verdict = settle(swarm, "liar", [Hop("c", Span(0, 4))])
    assert verdict.liar == "liar" and "chained contradict" in verdict.evidence


def test_when_every_piece_and_the_hop_itself_agree_nobody_lied():
    """Rounding of several pieces added up past the tolerance: no verdict against anyone."""
    swarm = Swarm({"p": Span(0, 4), "a": Span(0, 2), "b": Span(2, 4)})
    verdict = settle(swarm, "p", [Hop("a", Span(0, 2)), Hop("b", Span(2, 4))])
    assert (verdict.liar, verdict.other) == (None, None) and not swarm.banned


@pytest.mark.parametrize("kind", ["noisy", "other"])
def test_two_colluding_checkers_cannot_frame_an_honest_hop(kind):
    swarm = Swarm({"p": Span(0, 4), "x": Span(0, 2), "y": Span(2, 4)}, liars={"x": kind, "y": kind})
    verdict = settle(swarm, "p", [Hop("x", Span(0, 2)), Hop("y", Span(2, 4))])
    assert verdict.liar == "x" and verdict.convicted
    assert "p" not in swarm.failures.convicted and not any(peer == "p" for peer, _ in swarm.banned)


def test_with_no_referee_a_dispute_stays_open_convicts_nobody_and_is_forgotten():
    swarm = Swarm({"a": Span(0, 2), "b": Span(0, 2), "liar": Span(0, 4)}, liars={"liar": "other"}, referee=False)
    first = settle(swarm, "a", [Hop("liar", Span(0, 2))])
    assert (first.liar, first.other) == (None, "liar")
    second = settle(swarm, "b", [Hop("liar", Span(0, 2))])
    assert (second.liar, second.other) == (None, "liar")  # two disputes are no proof: identities cost nothing
    assert swarm.failures.disputed("liar") == {"a", "b"} and not swarm.banned and not swarm.failures.convicted
    swarm.now += DISPUTE_S
    assert swarm.failures.disputed("liar") == set() == swarm.failures.disputed("a")


def test_a_side_that_cannot_recompute_loses_without_being_convicted():
    swarm = Swarm({"p": Span(0, 2), "c": Span(0, 2)}, failing={"p"})
    verdict = settle(swarm, "p", [Hop("c", Span(0, 2))])
    assert verdict.liar == "p" and not verdict.convicted
    assert swarm.banned == [("p", "timeout")] and not swarm.failures.convicted


def test_a_conviction_ends_with_its_ban_and_ends_the_liars_disputes():
    swarm = Swarm({})
    swarm.failures.dispute("liar", "a")
    swarm.failures.convict("liar")
    assert swarm.failures.convicted == {"liar"} and swarm.failures.disputed("a") == set()
    swarm.now += LIAR_BAN_S
    assert swarm.failures.convicted == set()
