"""Typed messages and hidden-state encodings: every message round-trips through its dataclass, a
malformed one is a `BadRequest` naming what is wrong, and the encodings keep their promises (bytes,
bounded error, decode of an encode is a fixed point, so a replay sends exactly what was first sent)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swarm.net import messages, wire
from swarm.net.hidden import encoding_bytes, round_trip
from swarm.errors import BadRequest, NotServing

pytestmark = pytest.mark.unit

PEER = "12D3KooWBfmETW1ZbkdZbKKPpE3jpjyQ5WBXoDF8y9oE8vMQPKLi"
KEY, TAG, DIGEST = "0f" * 16, "a1" * 16, "9c" * 16


def over_the_wire(msg: wire.Message) -> wire.Message:
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(bytes(f) for f in wire.encode(msg)))
        reader.feed_eof()
        return await wire.read_message(reader, 1 << 26)

    return asyncio.run(run())


def hidden(encoding: str = "float32", shape=(2, 3, 64), seed: int = 0) -> messages.Hidden:
    return messages.Hidden.encode(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), encoding)


MESSAGES = [
    messages.Open("tiny", 2, 5, 128, 2, ("bfloat16", "int8", "float32")),
    messages.Open("tiny", 2, 5, 128, 2, ("float32",), fork="s12-" + "0f" * 12, fork_length=128),
    messages.Opened("s1-ab", 2, 5, 2, 128, ("float32",), 900, "bfloat16", "int8", "cuda", KEY),
    messages.Opened("s1-ab", 2, 5, 2, 128, ("float32",), 900, "bfloat16", "int8", "cuda", KEY, forked=12),
    messages.Step(7, 3, hidden("float16"), wire.blob_of(torch.ones(2, 6, dtype=torch.bool)),
              (messages.ChainHop(PEER, "s2-cd", 4, TAG),)),
    messages.Step(0, 0, hidden("int8")),
    messages.Push("s2-cd", 4, TAG, 3, hidden("bfloat16"), None, None),
    messages.Output(hidden("int8"), 1.25, 7, 3, 6, True, None, DIGEST),
    messages.Output(hidden("float32"), 0.5),
    messages.Close(),
    messages.Forward("tiny", 0, 6, hidden(), wire.blob_of(torch.ones(2, 3, dtype=torch.int64))),
    messages.InfoRequest(),
    messages.Info(PEER, "tiny", 0, 6, "0.1.0", "bfloat16", "none", "cpu", 64, 1, 8, 1000, 900, 128, 8, 0, 12.5, 300.0,
              0.4, 0, 1, {"bad_request": 2}, {"sent": 10, "received": 20}, {"received": 1}),
    messages.Error.of(NotServing("no"), 3),
]


def same(a, b) -> bool:
    """Dataclass equality, with tensors' bytes compared (memoryviews and bytearrays differ as objects)."""
    if isinstance(a, wire.Blob):
        return (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("msg", MESSAGES, ids=[f"{type(m).__name__}{i}" for i, m in enumerate(MESSAGES)])
def test_every_message_round_trips(msg):
    got = type(msg).from_message(over_the_wire(msg.to_message()))
    assert same(got, msg)


@pytest.mark.parametrize("cls, fields, tensors, match", [
    (messages.Open, {"model": "m", "start": 3, "end": 3, "max_length": 8, "batch": 1, "encodings": ["float32"]}, (),
     "'end'"),
    (messages.Open, {"model": "m", "start": 0, "end": 3, "max_length": 8, "batch": 1}, (), "encodings"),
    (messages.Open, {"model": "m", "start": 0, "end": 3, "max_length": 8, "batch": 1, "encodings": ["int4"]}, (),
     "encoding"),
    (messages.Open, {"model": "m", "start": 0, "end": 3, "max_length": 8, "batch": 1,
                 "encodings": ["int8", "int8"]}, (), "distinct"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float32"}, (), "need 1 tensors"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float16"}, hidden("float32").blobs, "said to be float16"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "int8"}, hidden("float32").blobs, "int8"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "int8"},
     (hidden("int8").blobs[0], wire.blob_of(torch.zeros(2, 3, 3, dtype=torch.int8))), "exponents"),
    (messages.Step, {"step": -1, "position": 0, "encoding": "float32"}, hidden().blobs, "'step'"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float32", "next": [{"peer": "0OIl", "session": "s",
                                                                           "step": 1, "tag": TAG}]},
     hidden().blobs, "invalid peer id"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float32", "next": [{"peer": PEER, "session": "s",
                                                                           "step": 1}]},
     hidden().blobs, "'tag'"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float32", "next": [{"peer": PEER, "session": "s",
                                                                           "step": 1, "tag": "XYZ"}]},
     hidden().blobs, "'tag' must be 32 lowercase hex"),
    (messages.Output, {"encoding": "float32", "input": "ab"}, hidden().blobs, "'input'"),
    (messages.Opened, {"session": "s", "start": 0, "end": 2, "batch": 1, "max_length": 8, "encodings": ["float32"],
                       "cache_tokens_left": 8}, (), "'push_key'"),
    (messages.Step, {"step": 1, "position": 0, "encoding": "float32"},
     hidden().blobs + (wire.blob_of(torch.ones(2, 3)),), "attention mask"),
    (messages.Output, {"encoding": "float32", "pushed": "yes"}, hidden().blobs, "pushed"),
    (messages.Output, {"encoding": "float32", "compute_ms": float("inf")}, hidden().blobs, "compute_ms"),
    (messages.Info, {"peer": PEER, "model": "m", "start": 0, "end": 2, "sessions": "many"}, (), "sessions"),
    (messages.Info, {"peer": PEER, "model": "m", "start": False, "end": 2}, (), "'start'"),
    (messages.Close, {}, (), None),
])
def test_malformed_messages_are_bad_requests(cls, fields, tensors, match):
    if match is None:  # a message of another type
        with pytest.raises(BadRequest, match="expected a 'close' message"):
            cls.from_message(wire.Message(wire.STEP, {}, ()))
        return
    with pytest.raises(BadRequest, match=match):
        cls.from_message(over_the_wire(wire.Message(cls.TYPE, fields, tensors)))


