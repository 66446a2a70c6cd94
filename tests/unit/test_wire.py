"""The wire format: round trips of fields and tensors, and every way a malformed stream must fail.

A malformed stream is a `ProtocolError` (or `EOFError` when it closed before a message began), never
another exception, a hang, or an allocation of the size a header merely claims.
"""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from swarm.errors import BadRequest, ProtocolError
from swarm.net.messages import Error
from swarm.net.wire import (DATA, ERROR, HEADER, MAX_DIMS, MAX_FRAME_BYTES, MAX_HEADER_BYTES, MAX_TENSORS, STEP, Blob,
                        Message, blob_of, encode, read_message, tensor_of)

pytestmark = pytest.mark.unit

LIMIT = 64 * 2**20


async def _read(data: bytes, limit: int) -> Message:
    reader = asyncio.StreamReader()  # made inside the loop: asyncio.run closes the loop it ran on
    reader.feed_data(data)
    reader.feed_eof()
    return await read_message(reader, limit)


def read(data: bytes, limit: int = LIMIT) -> Message:
    return asyncio.run(_read(data, limit))


def wire_bytes(msg: Message) -> bytes:
    return b"".join(bytes(f) for f in encode(msg))


def frame(kind: int, payload: bytes, length: int | None = None) -> bytes:
    return struct.pack(">IB", len(payload) if length is None else length, kind) + payload


def header(**fields) -> bytes:
    return frame(HEADER, json.dumps(fields).encode())


def tensor_header(*descs: dict) -> bytes:
    return header(type=STEP, tensors=list(descs))


SMALL = Message(STEP, {"session": "s0-ab", "position": 3}, (blob_of(torch.arange(6, dtype=torch.float32).view(2, 3)),))


# ---- round trips ----

@pytest.mark.parametrize("tensor", [
    torch.randn(2, 3, 4),
    torch.randn(1, 5).to(torch.float16),
    torch.randn(3, 2, 2, 2).to(torch.bfloat16),
    torch.tensor([[-(2**62), 0, 2**62 + 1]], dtype=torch.int64),
    torch.tensor([[True, False, True]]),
    torch.empty(0, 8),
], ids=["float32", "float16", "bfloat16", "int64", "bool", "empty"])
def test_tensor_round_trip(tensor):
    msg = Message(STEP, {"session": "s1", "position": 7, "meta": {"a": [1, 2.5, None, True]}}, (blob_of(tensor),))
    got = read(wire_bytes(msg))
    assert got.type == STEP
    assert got.fields == {"session": "s1", "position": 7, "meta": {"a": [1, 2.5, None, True]}}
    assert len(got.tensors) == 1
    back = tensor_of(got.tensors[0])
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_message_with_several_tensors_and_none():
    hidden, mask = torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool)
    got = read(wire_bytes(Message(STEP, {}, (blob_of(hidden), blob_of(mask)))))
    assert [tensor_of(b).dtype for b in got.tensors] == [torch.float32, torch.bool]
    assert torch.equal(tensor_of(got.tensors[0]), hidden) and torch.equal(tensor_of(got.tensors[1]), mask)
    assert read(wire_bytes(Message("info"))) == Message("info", {}, ())


