"""The client's one failure policy: when a hop fails, who is blamed, banned, and whether to go on. Sync.

Sessions (`client.inference.session`) and stateless forwards (`client.inference.forward`) both report a failed hop
here and get one answer: raise (the request itself is wrong, or too many peers failed in a row) or
reroute the hop's span (the caller then replaces the hop and, in a session, replays its history).

- Whether another peer may succeed is a property of the error type (`SwarmError.retryable`); a missed
  deadline is retryable.
- An error that says the request is wrong (`bad_request`) coming from a peer is trusted only when a
  second peer says the same: a single peer cannot end a generation by refusing every request.
- Failures of peers that never completed a step for this client (fresh records, possibly Sybils or
  black holes) count against a separate, larger allowance (`UNPROVEN_ATTEMPTS`) than `max_retries`,
  which counts failures of peers that had served us: fake records cannot use up the attempts an
  honest route needs. Every failed peer is banned, so the candidates shrink with each attempt, and
  both counts bound the loop.
- A chain mismatch (`ChainMismatch`: a pushed-on hop says it computed on input other than the previous hop's
  output, as the client received it) is word against word: either the previous hop pushed something else than
  it returned, or the next one lies about what it got. Neither is banned (one identity could otherwise frame
  an honest peer); the pair is not chained again for `LIAR_BAN_S` (`unchained`): the client sends the next
  hop its input itself, checks what it says it computed on against what it sent, and so loses only the
  pushes' saving through that pair.
- A failed check of outputs (`client.inference.verify`, `client.inference.arbiter`) ends in one of two
  ways: a liar is proven (`convict`: by its own contradicting answers or by the client's own computation;
  banned for `LIAR_BAN_S`, and the conviction ends with the ban), or two computations disagreed and nothing
  could tell which is right (`dispute`: neither side is banned; the pair is not used to check each other for
  `DISPUTE_S`). No count of disputes convicts anyone: identities cost nothing, so many of them agreeing
  proves nothing.
- A peer whose output no blocks can produce (`WrongOutput`: non-finite, absurd or degenerate values, see
  `client.inference.hops.implausible`) is banned for long too, like one caught by a replica.
- Waiting for blocks (`SwarmClient.wait_for_route`) is for blocks whose peers left or failed for a while;
  blocks whose only peers were caught lying have nothing to wait for (`caught_lying`): that ends the
  request at once with a `NoRoute` that names them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from swarm.errors import BadRequest, NoRoute, SwarmError, WrongOutput
from swarm.span import Span
from swarm.net.transport import describe_peer

logger = logging.getLogger(__name__)

UNPROVEN_ATTEMPTS = 64  # failures of peers that never served this client, per request, on top of max_retries
LIAR_BAN_S = 3600.0  # a peer caught altering what it passes on is avoided this long
DISPUTE_S = 600.0  # an open dispute between two peers is remembered this long
LIES = {"wrong_output": "returned wrong outputs"}  # the reasons of a liar's ban, as a user reads them


def retryable(err: BaseException) -> bool:
    """Whether another peer may succeed where this one failed (the request itself was fine)."""
    return isinstance(err, asyncio.TimeoutError) or (isinstance(err, SwarmError) and err.retryable)


def reason_of(err: BaseException) -> str:
    return err.code if isinstance(err, SwarmError) else "timeout"


def caught_lying(missing: Sequence[int], offers: Iterable, bans) -> dict[str, str]:
    """The peers serving the `missing` blocks, each with what it was caught at (`LIES`), if every one of them is
    banned as a liar and each missing block has one; else {}. Then no peer that may serve them honestly is
    known, and waiting for one of those to come back is pointless (they are banned for an hour): the caller
    fails at once. A block with no peer at all (its peer left) or a peer banned for a while (a timeout) is
    worth a wait. `offers`: what `routing.Offer` holds (peer, span); `bans`: `routing.Bans`."""
    covering = [o for o in offers if any(o.span.start <= b < o.span.end for b in missing)]
    if not missing or any(not any(o.span.start <= b < o.span.end for o in covering) for b in missing):
        return {}
    liars = {o.peer: bans.reasons.get(o.peer, "") for o in covering}
    if not all(bans.banned(p) and reason in LIES for p, reason in liars.items()):
        return {}
    return {p: LIES[reason] for p, reason in liars.items()}


class Expiring:
    """Keys, each kept for a while: `add(key, seconds)`, `discard(key)`, `key in`, `live()` (those not expired)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.until: dict = {}

    def add(self, key, seconds: float) -> None:
        self.until[key] = self.clock() + seconds

    def discard(self, key) -> None:
        self.until.pop(key, None)

    def __contains__(self, key) -> bool:  # one key's expiry only: asked on every chained step
        return self.until.get(key, -float("inf")) > self.clock()

    def live(self) -> set:
        now = self.clock()
        for key in [k for k, until in self.until.items() if until <= now]:
            del self.until[key]
        return set(self.until)