def test_an_int8_exponent_that_would_overflow_is_refused_on_decode():
    values = wire.blob_of(torch.full((1, 1, 64), 127, dtype=torch.int8))
    exps = wire.blob_of(torch.full((1, 1, 2), 127, dtype=torch.int8))
    step = messages.Step.from_message(wire.Message(wire.STEP, {"step": 0, "position": 0, "encoding": "int8"},
                                               (values, exps)))
    with pytest.raises(BadRequest, match="overflow"):
        step.hidden.decode()


# ---- encodings ----

@pytest.mark.parametrize("encoding, ratio, error", [
    ("float32", 1.0, 0.0), ("float16", 0.5, 1e-3), ("bfloat16", 0.5, 8e-3), ("int8", 0.26, 0.02)])
def test_encodings_cost_and_error(encoding, ratio, error):
    x = torch.randn(2, 16, 576, generator=torch.Generator().manual_seed(1)) * 4
    sent = messages.Hidden.encode(x, encoding)
    assert sent.nbytes <= ratio * x.numel() * 4 + 1
    assert sent.nbytes == pytest.approx(x.shape[0] * x.shape[1] * encoding_bytes(encoding, 576))
    back = sent.decode().float()
    assert (back - x).norm() / x.norm() <= error


@settings(max_examples=60, deadline=None)
@given(encoding=st.sampled_from(messages.ENCODINGS), hidden_size=st.sampled_from([1, 6, 48, 64, 100, 576]),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]), seed=st.integers(0, 2**16))
def test_decode_of_encode_is_a_fixed_point(encoding, hidden_size, scale, seed):
    """What a receiver decoded, encoded again, is the same bytes: a replay of the kept history is exact."""
    x = torch.randn(1, 3, hidden_size, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, 0, 0] = 0.0
    first = messages.Hidden.encode(x, encoding)
    again = messages.Hidden.encode(first.decode(), encoding)
    assert all(bytes(a.data) == bytes(b.data) for a, b in zip(first.blobs, again.blobs))
    assert torch.equal(round_trip(first.decode(), encoding), first.decode())
    assert torch.isfinite(first.decode().float()).all() or encoding == "float16"