def test_tensor_larger_than_a_frame_travels_in_parts():
    tensor = torch.randn(2 * MAX_FRAME_BYTES // 4 + 25)
    frames = encode(Message(STEP, {}, (blob_of(tensor),)))
    head = json.loads(bytes(frames[0])[5:])
    assert head["tensors"] == [{"dtype": "float32", "shape": [tensor.numel()], "parts": 3}]
    assert len(frames) == 1 + 2 * 3  # header, then a (prefix, part) pair per part
    assert [len(f) for f in frames[2::2]] == [MAX_FRAME_BYTES, MAX_FRAME_BYTES, 100]
    assert all(struct.unpack(">IB", bytes(p)) == (len(f), DATA) for p, f in zip(frames[1::2], frames[2::2]))
    got = read(b"".join(bytes(f) for f in frames))
    assert torch.equal(tensor_of(got.tensors[0]), tensor)


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(ValueError, match="cannot travel"):
        encode(Message(STEP, {}, (Blob("float64", (1,), bytes(8)),)))
    with pytest.raises(ValueError, match="do not match"):
        encode(Message(STEP, {}, (Blob("float32", (2,), bytes(7)),)))
    with pytest.raises(ValueError, match="header"):
        encode(Message(STEP, {"pad": "x" * MAX_HEADER_BYTES}))
    with pytest.raises(ValueError, match="cannot travel"):
        blob_of(torch.zeros(2, dtype=torch.float64))


def test_error_message_carries_code_and_truncated_text():
    msg = Error.of(BadRequest("x" * 5000), 3).to_message()
    assert msg.type == ERROR
    assert msg.fields["code"] == "bad_request" and msg.fields["step"] == 3
    assert len(msg.fields["message"]) == 2000
    assert read(wire_bytes(msg)).fields == msg.fields


# ---- truncation ----

def test_empty_stream_is_eof():
    with pytest.raises(EOFError):
        read(b"")


def test_every_cut_of_a_message_is_a_protocol_error():
    data = wire_bytes(SMALL)
    assert read(data).fields == SMALL.fields
    for cut in range(1, len(data)):
        with pytest.raises(ProtocolError):
            read(data[:cut])


@settings(max_examples=100, deadline=None)
@given(fields=st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("type", "tensors")),
                              st.integers(-2**64, 2**64) | st.text(max_size=10) | st.none(), max_size=3),
       shapes=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=MAX_DIMS), max_size=MAX_TENSORS),
       data=st.data())
def test_truncated_streams_fail_cleanly(fields, shapes, data):
    msg = Message("forward", fields, tuple(blob_of(torch.ones(*s)) for s in shapes))
    raw = wire_bytes(msg)
    got = read(raw)
    assert got.fields == fields and [b.shape for b in got.tensors] == [tuple(s) for s in shapes]
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(EOFError if cut == 0 else ProtocolError):
        read(raw[:cut])


# ---- malformed headers and frames ----

@pytest.mark.parametrize("data,rule", [
    (frame(HEADER, b"{not json"), "not JSON"),
    (frame(HEADER, b"\xff\xfe\xfd"), "not JSON"),
    (frame(HEADER, b""), "not JSON"),
    (frame(HEADER, b"[1, 2]"), "object"),
    (frame(HEADER, b'"step"'), "object"),
    (frame(HEADER, b"null"), "object"),
    (header(session="s1"), "'type'"),
    (header(type=3), "'type'"),
    (header(type=None), "'type'"),
    (frame(DATA, b'{"type": "step"}'), "expected a header frame"),
    (frame(7, b'{"type": "step"}'), "expected a header frame"),
    (frame(HEADER, b"", length=MAX_HEADER_BYTES + 1), "exceeds the limit"),
    (frame(HEADER, b"", length=2**32 - 1), "exceeds the limit"),
    (frame(HEADER, b'{"type": "step"}', length=100), "cut short"),
    (b"\x00\x00", "stream ended"),
    (header(type=STEP, tensors={}), "'tensors' must be a list"),
    (header(type=STEP, tensors=None), "'tensors' must be a list"),
    (header(type=STEP, tensors=[{"dtype": "bool", "shape": [1], "parts": 1}] * (MAX_TENSORS + 1)), "at most 4"),
    (header(type=STEP, tensors=["float32"]), "descriptor must be an object"),
])
def test_malformed_header(data, rule):
    with pytest.raises(ProtocolError, match=rule):
        read(data)


@pytest.mark.parametrize("desc,rule", [
    ({"dtype": "float64", "shape": [1], "parts": 1}, "dtype"),
    ({"dtype": "uint8", "shape": [1], "parts": 1}, "dtype"),
    ({"dtype": None, "shape": [1], "parts": 1}, "dtype"),
    ({"shape": [1], "parts": 1}, "dtype"),
    ({"dtype": "float32", "shape": [-1, 2], "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": [1, 1, 1, 1, 1], "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": [], "parts": 0}, "shape"),
    ({"dtype": "float32", "shape": [1.0], "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": [True], "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": [2**31 + 1], "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": "2x3", "parts": 1}, "shape"),
    ({"dtype": "float32", "shape": [2, 3]}, "parts"),
    ({"dtype": "float32", "shape": [2, 3], "parts": 2}, "parts"),
    ({"dtype": "float32", "shape": [2, 3], "parts": 0}, "parts"),
    ({"dtype": "float32", "shape": [0], "parts": 1}, "parts"),
    ({"dtype": "float32", "shape": [2, 3], "parts": "1"}, "parts"),
])
def test_bad_tensor_descriptor(desc, rule):
    data = tensor_header(desc) + frame(DATA, bytes(24))
    with pytest.raises(ProtocolError, match=rule):
        read(data)


