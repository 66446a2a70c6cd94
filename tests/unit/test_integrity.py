"""Input digests and push tags (`swarm.net.integrity`): any change a peer makes to a push it passes on is caught,
either by the receiving peer (the tag no longer fits: another session, step or sender) or by the client (what
the hop computed on differs from the previous hop's output). Property-tested over arbitrary tampering."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swarm.net import messages, wire
from swarm.errors import BadRequest
from swarm.net.identity import Identity
from swarm.net.integrity import input_digest, new_push_key, push_tag, tag_ok

pytestmark = pytest.mark.unit

SENDER, OTHER = Identity.generate().peer_id, Identity.generate().peer_id
KEY = new_push_key()


def honest_push(encoding: str, masked: bool) -> messages.Push:
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(1))
    mask = wire.blob_of(torch.ones(1, 7, dtype=torch.bool)) if masked else None
    return messages.Push("s3-abc", 5, push_tag(KEY, "s3-abc", 5, SENDER), 5, messages.Hidden.encode(x, encoding), mask)


def flip(data: bytes, index: int, bit: int) -> bytes:
    b = bytearray(data)
    b[index % len(b)] ^= 1 << bit
    return bytes(b)


TAMPERING = st.one_of(
    st.tuples(st.just("hidden"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("mask"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("position"), st.integers(-4, 4).filter(bool), st.just(0)),
    st.tuples(st.just("step"), st.integers(-4, 4).filter(bool), st.just(0)),
    st.tuples(st.just("session"), st.sampled_from(["s3-abd", "s4-abc", "s3-ab"]), st.just(0)),
    st.tuples(st.just("sender"), st.just(OTHER), st.just(0)),
    st.tuples(st.just("tag"), st.integers(0, 31), st.integers(0, 3)),
)


def tamper(push: messages.Push, how: tuple) -> tuple[messages.Push, str]:
    """The push after one change, and the peer that sends it."""
    kind, a, b = how
    if kind == "hidden":
        blob = push.hidden.blobs[0]
        blobs = (dataclasses.replace(blob, data=flip(bytes(blob.data), a, b)),) + push.hidden.blobs[1:]
        return dataclasses.replace(push, hidden=messages.Hidden(push.hidden.encoding, blobs)), SENDER
    if kind == "mask":
        if push.mask is None:  # a mask added where there was none
            return dataclasses.replace(push, mask=wire.blob_of(torch.zeros(1, 7, dtype=torch.bool))), SENDER
        mask = wire.blob_of(~torch.frombuffer(bytearray(push.mask.data), dtype=torch.bool).reshape(1, 7))
        return dataclasses.replace(push, mask=mask), SENDER
    if kind == "position":
        return dataclasses.replace(push, position=push.position + a), SENDER
    if kind == "step":
        return dataclasses.replace(push, step=push.step + a), SENDER
    if kind == "session":
        return dataclasses.replace(push, session=a), SENDER
    if kind == "sender":
        return push, a
    tag = push.tag[:a] + "0123456789abcdef"[(int(push.tag[a], 16) + 1 + b) % 16] + push.tag[a + 1:]
    return dataclasses.replace(push, tag=tag), SENDER


@settings(max_examples=300, deadline=None)
@given(how=TAMPERING, encoding=st.sampled_from(messages.ENCODINGS), masked=st.booleans())
def test_any_tampering_of_a_push_is_refused_by_the_peer_or_caught_by_the_client(how, encoding, masked):
    push = honest_push(encoding, masked)
    expected = input_digest(push.position, push.hidden, push.mask)  # the client's: the previous hop's output
    got, sender = tamper(push, how)
    try:
        got = messages.Push.from_message(got.to_message())  # as the receiving peer parses it
    except BadRequest:
        return  # malformed: refused
    accepted = tag_ok(KEY, got.session, got.step, sender, got.tag)
    computed_on = input_digest(got.position, got.hidden, got.mask)
    assert not accepted or computed_on != expected, how


def test_an_honest_push_is_accepted_and_matches():
    push = honest_push("float16", True)
    assert tag_ok(KEY, push.session, push.step, SENDER, push.tag)
    assert input_digest(push.position, push.hidden, push.mask) == \
        input_digest(5, messages.Hidden.encode(push.hidden.decode(), "float16"), push.mask)


def test_a_tag_is_bound_to_its_key():
    assert not tag_ok(new_push_key(), "s3-abc", 5, SENDER, push_tag(KEY, "s3-abc", 5, SENDER))
