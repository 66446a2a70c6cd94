"""The client's one failure policy (`client.inference.failures`): what is retried, who is banned and for how long, when a
request gives up, and who is blamed for an altered push."""

from __future__ import annotations

import asyncio
import time

import pytest

from client.inference.failures import LIAR_BAN_S, UNPROVEN_ATTEMPTS, FailurePolicy, caught_lying, retryable
from client.inference.routing import Bans, Offer
from swarm.errors import (BadRequest, Busy, ChainMismatch, ConnectionLost, NoRoute, OutOfCache, ProtocolError,
                          StepTimeout, WrongOutput, error_from_code)
from swarm.span import Span

pytestmark = pytest.mark.unit

SPAN = Span(0, 3)


def policy(max_retries: int = 2) -> tuple[FailurePolicy, Bans, list]:
    bans, calls = Bans(base=5.0, clock=lambda: 0.0), []

    def ban(peer, reason, seconds=None):
        calls.append((peer, reason, seconds))
        bans.ban(peer, reason, seconds)

    return FailurePolicy(ban, max_retries), bans, calls


def test_retryability_is_a_property_of_the_error_type():
    assert all(retryable(e) for e in (asyncio.TimeoutError(), Busy(), OutOfCache(), ConnectionLost(), StepTimeout(),
                                      ProtocolError(), ChainMismatch(), error_from_code("no_such_code", "?")))
    assert not any(retryable(e) for e in (BadRequest(), NoRoute(), ValueError()))


def test_a_request_we_got_wrong_ourselves_is_raised_at_once():
    p, bans, _ = policy()
    with pytest.raises(BadRequest):
        p.attempts("m").failed("a", SPAN, BadRequest("position beyond the session"))
    assert not bans.banned("a")


def test_one_peer_calling_the_request_bad_is_routed_around_a_second_is_believed():
    p, bans, _ = policy()
    attempts = p.attempts("m")
    assert attempts.failed("liar", SPAN, error_from_code("bad_request", "no")) == "bad_request"
    assert bans.banned("liar")
    with pytest.raises(BadRequest):
        attempts.failed("b", SPAN, error_from_code("bad_request", "no"))


def test_a_refused_open_is_always_that_peer_s():
    p, _, _ = policy()
    attempts = p.attempts("m")
    for peer in "abc":  # peers differ in their limits (max length, batch)
        attempts.failed(peer, SPAN, error_from_code("bad_request", "max_length too large"), opening=True)


def test_fresh_records_failing_do_not_use_up_the_attempts_of_peers_that_served_us():
    p, _, _ = policy(max_retries=2)
    p.succeeded("honest1")
    p.succeeded("honest2")
    attempts = p.attempts("m")
    for i in range(UNPROVEN_ATTEMPTS):
        attempts.failed(f"sybil{i}", SPAN, ConnectionLost())
    attempts.failed("honest1", SPAN, StepTimeout())
    attempts.failed("honest2", SPAN, StepTimeout())
    with pytest.raises(NoRoute, match="failed on 67 peers in a row"):
        attempts.failed("honest1", SPAN, StepTimeout())
    with pytest.raises(NoRoute):
        fresh = p.attempts("m")
        for i in range(UNPROVEN_ATTEMPTS + 1):
            fresh.failed(f"sybil{i}", SPAN, ConnectionLost())


def test_a_chain_mismatch_bans_nobody_and_unchains_the_pair_for_a_while():
    """Word against word: the upstream peer pushed something else, or the downstream one lies about it."""
    p, bans, calls = policy()
    p.chain_mismatch("up", "down")
    assert not calls and not bans.banned("up") and not bans.banned("down")
    assert not p.chainable("up", "down") and p.chainable("down", "up") and p.chainable("up", "other")
    p.clock = lambda: time.monotonic() + LIAR_BAN_S
    assert p.chainable("up", "down")


def test_a_wrong_output_bans_its_peer_for_long_and_another_is_tried():
    p, bans, calls = policy()
    assert p.attempts("m").failed("liar", SPAN, WrongOutput("zeros")) == "wrong_output"
    assert calls[-1] == ("liar", "wrong_output", LIAR_BAN_S)
    bans.succeeded("liar")
    assert bans.banned("liar")


def test_blocks_served_only_by_liars_have_nothing_to_wait_for():
    p, bans, _ = policy()
    offers = [Offer("a", Span(0, 3)), Offer("b", Span(3, 6))]
    assert caught_lying((3, 4, 5), offers, bans) == {}  # not banned: no reason to give up
    p.attempts("m").failed("b", Span(3, 6), WrongOutput("zeros"))
    assert caught_lying((3, 4, 5), offers, bans) == {"b": "returned wrong outputs"}
    assert caught_lying((5, 6), offers, bans) == {}  # block 6 has no peer at all: one may come
    slow = offers + [Offer("c", Span(4, 6))]
    p.attempts("m").failed("c", Span(4, 6), StepTimeout())
    assert caught_lying((3, 4, 5), slow, bans) == {}  # a peer that timed out may come back