def test_tensor_over_the_limit_is_refused_from_its_declared_size_alone():
    # No data follows: had the reader tried to read (or allocate) the tensor, the error would differ.
    with pytest.raises(ProtocolError, match="exceeds the limit of 1000"):
        read(tensor_header({"dtype": "float32", "shape": [251], "parts": 1}), limit=1000)
    huge = tensor_header({"dtype": "int64", "shape": [2**31] * 4, "parts": 1})
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        read(huge)
    two = tensor_header(*[{"dtype": "float32", "shape": [200], "parts": 1}] * 2)
    with pytest.raises(ProtocolError, match="in all"):
        read(two, limit=1000)
    assert read(two + frame(DATA, bytes(800)) + frame(DATA, bytes(800)), limit=1600).tensors[1].shape == (200,)


@pytest.mark.parametrize("tail,rule", [
    (frame(DATA, bytes(25)), "exceeds the limit of 24"),  # a part longer than the tensor's remaining bytes
    (frame(DATA, bytes(16)), "carried 16 of 24"),  # a part shorter than declared
    (frame(HEADER, bytes(24)), "expected a data frame"),
    (frame(DATA, bytes(10), length=24), "cut short: 10 of 24"),
    (b"", "stream ended in the middle of tensor 0"),
])
def test_bad_data_frames(tail, rule):
    data = tensor_header({"dtype": "float32", "shape": [2, 3], "parts": 1}) + tail
    with pytest.raises(ProtocolError, match=rule):
        read(data)


# ---- fuzzing ----

@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_else(data):
    try:
        msg = read(data)
    except (ProtocolError, EOFError):
        return
    assert isinstance(msg, Message) and isinstance(msg.type, str)


# Float part counts, non-string unhashable dtypes and deep or huge JSON are left out here: see the known-bug tests
# below.
_values = st.none() | st.booleans() | st.integers(-10, 2**33) | st.text(max_size=8) | st.sampled_from(
    ["float32", "float16", "bfloat16", "int64", "bool", "float64"])
_descs = st.fixed_dictionaries({}, optional={"dtype": _values, "shape": st.lists(_values, max_size=5) | _values,
                                             "parts": _values})


@settings(max_examples=300, deadline=None)
@given(head=st.fixed_dictionaries({"type": _values}, optional={"tensors": st.lists(_descs, max_size=5) | _values}),
       tail=st.binary(max_size=64), limit=st.integers(0, 4096))
def test_arbitrary_headers_never_raise_anything_else(head, tail, limit):
    try:
        msg = read(frame(HEADER, json.dumps(head).encode()) + tail, limit)
    except (ProtocolError, EOFError):
        return
    assert isinstance(msg.type, str)
    assert sum(b.nbytes for b in msg.tensors) <= limit


# ---- hostile inputs that once escaped as other exception types ----

def test_float_part_count_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        read(tensor_header({"dtype": "float32", "shape": [1], "parts": 1.0}) + frame(DATA, bytes(4)))


@pytest.mark.parametrize("dtype", [["float32"], {"name": "float32"}])
def test_unhashable_dtype_is_a_protocol_error(dtype):
    with pytest.raises(ProtocolError):
        read(tensor_header({"dtype": dtype, "shape": [1], "parts": 1}) + frame(DATA, bytes(4)))


def test_deeply_nested_header_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        read(frame(HEADER, b'{"type":"step","x":' + b"[" * 5000 + b"]" * 5000 + b"}"))


def test_huge_integer_in_header_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        read(frame(HEADER, b'{"type":"step","x":' + b"1" * 5000 + b"}"))
