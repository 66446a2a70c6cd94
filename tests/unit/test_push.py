"""The `next` field of chained steps: checked before any compute, so a chain can neither loop nor name a
peer twice, and only base58 peer ids travel on."""

from __future__ import annotations

import pytest

from peer.servicer import check_chain
from swarm.errors import BadRequest
from swarm.net.identity import Identity
from swarm.net.messages import ChainHop


def parse_chain(value, own_id: str):
    """The `next` field as the servicer sees it: its form checked by the message's decode, then the chain."""
    return check_chain(ChainHop.parse_all(value), own_id)

ME, A, B = (Identity.generate().peer_id for _ in range(3))
TAG = "7e" * 16


def hop(peer: str, step: int = 1, session: str = "s1-abc") -> dict:
    return {"peer": peer, "session": session, "step": step, "tag": TAG}


def test_a_valid_chain_is_returned_as_given():
    assert parse_chain(None, ME) is None
    assert parse_chain([hop(A, 3), hop(B, 7)], ME) == (ChainHop(A, "s1-abc", 3, TAG), ChainHop(B, "s1-abc", 7, TAG))


@pytest.mark.parametrize("value, match", [
    ([], "list of 1-64"),
    ("x", "list of 1-64"),
    ([hop(A)] * 65, "list of 1-64"),
    ([{"peer": A, "session": "s", "step": 1, "tag": TAG, "extra": 1}], "exactly"),
    ([hop(A) | {"tag": "7E" * 16}], "lowercase hex"),
    ([hop("12D3KooW0OIl")], "invalid peer id"),  # 0, O, I and l are not base58
    ([hop("12D3KooWé")], "invalid peer id"),
    ([hop("")], "invalid peer id"),
    ([hop(A), hop(A, 2)], "twice"),
    ([hop(A), hop(ME)], "this peer itself"),
    ([hop(A, session="")], "session id"),
    ([hop(A, step=-1)], "step ids"),
    ([hop(A, step=True)], "step ids"),
    ([hop(A, step=2**63)], "step ids"),
])
def test_bad_chains_are_bad_requests(value, match):
    with pytest.raises(BadRequest, match=match):
        parse_chain(value, ME)
