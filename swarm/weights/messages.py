"""The messages of the weights protocol (`wire.WEIGHTS_PROTOCOL`, docs/protocol.md), each a frozen dataclass
with `to_message()` and a validating `from_message()`, as in `swarm.net.messages`. Errors travel as
`swarm.net.messages.Error`. Torch-free.

Client -> peer: `have` (which of these files do you hold?) and `get` (a byte range of one file). Peer ->
client: `held` (the subset held, with sizes); for a `get`, `chunk` messages (the bytes, in order) then
`end`; `error` instead of either, or in the middle of the chunks. The protocol id and the type names are in
`swarm.net.wire`, with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.errors import BadRequest
from swarm.net.wire import CHUNK, END, GET, HAVE, HELD, Blob, Message

SHA256_CHARS = 64  # a file is named by the sha256 of its bytes, lowercase hex
MAX_HAVE = 256  # files asked about in one `have` (a model's files in one request)
MAX_GET_BYTES = 256 * 2**20  # bytes one `get` may ask for: a client asks for a bigger file in pieces
CHUNK_BYTES = 2**20  # bytes of one `chunk` (one data frame, well under `wire.MAX_FRAME_BYTES`)
MAX_FILE_BYTES = 2**50  # any real weight file is far smaller; keeps sizes exact in JSON
_HEX = frozenset("0123456789abcdef")


def is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == SHA256_CHARS and set(value) <= _HEX


def check_sha256(value: Any, what: str = "'sha256'") -> str:
    if not is_sha256(value):
        raise BadRequest(f"{what} must be {SHA256_CHARS} lowercase hex characters, got {str(value)[:80]!r}")
    return value


def _int(fields: dict[str, Any], name: str, hi: int) -> int:
    value = fields.get(name)
    if type(value) is not int or not 0 <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [0, {hi}], got {str(value)[:40]}")
    return value


def _check_type(msg: Message, cls) -> None:
    if msg.type != cls.TYPE:
        raise BadRequest(f"expected a {cls.TYPE!r} message, got {msg.type!r}")
    if msg.tensors and cls.TYPE != CHUNK:
        raise BadRequest(f"a {cls.TYPE!r} message carries no tensor")


@dataclass(frozen=True)
class Have:
    """Client -> peer: which of these files (by sha256) do you hold?"""

    TYPE = HAVE
    sha256s: tuple[str, ...]

    def to_message(self) -> Message:
        return Message(HAVE, {"sha256s": list(self.sha256s)})

    @classmethod
    def from_message(cls, msg: Message) -> Have:
        _check_type(msg, cls)
        names = msg.fields.get("sha256s")
        if not (isinstance(names, list) and 1 <= len(names) <= MAX_HAVE and all(map(is_sha256, names))
                and len(set(names)) == len(names)):
            raise BadRequest(f"'sha256s' must list 1-{MAX_HAVE} distinct sha256s ({SHA256_CHARS} lowercase hex "
                             "characters each)")
        return cls(tuple(names))


@dataclass(frozen=True)
class Held:
    """Peer -> client: the files of a `have` this peer holds and will give out, with their sizes in bytes."""

    TYPE = HELD
    files: dict[str, int]

    def to_message(self) -> Message:
        return Message(HELD, {"files": dict(self.files)})

    @classmethod
    def from_message(cls, msg: Message) -> Held:
        _check_type(msg, cls)
        files = msg.fields.get("files")
        if not (isinstance(files, dict) and len(files) <= MAX_HAVE and all(
                is_sha256(k) and type(v) is int and 0 <= v <= MAX_FILE_BYTES for k, v in files.items())):
            raise BadRequest(f"'files' must map at most {MAX_HAVE} sha256s to sizes in [0, {MAX_FILE_BYTES}]")
        return cls(files)


@dataclass(frozen=True)
class Get:
    """Client -> peer: the bytes [offset, offset + length) of the file `sha256`, at most `MAX_GET_BYTES`."""

    TYPE = GET
    sha256: str
    offset: int
    length: int

    def to_message(self) -> Message:
        return Message(GET, {"sha256": self.sha256, "offset": self.offset, "length": self.length})

    @classmethod
    def from_message(cls, msg: Message) -> Get:
        _check_type(msg, cls)
        f = msg.fields
        return cls(check_sha256(f.get("sha256")), _int(f, "offset", MAX_FILE_BYTES), _int(f, "length", MAX_GET_BYTES))


@dataclass(frozen=True)
class Chunk:
    """Peer -> client: the next bytes of a `get`, 1 to `CHUNK_BYTES` of them, as one int8 tensor."""

    TYPE = CHUNK
    data: bytes | bytearray | memoryview

    def to_message(self) -> Message:
        return Message(CHUNK, {}, (Blob("int8", (len(self.data),), self.data),))

    @classmethod
    def from_message(cls, msg: Message) -> Chunk:
        _check_type(msg, cls)
        if len(msg.tensors) != 1 or msg.tensors[0].dtype != "int8" or len(msg.tensors[0].shape) != 1:
            raise BadRequest("a chunk carries its bytes as one int8 tensor")
        if not 1 <= msg.tensors[0].nbytes <= CHUNK_BYTES:
            raise BadRequest(f"a chunk carries 1 to {CHUNK_BYTES} bytes, not {msg.tensors[0].nbytes}")
        return cls(msg.tensors[0].data)


@dataclass(frozen=True)
class End:
    """Peer -> client: every byte of the `get` was sent; `length` of them in all."""

    TYPE = END
    length: int

    def to_message(self) -> Message:
        return Message(END, {"length": self.length})

    @classmethod
    def from_message(cls, msg: Message) -> End:
        _check_type(msg, cls)
        return cls(_int(msg.fields, "length", MAX_GET_BYTES))