def test_int8_keeps_zero_blocks_and_bounds_each_block_by_its_own_largest_value():
    x = torch.zeros(1, 1, 64)
    x[0, 0, 32:] = torch.linspace(-1000, 1000, 32)
    x[0, 0, 5] = 1e-3  # its block is otherwise zero: its scale is its own
    back = round_trip(x, "int8")
    assert back[0, 0, 6:32].abs().max() == 0
    assert abs(back[0, 0, 5] - 1e-3) <= 1e-3 / 64
    assert (back[0, 0, 32:] - x[0, 0, 32:]).abs().max() <= 1024 / 127


def test_open_and_forward_carry_the_weights_digest_and_repo_ids():
    model = "o" * 40 + "/" + "m" * 55  # the longest model id a record takes
    hidden = messages.Hidden.encode(torch.zeros(1, 2, 4), "float32")
    for request in (messages.Open(model, 0, 2, 16, 1, ("float32",), "ab" * 16),
                    messages.Forward(model, 0, 2, hidden, None, "ab" * 16)):
        back = type(request).from_message(over_the_wire(request.to_message()))
        assert (back.model, back.digest) == (model, "ab" * 16)
    old = messages.Open("tiny", 0, 2, 16, 1)  # a client that does not say which weights
    assert "digest" not in old.to_message().fields
    assert messages.Open.from_message(over_the_wire(old.to_message())).digest is None
    for bad in ("AB" * 16, "ab" * 15, 7, "zz" * 16):
        msg = old.to_message()
        with pytest.raises(BadRequest, match="'digest' must be 32 lowercase hex"):
            messages.Open.from_message(wire.Message(msg.type, {**msg.fields, "digest": bad}, msg.tensors))


def test_open_carries_a_fork_only_when_given_and_checks_it():
    plain = messages.Open("tiny", 0, 2, 16, 1)
    assert not {"fork", "fork_length"} & set(plain.to_message().fields)
    back = messages.Open.from_message(over_the_wire(plain.to_message()))
    assert (back.fork, back.fork_length) == (None, None)
    fields = plain.to_message().fields
    sid = "s3-" + "ab" * 12
    bad = [
        ({"fork": sid}, "come together"),
        ({"fork_length": 4}, "come together"),
        ({"fork": sid, "fork_length": 0}, "'fork_length' must be an integer in \\[1, 16\\]"),
        ({"fork": sid, "fork_length": 17}, "'fork_length' must be an integer in \\[1, 16\\]"),
        ({"fork": sid, "fork_length": True}, "'fork_length'"),
        ({"fork": sid, "fork_length": "4"}, "'fork_length'"),
        ({"fork": "x3-ab", "fork_length": 4}, "'fork' must be a session id"),
        ({"fork": "s3-AB", "fork_length": 4}, "'fork' must be a session id"),
        ({"fork": "s3-ab\n", "fork_length": 4}, "'fork' must be a session id"),
        ({"fork": "s3-" + "a" * 200, "fork_length": 4}, "'fork' must be a session id"),
        ({"fork": 3, "fork_length": 4}, "'fork' must be a session id"),
    ]
    for extra, match in bad:
        with pytest.raises(BadRequest, match=match):
            messages.Open.from_message(over_the_wire(wire.Message(wire.OPEN, {**fields, **extra})))
    good = messages.Open.from_message(over_the_wire(wire.Message(wire.OPEN, {**fields, "fork": sid,
                                                                         "fork_length": 16})))
    assert (good.fork, good.fork_length) == (sid, 16)
