"""Every message that crosses the network between clients and peers, and how it is framed.

A message is one header frame (compact JSON: a `type`, its fields, and a descriptor per tensor)
followed by the tensors' bytes in data frames. Nothing is ever unpickled.

Frame: 4-byte big-endian payload length, 1 kind byte (HEADER or DATA), payload. Invariants:
- no frame is larger than `MAX_FRAME_BYTES` (the transport's message cap): a tensor larger than
  that travels in several data frames, and its descriptor says how many;
- a reader checks every count and size against the descriptor and against its own caps before
  reading the bytes, so a short, long or lying message is a `ProtocolError`, never a hang or a
  huge allocation;
- tensors are explicit dtype (from an allowlist) + shape + raw little-endian bytes.

Protocol ids are versioned constants; a breaking change gets a new id. What each message holds, and
how hidden states are encoded in it, is `swarm/net/messages.py`.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import ProtocolError

SESSION_PROTOCOL = "/swarm/session/3.0.0"  # long-lived: open, then steps, then close
FORWARD_PROTOCOL = "/swarm/forward/2.0.0"  # one stateless forward of whole sequences
INFO_PROTOCOL = "/swarm/info/1.0.0"  # what the peer serves and how loaded it is
PUSH_PROTOCOL = "/swarm/push/3.0.0"  # peer -> next peer of a route: a chained step's input, no reply
RECORDS_PROTOCOL = "/swarm/records/1.0.0"  # the signed records a node reads for some keys (no DHT needed to ask)
WEIGHTS_PROTOCOL = "/swarm/weights/1.0.0"  # peer -> peer: which weight files it holds, and their bytes (swarm.weights)

MAX_FRAME_BYTES = 4 * 2**20  # the transport caps one message at 4 MiB: bigger tensors are split
MAX_HEADER_BYTES = 64 * 2**10  # headers are small JSON; anything bigger is an attack or a bug
MAX_TENSORS = 4  # hidden states and an attention mask are the most any message carries
MAX_DIMS = 4
HEADER, DATA = 1, 2
_FRAME = struct.Struct(">IB")

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1, "int8": 1}

# Message types. Client -> peer: OPEN, STEP, CLOSE (session protocol), FORWARD, INFO.
# Peer -> client: OPENED, OUTPUT, INFO (the reply), ERROR. Peer -> peer: PUSH (push protocol).
OPEN, OPENED, STEP, OUTPUT, CLOSE, FORWARD, INFO, ERROR, PUSH = (
    "open", "opened", "step", "output", "close", "forward", "info", "error", "push")
GET_RECORDS, RECORDS = "get_records", "records"  # client -> node, node -> client (records protocol)
# weights protocol: HAVE, GET peer -> holder; HELD, CHUNK, END holder -> peer (swarm/weights/messages.py)
HAVE, HELD, GET, CHUNK, END = "have", "held", "get", "chunk", "end"
MAX_CHAIN = 64  # hops a chained step may still name after the first


@dataclass
class Traffic:
    """Bytes this process wrote with `write_message` and read with `read_message`, frame headers
    included (what crosses the stream; the transport's own framing and encryption are not counted)."""

    sent: int = 0
    received: int = 0


TRAFFIC = Traffic()  # per process; plain integers, updated on the event loop that does the I/O


def traffic() -> dict[str, int]:
    """A snapshot of this process's `TRAFFIC`."""
    return {"sent": TRAFFIC.sent, "received": TRAFFIC.received}


@dataclass(frozen=True)
class Blob:
    """A tensor on the wire: dtype name, shape, raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Message:
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: tuple[Blob, ...] = ()


def _parts(nbytes: int) -> int:
    return -(-nbytes // MAX_FRAME_BYTES)


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of `msg`, ready to write in order."""
    if len(msg.tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors travel in one message")
    descs = []
    for blob in msg.tensors:
        if not 1 <= len(blob.shape) <= MAX_DIMS:
            raise ValueError(f"tensors travel with 1-{MAX_DIMS} dimensions, not {len(blob.shape)}")
        if blob.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {blob.dtype} cannot travel")
        if len(memoryview(blob.data).cast("B")) != blob.nbytes:
            raise ValueError(f"tensor bytes do not match {blob.dtype}{list(blob.shape)}")
        descs.append({"dtype": blob.dtype, "shape": list(blob.shape), "parts": _parts(blob.nbytes)})
    header = json.dumps({**msg.fields, "type": msg.type, "tensors": descs}, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    frames: list[bytes | memoryview] = [_FRAME.pack(len(header), HEADER) + header]
    for blob in msg.tensors:
        view = memoryview(blob.data).cast("B")
        for off in range(0, len(view), MAX_FRAME_BYTES):
            part = view[off:off + MAX_FRAME_BYTES]
            frames += [_FRAME.pack(len(part), DATA), part]
    return frames


COALESCE_BYTES = 64 * 2**10  # frames up to this size in all go out in one write


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    frames = encode(msg)
    size = sum(len(f) for f in frames)
    TRAFFIC.sent += size
    if size <= COALESCE_BYTES:  # a decode step: one write (one syscall, one packet) rather than three
        writer.write(b"".join(frames))
    else:  # big tensors go as they are, uncopied
        for frame in frames:
            writer.write(frame)
    await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, kind: int, limit: int, what: str) -> bytes:
    try:
        length, got = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    except asyncio.IncompleteReadError as e:
        if not e.partial and kind == HEADER and what == "message":
            raise EOFError("stream closed") from None
        raise ProtocolError(f"stream ended in the middle of {what}") from None
    TRAFFIC.received += _FRAME.size
    if got != kind:
        raise ProtocolError(f"expected a {'header' if kind == HEADER else 'data'} frame for {what}, got kind {got}")
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes for {what} exceeds the limit of {limit}")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        TRAFFIC.received += len(e.partial)
        raise ProtocolError(f"{what} cut short: {len(e.partial)} of {length} bytes") from None
    TRAFFIC.received += length
    return payload


def _check_descriptor(desc: Any, max_tensor_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(desc, dict):
        raise ProtocolError("tensor descriptor must be an object")
    dtype, shape, parts = desc.get("dtype"), desc.get("shape"), desc.get("parts")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ProtocolError(f"dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS
            or not all(type(d) is int and 0 <= d <= 2**31 for d in shape)):
        raise ProtocolError(f"shape {shape!r} must be 1-{MAX_DIMS} non-negative integers")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if nbytes > max_tensor_bytes:
        raise ProtocolError(f"tensor {dtype}{shape} of {nbytes} bytes exceeds the limit of {max_tensor_bytes}")
    if type(parts) is not int or parts != _parts(nbytes):
        raise ProtocolError(f"tensor of {nbytes} bytes must come in {_parts(nbytes)} parts, header says {parts!r}")
    return dtype, tuple(shape), nbytes, parts


async def read_message(reader: asyncio.StreamReader, max_tensor_bytes: int) -> Message:
    """Read one whole message. EOFError if the stream closed cleanly before it; ProtocolError otherwise."""
    raw = await _read_frame(reader, HEADER, MAX_HEADER_BYTES, "message")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, oversize numbers, absurd nesting
        raise ProtocolError("header is not JSON (or nests too deep)") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("header must be an object with a string 'type'")
    descs = header.pop("tensors", [])
    if not isinstance(descs, list) or len(descs) > MAX_TENSORS:
        raise ProtocolError(f"'tensors' must be a list of at most {MAX_TENSORS} descriptors")
    checked = [_check_descriptor(d, max_tensor_bytes) for d in descs]
    if sum(c[2] for c in checked) > max_tensor_bytes:
        raise ProtocolError(f"tensors exceed the limit of {max_tensor_bytes} bytes in all")
    blobs = []
    for i, (dtype, shape, nbytes, parts) in enumerate(checked):
        buf = bytearray()  # grows with what actually arrives: a lying descriptor costs the liar, not us
        for p in range(parts):
            chunk = await _read_frame(reader, DATA, min(MAX_FRAME_BYTES, nbytes - len(buf)),
                                      f"tensor {i} part {p + 1}/{parts}")
            buf += chunk
        if len(buf) != nbytes:
            raise ProtocolError(f"tensor {i} carried {len(buf)} of {nbytes} bytes")
        blobs.append(Blob(dtype, shape, buf))
    typ = header.pop("type")
    return Message(typ, header, tuple(blobs))


# ---- tensors: torch is imported lazily so that DHT-only processes never load it ----

def blob_of(tensor) -> Blob:
    import torch

    t = tensor.detach().contiguous().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype} cannot travel")
    flat = t.reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return Blob(dtype, tuple(t.shape), memoryview(data) if flat.numel() else b"")


def tensor_of(blob: Blob):
    import torch

    dtype = getattr(torch, blob.dtype)
    if blob.nbytes == 0:
        return torch.empty(blob.shape, dtype=dtype)
    buf = blob.data if isinstance(blob.data, bytearray) else bytearray(blob.data)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(blob.shape)
