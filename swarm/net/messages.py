"""What each message holds, and how hidden states travel in it.

Every message type of `swarm.net.wire` has a frozen dataclass here: `to_message()` builds the wire message,
`from_message()` checks a received one and raises `BadRequest` (a typed error the sender gets back) for
anything malformed; framing errors are `ProtocolError`s from `wire.read_message` before that. Hidden
states travel in one of `ENCODINGS` (`swarm.net.hidden.Hidden`, re-exported here).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import BadRequest, SwarmError
from swarm.net.hidden import ENCODINGS, Hidden, _check_encoding
from swarm.net.integrity import DIGEST_CHARS, KEY_CHARS, TAG_CHARS
from swarm.net.wire import Blob, Message, MAX_CHAIN, OPEN, OPENED, STEP, OUTPUT, CLOSE, FORWARD, INFO, ERROR, PUSH


# ---- typed messages: what each message holds, built and checked in one place ----

MAX_ID_CHARS = 128
SESSION_ID = re.compile(r"s[0-9]{1,20}-[0-9a-f]{1,64}")  # `peer.sessions.SessionTable.open` makes `s<n>-<24 hex>`
HEX = frozenset("0123456789abcdef")
BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def _int(fields: dict[str, Any], name: str, lo: int, hi: int, default: Any = ...) -> Any:
    value = fields.get(name, default)
    if value is default and default is not ...:
        return value
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _num(fields: dict[str, Any], name: str, default: Any = ...) -> Any:
    value = fields.get(name, default)
    if value is default and default is not ...:
        return value
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise BadRequest(f"'{name}' must be a finite non-negative number, got {value!r}")
    return float(value)


MODEL_CHARS = 96  # a model id: a name or a hub repo id (swarm.net.records.MAX_MODEL_ID)

WEIGHTS_DIGEST_CHARS = 32  # swarm.weights.digest; absent from a request: a client that does not say


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _str(fields: dict[str, Any], name: str, limit: int = 256, default: Any = ...) -> Any:
    value = fields.get(name, default)
    if value is default and default is not ...:
        return value
    if not isinstance(value, str) or len(value) > limit:
        raise BadRequest(f"'{name}' must be a string of at most {limit} characters, got {str(value)[:80]!r}")
    return value


def _hex(fields: dict[str, Any], name: str, chars: int, default: Any = ...) -> Any:
    value = fields.get(name, default)
    if value is default and default is not ...:
        return value
    if not (isinstance(value, str) and len(value) == chars and set(value) <= HEX):
        raise BadRequest(f"'{name}' must be {chars} lowercase hex characters, got {str(value)[:80]!r}")
    return value


def _encodings(fields: dict[str, Any], name: str) -> tuple[str, ...]:
    value = fields.get(name)
    if not isinstance(value, list) or not 1 <= len(value) <= len(ENCODINGS) or len(set(map(str, value))) != len(value):
        raise BadRequest(f"'{name}' must list 1-{len(ENCODINGS)} distinct encodings of {ENCODINGS}, got {value!r}")
    return tuple(_check_encoding(v) for v in value)


def _mask(blobs: tuple[Blob, ...]) -> Blob | None:
    if len(blobs) > 1:
        raise BadRequest(f"expected hidden states and an optional attention mask, got {len(blobs)} extra tensors")
    if not blobs:
        return None
    if blobs[0].dtype not in ("bool", "int64") or len(blobs[0].shape) != 2:
        raise BadRequest(f"attention mask must be bool or int64 [batch, length], got {blobs[0].dtype}"
                         f"{list(blobs[0].shape)}")
    return blobs[0]


def _check_type(msg: Message, cls) -> None:
    if msg.type != cls.TYPE:
        raise BadRequest(f"expected a {cls.TYPE!r} message, got {msg.type!r}")


@dataclass(frozen=True)
class ChainHop:
    """A later hop of a chained step: the peer, the client's session there, the step id to use, and the tag
    that lets the hop before it push this step (`swarm.net.integrity.push_tag`)."""

    peer: str
    session: str
    step: int
    tag: str

    @classmethod
    def parse_all(cls, value: Any) -> tuple[ChainHop, ...] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_CHAIN:
            raise BadRequest(f"'next' must be a list of 1-{MAX_CHAIN} hops")
        hops = []
        for hop in value:
            if not isinstance(hop, dict) or set(hop) != {"peer", "session", "step", "tag"}:
                raise BadRequest("each hop of 'next' must be an object with exactly 'peer', 'session', 'step' "
                                 "and 'tag'")
            peer, session, step, tag = hop["peer"], hop["session"], hop["step"], hop["tag"]
            if not (isinstance(peer, str) and 0 < len(peer) <= MAX_ID_CHARS and set(peer) <= BASE58):
                raise BadRequest(f"'next' names an invalid peer id {str(peer)[:80]!r}")
            if not (isinstance(session, str) and 0 < len(session) <= MAX_ID_CHARS):
                raise BadRequest("'next' names an invalid session id")
            if type(step) is not int or not 0 <= step <= 2**62:
                raise BadRequest(f"'next' step ids must be integers in [0, 2**62], got {step!r}")
            hops.append(cls(peer, session, step, _hex({"tag": tag}, "tag", TAG_CHARS)))
        return tuple(hops)


def _chain_fields(chain: tuple[ChainHop, ...] | None) -> dict[str, Any]:
    return {} if not chain else {"next": [{"peer": h.peer, "session": h.session, "step": h.step, "tag": h.tag}
                                         for h in chain]}


def _session_id(fields: dict[str, Any], name: str, default: Any = ...) -> Any:
    """A session id as peers make them (`peer.sessions.SessionTable.open`): `s<counter>-<hex>`."""
    value = fields.get(name, default)
    if value is default and default is not ...:
        return value
    if not (isinstance(value, str) and len(value) <= MAX_ID_CHARS and SESSION_ID.fullmatch(value)):
        raise BadRequest(f"'{name}' must be a session id like 's12-0f3a...' of at most {MAX_ID_CHARS} characters, "
                         f"got {str(value)[:80]!r}")
    return value


@dataclass(frozen=True)
class Open:
    """Client -> peer: open a session on blocks [start, end); its steps may come in any of `encodings`. With
    `fork`, its cache starts as a copy of positions [0, fork_length) of that session of the same client on
    the same peer, and its first step is at `fork_length`."""

    TYPE = OPEN
    model: str
    start: int
    end: int
    max_length: int
    batch: int
    encodings: tuple[str, ...] = ("float32",)
    digest: str | None = None  # the weights the client's head has: a peer with other weights refuses
    fork: str | None = None  # a session id of the same client on this peer, to copy the cache of
    fork_length: int | None = None  # with `fork`: how many positions to copy, 1 to max_length

    def to_message(self) -> Message:
        return Message(OPEN, {"model": self.model, "start": self.start, "end": self.end, "max_length": self.max_length,
                              "batch": self.batch, "encodings": list(self.encodings),
                              **_given(digest=self.digest, fork=self.fork, fork_length=self.fork_length)})

    @classmethod
    def from_message(cls, msg: Message) -> Open:
        _check_type(msg, cls)
        f = msg.fields
        start = _int(f, "start", 0, 2**20)
        max_length = _int(f, "max_length", 1, 2**31)
        if (f.get("fork") is None) != (f.get("fork_length") is None):
            raise BadRequest("'fork' and 'fork_length' come together: the session to copy and how many positions")
        return cls(_str(f, "model", MODEL_CHARS), start, _int(f, "end", start + 1, 2**20), max_length,
                   _int(f, "batch", 1, 2**20), _encodings(f, "encodings"),
                   _hex(f, "digest", WEIGHTS_DIGEST_CHARS, None), _session_id(f, "fork", None),
                   _int(f, "fork_length", 1, max_length, None))


@dataclass(frozen=True)
class Opened:
    """Peer -> client: the session is open; how the peer computes (dtype, weight format, device kind)."""

    TYPE = OPENED
    session: str
    start: int
    end: int
    batch: int
    max_length: int
    encodings: tuple[str, ...]
    cache_tokens_left: int
    dtype: str = "float32"
    quant: str = "none"
    device: str = "cpu"
    push_key: str = ""  # the session's secret for push tags (`swarm.net.integrity`)
    forked: int | None = None  # a fork: the positions copied (a peer that cannot fork leaves it out)

    def to_message(self) -> Message:
        return Message(OPENED, {"session": self.session, "start": self.start, "end": self.end, "batch": self.batch,
                                "max_length": self.max_length, "encodings": list(self.encodings),
                                "cache_tokens_left": self.cache_tokens_left, "dtype": self.dtype,
                                "quant": self.quant, "device": self.device, "push_key": self.push_key,
                                **_given(forked=self.forked)})

    @classmethod
    def from_message(cls, msg: Message) -> Opened:
        _check_type(msg, cls)
        f = msg.fields
        start = _int(f, "start", 0, 2**20)
        return cls(_str(f, "session", MAX_ID_CHARS), start, _int(f, "end", start + 1, 2**20), _int(f, "batch", 1, 2**20),
                   _int(f, "max_length", 1, 2**31), _encodings(f, "encodings"),
                   _int(f, "cache_tokens_left", 0, 2**62), _str(f, "dtype", 16, "float32"),
                   _str(f, "quant", 16, "none"), _str(f, "device", 16, "cpu"), _hex(f, "push_key", KEY_CHARS),
                   _int(f, "forked", 1, 2**31, None))


@dataclass(frozen=True)
class Step:
    """Client -> peer (session protocol): run `hidden` at `position`; with `next`, push the output on."""

    TYPE = STEP
    step: int
    position: int
    hidden: Hidden
    mask: Blob | None = None
    next: tuple[ChainHop, ...] | None = None

    def to_message(self) -> Message:
        return Message(STEP, {"step": self.step, "position": self.position, "encoding": self.hidden.encoding,
                              **_chain_fields(self.next)}, self.hidden.blobs + ((self.mask,) if self.mask else ()))

    @classmethod
    def from_message(cls, msg: Message) -> Step:
        _check_type(msg, cls)
        f = msg.fields
        hidden, rest = Hidden.take(f.get("encoding"), msg.tensors)
        return cls(_int(f, "step", 0, 2**62), _int(f, "position", 0, 2**31), hidden, _mask(rest),
                   ChainHop.parse_all(f.get("next")))


@dataclass(frozen=True)
class Push:
    """Peer -> next peer of a client's route (push protocol, no reply): a chained step's input."""

    TYPE = PUSH
    session: str
    step: int
    tag: str
    position: int
    hidden: Hidden
    mask: Blob | None = None
    next: tuple[ChainHop, ...] | None = None

    def to_message(self) -> Message:
        step = self.as_step().to_message()  # a step's fields and tensors, the session it goes to, the tag
        return Message(PUSH, {"session": self.session, "tag": self.tag, **step.fields}, step.tensors)

    @classmethod
    def from_message(cls, msg: Message) -> Push:
        _check_type(msg, cls)
        fields = {k: v for k, v in msg.fields.items() if k not in ("session", "tag")}
        step = Step.from_message(Message(STEP, fields, msg.tensors))
        return cls(_str(msg.fields, "session", MAX_ID_CHARS), step.step, _hex(msg.fields, "tag", TAG_CHARS),
                   step.position, step.hidden, step.mask, step.next)

    def as_step(self) -> Step:
        return Step(self.step, self.position, self.hidden, self.mask, self.next)


@dataclass(frozen=True)
class Output:
    """Peer -> client: a step's or a forward's output, in the encoding of its input."""

    TYPE = OUTPUT
    hidden: Hidden
    compute_ms: float = 0.0
    step: int | None = None  # session steps only, as are position and length (the cache's after the step)
    position: int | None = None
    length: int | None = None
    pushed: bool | None = None  # chained steps only: whether the output left for the next peer
    push_error: str | None = None
    input: str | None = None  # session steps only: the digest of what it computed on (`swarm.net.integrity`)

    def to_message(self) -> Message:
        fields = {"encoding": self.hidden.encoding, "compute_ms": round(self.compute_ms, 3)}
        for name in ("step", "position", "length", "pushed", "push_error", "input"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return Message(OUTPUT, fields, self.hidden.blobs)

    @classmethod
    def from_message(cls, msg: Message) -> Output:
        _check_type(msg, cls)
        f = msg.fields
        hidden, rest = Hidden.take(f.get("encoding"), msg.tensors)
        if rest:
            raise BadRequest(f"an output carries only hidden states, got {len(rest)} more tensors")
        pushed = f.get("pushed")
        if pushed is not None and type(pushed) is not bool:
            raise BadRequest(f"'pushed' must be true or false, got {pushed!r}")
        return cls(hidden, _num(f, "compute_ms", 0.0), _int(f, "step", 0, 2**62, None),
                   _int(f, "position", 0, 2**31, None), _int(f, "length", 0, 2**31, None), pushed,
                   _str(f, "push_error", 256, None), _hex(f, "input", DIGEST_CHARS, None))


@dataclass(frozen=True)
class Close:
    """Client -> peer: the session ends (the stream closing does the same)."""

    TYPE = CLOSE

    def to_message(self) -> Message:
        return Message(CLOSE)

    @classmethod
    def from_message(cls, msg: Message) -> Close:
        _check_type(msg, cls)
        return cls()


@dataclass(frozen=True)
class Forward:
    """Client -> peer (forward protocol): one stateless forward of whole sequences through [start, end)."""

    TYPE = FORWARD
    model: str
    start: int
    end: int
    hidden: Hidden
    mask: Blob | None = None
    digest: str | None = None  # the weights the client's head has: a peer with other weights refuses

    def to_message(self) -> Message:
        return Message(FORWARD, {"model": self.model, "start": self.start, "end": self.end,
                                 "encoding": self.hidden.encoding, **_given(digest=self.digest)},
                       self.hidden.blobs + ((self.mask,) if self.mask else ()))

    @classmethod
    def from_message(cls, msg: Message) -> Forward:
        _check_type(msg, cls)
        f = msg.fields
        start = _int(f, "start", 0, 2**20)
        hidden, rest = Hidden.take(f.get("encoding"), msg.tensors)
        return cls(_str(f, "model", MODEL_CHARS), start, _int(f, "end", start + 1, 2**20), hidden, _mask(rest),
                   _hex(f, "digest", WEIGHTS_DIGEST_CHARS, None))


@dataclass(frozen=True)
class InfoRequest:
    """Client -> peer (info protocol): what do you serve, and how loaded are you?"""

    TYPE = INFO

    def to_message(self) -> Message:
        return Message(INFO)

    @classmethod
    def from_message(cls, msg: Message) -> InfoRequest:
        _check_type(msg, cls)
        return cls()


def _counts(fields: dict[str, Any], name: str) -> dict[str, float]:
    value = fields.get(name, {})
    if not isinstance(value, dict) or len(value) > 64 or not all(
            isinstance(k, str) and len(k) <= 64 and type(v) in (int, float) for k, v in value.items()):
        raise BadRequest(f"'{name}' must map at most 64 names to numbers")
    return dict(value)


@dataclass(frozen=True)
class Info:
    """Peer -> client (info protocol): what the peer serves, how it computes, and how loaded it is."""

    TYPE = INFO
    peer: str
    model: str
    start: int
    end: int
    version: str = ""
    dtype: str = "float32"
    quant: str = "none"
    device: str = "cpu"
    hidden_size: int = 0
    sessions: int = 0
    max_sessions: int = 0
    cache_tokens: int = 0
    cache_tokens_left: int = 0
    max_length: int = 0
    max_batch: int = 0
    queued: int = 0
    throughput: float = 0.0
    prefill_tps: float = 0.0
    block_ms: float | None = None
    draining: int = 0
    moves: int = 0
    errors: dict = field(default_factory=dict)
    wire_bytes: dict = field(default_factory=dict)
    pushes: dict = field(default_factory=dict)

    def to_message(self) -> Message:
        from dataclasses import asdict

        return Message(INFO, asdict(self))

    @classmethod
    def from_message(cls, msg: Message) -> Info:
        _check_type(msg, cls)
        f = msg.fields
        start = _int(f, "start", 0, 2**20)
        ints = {n: _int(f, n, 0, 2**62, 0) for n in ("hidden_size", "sessions", "max_sessions", "cache_tokens",
                                                     "cache_tokens_left", "max_length", "max_batch", "queued",
                                                     "draining", "moves")}
        return cls(_str(f, "peer", MAX_ID_CHARS), _str(f, "model", MODEL_CHARS), start, _int(f, "end", start + 1, 2**20),
                   _str(f, "version", 32, ""), _str(f, "dtype", 16, "float32"), _str(f, "quant", 16, "none"),
                   _str(f, "device", 16, "cpu"), **ints, throughput=_num(f, "throughput", 0.0),
                   prefill_tps=_num(f, "prefill_tps", 0.0), block_ms=_num(f, "block_ms", None),
                   errors=_counts(f, "errors"), wire_bytes=_counts(f, "wire_bytes"), pushes=_counts(f, "pushes"))


@dataclass(frozen=True)
class Error:
    """Peer -> client: a typed error (`SwarmError.code`), for step `step` when it answers one."""

    TYPE = ERROR
    code: str
    message: str
    step: int | None = None

    @classmethod
    def of(cls, err: SwarmError, step: Any = None) -> Error:
        return cls(err.code, str(err)[:2000], step if type(step) is int else None)

    def to_message(self) -> Message:
        return Message(ERROR, {"code": self.code, "message": self.message,
                               **({"step": self.step} if self.step is not None else {})})

    @classmethod
    def from_message(cls, msg: Message) -> Error:
        _check_type(msg, cls)
        f = msg.fields
        return cls(str(f.get("code"))[:64], str(f.get("message"))[:2000], _int(f, "step", 0, 2**62, None))


# ---- records protocol: signed announcement records, for readers that do not join the DHT ----