@dataclass
class FailurePolicy:
    """What this client knows about failures across requests: peers proven (they completed a step for
    us) and who blamed whom. `ban(peer, reason, seconds)` is the client's ban (seconds None: the usual
    backoff)."""

    ban: Callable[[str, str, float | None], None]
    max_retries: int
    proven: set[str] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic
    convictions: Expiring = field(init=False)  # peers proven to have returned wrong outputs (until their ban ends)
    disputes: Expiring = field(init=False)  # open disputes, as pairs of peers
    unchained: Expiring = field(init=False)  # (upstream, downstream) pairs not chained

    def __post_init__(self) -> None:
        # through `clock` as it is when asked (tests move it)
        self.convictions, self.disputes, self.unchained = (Expiring(lambda: self.clock()) for _ in range(3))

    def succeeded(self, peer: str) -> None:
        self.proven.add(peer)

    def attempts(self, what: str) -> Attempts:
        """The failure count of one request (a step of a session, or a forward) about `what` (the model)."""
        return Attempts(self, what)

    @property
    def convicted(self) -> set[str]:
        """Peers proven to have returned wrong outputs, whose conviction has not ended."""
        return self.convictions.live()

    def convict(self, liar: str) -> None:
        """`liar` returned wrong outputs (its own answers or the client's computation prove it): banned for
        `LIAR_BAN_S`; its disputes end."""
        self.ban(liar, "wrong_output", LIAR_BAN_S)
        self.convictions.add(liar, LIAR_BAN_S)
        for pair in [pair for pair in self.disputes.live() if liar in pair]:
            self.disputes.discard(pair)

    def dispute(self, a: str, b: str) -> None:
        """`a` and `b` computed different outputs for the same inputs and nothing could tell which is right:
        neither is banned, and neither checks the other for `DISPUTE_S`."""
        self.disputes.add(frozenset((a, b)), DISPUTE_S)

    def disputed(self, peer: str) -> set[str]:
        """The peers `peer` disagreed with, unresolved and not forgotten."""
        return {other for pair in self.disputes.live() if peer in pair for other in pair - {peer}}

    def chain_mismatch(self, upstream: str, downstream: str) -> None:
        """`downstream` says it computed on other input than `upstream`'s output: the pair is not chained again
        for `LIAR_BAN_S` (module docstring); nobody is banned."""
        self.unchained.add((upstream, downstream), LIAR_BAN_S)
        logger.warning("peer %s says peer %s pushed it other input than it returned: the client relays between "
                       "them from now on", describe_peer(downstream), describe_peer(upstream))

    def chainable(self, upstream: str, downstream: str) -> bool:
        return (upstream, downstream) not in self.unchained


@dataclass
class Attempts:
    policy: FailurePolicy
    what: str
    proven_failures: int = 0
    unproven_failures: int = 0
    refused_by: set[str] = field(default_factory=set)  # peers that called our request bad

    def failed(self, peer: str, span: Span, err: BaseException, opening: bool = False) -> str:
        """Peer `peer` failed on `span` with `err`: raise if the caller must give up, else ban the peer and
        return the reason (the caller reroutes the span). `opening`: it refused to open a session (peers
        differ in their limits, so a refusal there is always that peer's)."""
        reason = reason_of(err)
        if not retryable(err):
            refusal = isinstance(err, BadRequest) and err.remote
            if not refusal or (not opening and self.refused_by - {peer}):
                raise err  # our own check, or a second peer agrees: the request is wrong
            self.refused_by.add(peer)  # one peer's word: try another before believing it
        if peer in self.policy.proven:
            self.proven_failures += 1
        else:
            self.unproven_failures += 1
        self.policy.ban(peer, reason, LIAR_BAN_S if isinstance(err, WrongOutput) else None)
        logger.warning("blocks %s at peer %s failed (%s): rerouting", span, describe_peer(peer),
                       err if isinstance(err, SwarmError) else "no reply in time")
        if self.proven_failures > self.policy.max_retries or self.unproven_failures > UNPROVEN_ATTEMPTS:
            count = self.proven_failures + self.unproven_failures
            raise NoRoute(f"blocks {span} of {self.what} failed on {count} peers in a row; last error: {reason}") \
                from None
        return reason
