"""Malformed requests (hypothesis-generated) get typed errors, never crash a peer, and a valid request
right after is served; an honest session on the same peer keeps its cache throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from client.inference import peer_session
from swarm.net import messages, wire
from swarm.span import Span
from swarm_harness import MODEL_ID

pytestmark = pytest.mark.integration
TYPED = {"bad_request", "protocol", "not_serving", "unknown_session", "out_of_cache", "busy"}


@pytest.fixture(scope="module")
def target(swarm, client, loop):
    info = loop.run(peer_session.info(client, swarm.procs["peer1"].peer_id))
    return info.peer, Span(info.start, info.end)


KEEPALIVE_S = 1.0  # well inside the shared swarm's IDLE_TIMEOUT


@pytest.fixture(scope="module")
def honest_session(target, client, loop):
    """A session stepped at position 0 again and again (rollback); its output must never change. It is also
    stepped every KEEPALIVE_S seconds in the background, so however long one malformed request takes (a
    slow machine), the peer never reclaims it for being idle: what breaks it can only be the requests."""
    peer, span = target
    session = loop.run(peer_session.PeerSession.open(client, peer, MODEL_ID, span, max_length=16))
    x = torch.randn(1, 3, 64)
    expected = loop.run(session.step(x, 0))
    lock = asyncio.Lock()  # one step at a time on the session's stream
    failures: list[BaseException] = []

    async def check() -> None:
        async with lock:
            torch.testing.assert_close(await session.step(x, 0), expected)

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            try:
                await check()
            except Exception as e:  # noqa: BLE001 -- reported by the next check in the test's thread
                failures.append(e)
                return

    async def start() -> asyncio.Task:
        return asyncio.create_task(keep_alive())

    async def stop(task: asyncio.Task) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def checked() -> None:
        assert not failures, f"the honest session broke in the background: {failures[0]!r}"
        loop.run(check())

    task = loop.run(start())
    yield checked
    loop.run(stop(task))
    loop.run(session.close())


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload), kind) + payload


def header(fields: dict) -> bytes:
    return frame(wire.HEADER, json.dumps(fields).encode())


json_values = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                        st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3))
dims = st.lists(st.integers(0, 70), min_size=1, max_size=4).filter(lambda s: torch.Size(s).numel() <= 20000)


@st.composite
def tensors(draw) -> wire.Blob:
    dtype = draw(st.sampled_from(sorted(wire.DTYPE_SIZES)))
    shape = draw(st.one_of(dims, st.builds(lambda b, t: [b, t, 64], st.integers(1, 9), st.integers(1, 20))))
    fill = draw(st.sampled_from(["randn", "nan", "inf", "zeros"]))
    t = torch.zeros(shape, dtype=getattr(torch, dtype))
    if t.is_floating_point() and fill != "zeros":
        t = torch.randn(shape).to(t.dtype) if fill == "randn" else torch.full(shape, float(fill)).to(t.dtype)
    return wire.blob_of(t)


def fields_for(kind: str):
    good = {"model": MODEL_ID, "start": 2, "end": 4, "max_length": 16, "batch": 1, "encodings": ["float32", "int8"],
            "encoding": "float32", "step": 0, "position": 0}
    keys = st.sampled_from(sorted(good) + ["type", "tensors", "session"])
    return st.dictionaries(keys, json_values, max_size=6).map(lambda bad: {**good, **bad, "type": kind})


@st.composite
def requests(draw):
    """(protocol, raw bytes to send, number of messages in them) for one malformed or odd request."""
    protocol = draw(st.sampled_from([wire.SESSION_PROTOCOL, wire.FORWARD_PROTOCOL, wire.INFO_PROTOCOL]))
    kind = draw(st.sampled_from(["message", "raw", "huge", "steps"]))
    if kind == "raw":
        junk = draw(st.binary(min_size=0, max_size=64))
        return protocol, draw(st.sampled_from([frame(wire.HEADER, junk), frame(wire.DATA, junk),
                                               struct.pack(">IB", 2**31, wire.HEADER), header({"x": 1}),
                                               header({"type": 5})])), 1
    if kind == "huge":
        desc = {"dtype": "float32", "shape": draw(st.lists(st.integers(2**20, 2**31), min_size=2, max_size=3)),
                "parts": 1}
        return protocol, header({"type": wire.FORWARD, "model": MODEL_ID, "start": 2, "end": 4, "tensors": [desc]}), 1
    mtype = draw(st.sampled_from([wire.OPEN, wire.STEP, wire.FORWARD, wire.INFO, "nonsense"]))
    msg = wire.Message(mtype, draw(fields_for(mtype)), tuple(draw(st.lists(tensors(), max_size=2))))
    try:
        data = b"".join(bytes(f) for f in wire.encode(dataclass_safe(msg)))
    except ValueError:
        data = header({"type": mtype})
    if kind == "steps" and protocol == wire.SESSION_PROTOCOL:  # a good open first, then the odd message
        opening = messages.Open(MODEL_ID, 2, 4, 16, 1, ("float32", "int8")).to_message()
        return protocol, b"".join(bytes(f) for f in wire.encode(opening)) + data, 2
    return protocol, data, 1


def dataclass_safe(msg: wire.Message) -> wire.Message:
    fields = {k: v for k, v in msg.fields.items() if k not in ("type", "tensors")}
    return wire.Message(msg.type, fields, msg.tensors)


async def send_raw(client, peer: str, protocol: str, data: bytes, messages: int) -> list[wire.Message]:
    """Send `data`; read up to one reply per message, until the peer ends the stream."""
    stream = await client.open(peer, protocol)
    replies = []
    try:
        stream.writer.write(data)
        await stream.writer.drain()
        while len(replies) < messages:
            try:
                replies.append(await asyncio.wait_for(wire.read_message(stream.reader, 1 << 26), 5))
            except EOFError:
                break
            if replies[-1].type == wire.ERROR and replies[-1].fields["code"] in ("protocol", "unknown_session"):
                break
    finally:
        await stream.aclose()
    return replies


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_malformed_requests_get_typed_errors_and_the_peer_keeps_serving(target, client, loop, honest_session,
                                                                        request):
    peer, _ = target
    protocol, data, messages = request
    replies = loop.run(send_raw(client, peer, protocol, data, messages), timeout=60)
    assert replies, "no reply at all"
    for reply in replies:
        assert reply.type in (wire.OPENED, wire.OUTPUT, wire.INFO, wire.ERROR)
        if reply.type == wire.ERROR:
            assert reply.fields["code"] in TYPED, reply.fields
    assert loop.run(peer_session.info(client, peer)).errors.get("internal", 0) == 0
    honest_session()


@pytest.mark.parametrize("case", ["nan", "shape", "dtype", "gap", "past max length", "unknown session",
                                  "second open", "wrong model", "foreign blocks", "mask values"])
def test_fixed_bad_steps(target, client, loop, honest_session, case):
    peer, span = target

    async def run() -> str:
        if case == "unknown session":
            stream = await client.open(peer, wire.SESSION_PROTOCOL)
            try:
                step = messages.Step(0, 0, messages.Hidden.encode(torch.zeros(1, 1, 64), "float32"))
                await wire.write_message(stream.writer, step.to_message())
                reply = await wire.read_message(stream.reader, 1 << 20)
            finally:
                await stream.aclose()
            return reply.fields["code"]
        model, blocks = (("other-model", span) if case == "wrong model" else
                         (MODEL_ID, Span(0, 2)) if case == "foreign blocks" else (MODEL_ID, span))
        try:
            session = await peer_session.PeerSession.open(client, peer, model, blocks, max_length=8)
        except Exception as e:
            return e.code
        async with session:
            if case == "second open":
                await wire.write_message(session.stream.writer, wire.Message(wire.OPEN, {"model": MODEL_ID}))
                return (await wire.read_message(session.stream.reader, 1 << 20)).fields["code"]
            x, pos, mask, encoding = torch.randn(1, 2, 64), 0, None, "float32"
            if case == "nan":
                x[0, 1, 5] = float("nan")
            elif case == "shape":
                x = torch.randn(1, 2, 65)
            elif case == "dtype":
                encoding = "float16"  # send float16 into a session opened for float32 only
            elif case == "gap":
                pos = 3
            elif case == "past max length":
                x = torch.randn(1, 9, 64)
            elif case == "mask values":
                mask = torch.full((1, 2), 7, dtype=torch.int64)
            try:
                await session.step(x, pos, mask, encoding)
            except Exception as e:
                # the session survives a bad step: a good one right after works
                await session.step(torch.randn(1, 2, 64), 0)
                return e.code
            return "accepted"

    expected = {"unknown session": "unknown_session", "wrong model": "not_serving", "foreign blocks": "not_serving"}
    assert loop.run(run()) == expected.get(case, "bad_request")
    honest_session()
