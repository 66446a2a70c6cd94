"""Announcement records: what a peer says about the blocks it serves, signed, and how every DHT node
checks them.

A record lives in the DHT under key `block_key(model, block)` and subkey = the announcing peer's id.
Each peer also stores its announcement, with the model's `num_blocks`, in the directory: under
`directory_key(peer)`, one of `DIRECTORY_BUCKETS` keys `_models.{n}` chosen by a hash of the peer id
(no model id starts with '_', so they cannot collide with block keys). Reading every bucket lists
every peer of every model, which is how a health monitor finds the models it was not told about;
splitting it keeps each DHT value small enough to read (see docs/protocol.md).

A value is an envelope: one version byte, a 64-byte Ed25519 signature, then the payload as compact
JSON. The signature covers a domain tag, the DHT key id, the subkey, the expiration time and the
payload, so a signed value cannot be moved to another block or key, another subkey, or a later
expiration.

Invariants (checked by `verify` on store and on read, by every node of our swarm):
- the subkey is a peer id, equal to the payload's `peer`, and the signature verifies against it;
- the payload follows the schema (unknown fields are tolerated, so newer peers can add optional
  ones); the key is one of the blocks of the announced span, or the peer's own directory bucket when
  the payload carries `num_blocks`, no fields but the directory's and fits in `MAX_DIRECTORY_VALUE_BYTES`;
- the expiration is not beyond `now + MAX_TTL` and not already past;
- the whole value fits in `MAX_VALUE_BYTES`;
- per (key, subkey), sequence numbers only grow (`SequenceGuard`): an older record, or a different
  record with the same number, is refused while the newer one lives; records of other subkeys never are.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
import dataclasses
import functools
from dataclasses import asdict, dataclass, field

from swarm.net.identity import Identity, PeerId, verify as verify_signature
from swarm.span import Span

ENVELOPE_VERSION = 1
SIGNATURE_BYTES = 64
MAX_VALUE_BYTES = 2048  # a record is ~300 bytes; the cap bounds what a forger can make every node store
MAX_TTL = 300.0  # seconds: a vanished peer disappears from the swarm within this time at most
CLOCK_SKEW = 30.0  # seconds of clock difference tolerated between honest nodes
STATES = ("joining", "online", "offline")
MAX_BLOCKS = 4096  # no model we can serve has more decoder layers
_DOMAIN = b"swarm-announcement-v1\0"
# A model id is a hub repo id ("org/name") or one name of our own; 96 characters at most, as the hub's.
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
MAX_MODEL_ID = 96
_DIGEST = re.compile(r"[0-9a-f]{32}")
# The directory: every peer of every model, one subkey each, spread over buckets so that no single DHT
# value has to hold the whole swarm. Model ids never start with '_'.
DIRECTORY_BUCKETS = 64
DIRECTORY_KEYS = tuple(f"_models.{n}" for n in range(DIRECTORY_BUCKETS))
# The largest schema-valid directory payload (96-character model id, a digest, 32-character version,
# every number at its longest) seals to ~555 bytes; a tight cap makes each bucket hold as many peers as
# possible.
MAX_DIRECTORY_VALUE_BYTES = 576
# Fields older payloads lack; omitted from the payload when None, never null. Only `num_blocks` and
# `digest` may appear in a directory record.
_OPTIONAL = ("num_blocks", "sessions", "queued", "since", "links", "max_blocks", "device", "dtype", "quant",
             "digest", "reach")
DEVICE_KINDS = ("cpu", "cuda", "mps")
RECORD_DTYPES = ("float32", "bfloat16", "float16")
RECORD_QUANTS = ("none", "int8", "nf4")
REACH = ("direct", "relay")  # how a peer is reached: dialled directly, or through a relay (it is behind a NAT)
MAX_LINKS = 16  # round trips to next peers in one record at most
LINK_ID_CHARS = 8  # a next peer is named by the last characters of its id: compact, and enough to match


class RecordRejected(ValueError):
    """A record failed validation; the message says which rule."""


def block_key(model: str, block: int) -> str:
    return f"{model}.block{block}"


def key_id(key: str) -> bytes:
    """The id under which the DHT stores `key`, which records are signed over: the SHA-1 of the key encoded
    as a MessagePack string (what the DHT hashes). Computed here, without a DHT node, so that any reader
    checks signatures the same way (a light client reads records from peers, not from the DHT)."""
    raw = key.encode()
    n = len(raw)
    if n < 32:
        head = bytes([0xA0 | n])
    elif n < 2**8:
        head = b"\xd9" + n.to_bytes(1, "big")
    elif n < 2**16:
        head = b"\xda" + n.to_bytes(2, "big")
    else:
        head = b"\xdb" + n.to_bytes(4, "big")
    return hashlib.sha1(head + raw).digest()


def directory_key(peer: str) -> str:
    """The directory bucket a peer announces itself in: a stable hash of its id."""
    return DIRECTORY_KEYS[int.from_bytes(hashlib.sha256(peer.encode()).digest()[:4], "big") % DIRECTORY_BUCKETS]


def check_model_id(model: str) -> str:
    if not isinstance(model, str) or len(model) > MAX_MODEL_ID or not _MODEL_ID.fullmatch(model):
        raise ValueError(f"model id {model!r} must be a name or 'org/name' of letters, digits, '.', '_' or '-' "
                         f"({MAX_MODEL_ID} characters at most)")
    return model


@dataclass(frozen=True)
class Announcement:
    """What one peer says about itself, for each block of its span."""

    peer: PeerId
    model: str
    start: int
    end: int
    state: str
    throughput: float  # tokens per second the span processes in a batch-1 decode step (self-reported)
    prefill_tps: float  # tokens per second of a prefill through the span (self-reported)
    cache_tokens_left: int
    version: str
    seq: int
    issued_at: float
    num_blocks: int | None = None  # blocks of the whole model; required under the directory key
    # Load and links (optional, block records only): sessions open, steps waiting for compute, when this
    # peer began to claim this span (the earlier claim wins when two peers go for the same hole), and the
    # round trips in ms it measured to peers it pushes to, keyed by the last `LINK_ID_CHARS` of their ids.
    sessions: int | None = None
    queued: int | None = None
    since: float | None = None
    links: dict | None = None
    max_blocks: int | None = None  # blocks its memory budget holds (placement weighs spans by it)
    # How it computes (block records only; absent in older records: float32 on a CPU): device kind, dtype,
    # and weight format of the layers' linear weights (swarm.model.precision).
    device: str | None = None
    dtype: str | None = None
    quant: str | None = None
    # Which weights exactly (swarm.weights.digest): peers whose digests differ are never chained.
    digest: str | None = None
    reach: str | None = None  # one of REACH (block records only; absent on one machine and in older records)
    extra: dict = field(default_factory=dict, compare=False)  # optional fields of newer versions, kept as-is

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    def for_directory(self) -> Announcement:
        """This announcement as the directory holds it: only the fields every version knows there."""
        return dataclasses.replace(self, sessions=None, queued=None, since=None, links=None,
                                   max_blocks=None, device=None, dtype=None, quant=None, reach=None,
                                   extra={})

    @property
    def weights(self) -> tuple[str, str]:
        """(dtype, quant) of its weights; float32 unquantized for records that do not say."""
        return self.dtype or "float32", self.quant or "none"

    def to_payload(self) -> bytes:
        data = {k: v for k, v in asdict(self).items() if k != "extra" and not (k in _OPTIONAL and v is None)}
        return json.dumps({**self.extra, **data}, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_payload(cls, payload: bytes) -> Announcement:
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, oversize numbers, absurd nesting
            raise RecordRejected(f"payload is not JSON ({type(e).__name__})") from None
        if not isinstance(data, dict):
            raise RecordRejected("payload is not an object")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = known - data.keys() - set(_OPTIONAL)
        if missing:
            raise RecordRejected(f"payload lacks {sorted(missing)}")
        if any(k in data and data[k] is None for k in _OPTIONAL):  # None would not survive a round trip
            raise RecordRejected(f"optional fields {list(_OPTIONAL)} are left out when absent, never null")
        ann = cls(**{k: data[k] for k in known if k in data}, extra={k: v for k, v in data.items() if k not in known})
        ann.check_schema()
        return ann

    def check_schema(self) -> None:
        def is_int(v, lo, hi):
            return type(v) is int and lo <= v <= hi

        def is_num(v):
            if type(v) is int:
                return 0 <= v < 2**53
            return type(v) is float and math.isfinite(v) and v >= 0

        if not isinstance(self.peer, str) or not isinstance(self.version, str) or len(self.version) > 32:
            raise RecordRejected("peer and version must be strings (version at most 32 characters)")
        try:
            check_model_id(self.model)
        except ValueError as e:
            raise RecordRejected(str(e)) from None
        if not (is_int(self.start, 0, MAX_BLOCKS - 1) and is_int(self.end, 1, MAX_BLOCKS) and self.start < self.end):
            raise RecordRejected(f"span [{self.start!r}, {self.end!r}) is not a valid block span")
        if self.state not in STATES:
            raise RecordRejected(f"state {self.state!r} is not one of {STATES}")
        if not (is_num(self.throughput) and is_num(self.prefill_tps) and is_num(self.issued_at)):
            raise RecordRejected("throughput figures and issue time must be finite non-negative numbers")
        if not is_int(self.cache_tokens_left, 0, 2**40) or not is_int(self.seq, 0, 2**63 - 1):
            raise RecordRejected("cache tokens left and sequence number must be non-negative integers in range")
        if self.num_blocks is not None and not is_int(self.num_blocks, self.end, MAX_BLOCKS):
            raise RecordRejected(f"num_blocks {self.num_blocks!r} must be an integer from the span's end "
                                 f"to {MAX_BLOCKS}")
        if self.max_blocks is not None and not is_int(self.max_blocks, 1, MAX_BLOCKS):
            raise RecordRejected(f"max_blocks must be an integer from 1 to {MAX_BLOCKS}")
        for name in ("sessions", "queued"):
            if getattr(self, name) is not None and not is_int(getattr(self, name), 0, 2**31):
                raise RecordRejected(f"{name} must be a non-negative integer")
        if self.digest is not None and not (isinstance(self.digest, str) and _DIGEST.fullmatch(self.digest)):
            raise RecordRejected("digest must be 32 lowercase hex digits")
        for name, allowed in (("device", DEVICE_KINDS), ("dtype", RECORD_DTYPES), ("quant", RECORD_QUANTS),
                              ("reach", REACH)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise RecordRejected(f"{name} {getattr(self, name)!r} is not one of {allowed}")
        if self.since is not None and not is_num(self.since):
            raise RecordRejected("since must be a finite non-negative number")
        if self.links is not None and not (
                isinstance(self.links, dict) and len(self.links) <= MAX_LINKS
                and all(isinstance(k, str) and len(k) == LINK_ID_CHARS and is_num(v) for k, v in self.links.items())):
            raise RecordRejected(f"links must map at most {MAX_LINKS} peer-id suffixes of {LINK_ID_CHARS} characters "
                                 "to round trips in ms")


def signed_message(key_id: bytes, subkey: str, expiration: float, payload: bytes) -> bytes:
    sub = subkey.encode()
    return b"".join([_DOMAIN, struct.pack(">H", len(key_id)), key_id, struct.pack(">H", len(sub)), sub,
                     struct.pack(">d", expiration), payload])


def seal(identity: Identity, ann: Announcement, key_id: bytes, expiration: float) -> bytes:
    """The envelope to store under (key_id, ann.peer) until `expiration`."""
    if ann.peer != identity.peer_id:
        raise ValueError("an announcement can only be sealed by its own peer")
    payload = ann.to_payload()
    sig = identity.sign(signed_message(key_id, ann.peer, expiration, payload))
    value = bytes([ENVELOPE_VERSION]) + sig + payload
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"announcement of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    return value


def open_envelope(value: bytes) -> tuple[bytes, bytes]:
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        raise RecordRejected(f"value must be at most {MAX_VALUE_BYTES} bytes")
    if len(value) < 1 + SIGNATURE_BYTES + 2 or value[0] != ENVELOPE_VERSION:
        raise RecordRejected("value is not a version-1 signed envelope")
    return value[1:1 + SIGNATURE_BYTES], value[1 + SIGNATURE_BYTES:]


@functools.lru_cache(maxsize=8192)
def _signature_ok(peer: str, signature: bytes, message: bytes) -> bool:
    """`identity.verify`, remembered: a DHT read returns the same record from every node that stores it, and
    every read until it is re-announced; each is checked once (an Ed25519 check costs ~0.15 ms of CPU, which
    a peer held to a tenth of a core cannot spare 200 times a read). At most 8192 entries of a few hundred
    bytes each (a record is at most `MAX_VALUE_BYTES`)."""
    return verify_signature(peer, signature, message)


def verify(key_id: bytes, subkey: object, value: bytes, expiration: float, now: float,
           key_id_of: Callable[[str], bytes]) -> Announcement:
    """Check one stored record; return its announcement or raise `RecordRejected` naming the rule.

    `key_id_of` maps a DHT key string to the id the DHT stores it under (the transport's hashing).
    """
    if not isinstance(subkey, str) or len(subkey) > 128:
        raise RecordRejected("subkey must be the signer's peer id")
    if not isinstance(expiration, float) or not math.isfinite(expiration):
        raise RecordRejected("expiration must be a finite float")
    if expiration > now + MAX_TTL:
        raise RecordRejected(f"expiration is {expiration - now:.0f} s ahead, beyond the {MAX_TTL:.0f} s maximum")
    if expiration < now - CLOCK_SKEW:
        raise RecordRejected("record already expired")
    signature, payload = open_envelope(value)
    if not _signature_ok(subkey, signature, signed_message(key_id, subkey, expiration, payload)):
        raise RecordRejected("signature does not verify against the subkey's peer id")
    ann = Announcement.from_payload(payload)
    if ann.peer != subkey:
        raise RecordRejected("payload's peer is not the subkey")
    if ann.issued_at > now + CLOCK_SKEW or expiration - ann.issued_at > MAX_TTL + CLOCK_SKEW:
        raise RecordRejected("issue time is in the future or too long before the expiration")
    if key_id == key_id_of(directory_key(subkey)):
        if ann.num_blocks is None:
            raise RecordRejected("a directory record must carry num_blocks")
        if ann.extra or ann != ann.for_directory() or len(value) > MAX_DIRECTORY_VALUE_BYTES:
            raise RecordRejected(f"a directory record carries no unknown fields and fits in "
                                 f"{MAX_DIRECTORY_VALUE_BYTES} bytes")
    elif key_id not in {key_id_of(block_key(ann.model, b)) for b in range(ann.start, ann.end)}:
        raise RecordRejected("key is not one of the announced span's blocks, nor the peer's directory bucket")
    return ann


class SequenceGuard:
    """Remembers the newest sequence number seen per (key, subkey) so that replays are refused.

    What it refuses is bounded in scope and in time, so that it cannot lock a reader out of honest records:
    - only records of the same (key, subkey) as a newer one it admitted, and a newer one of a subkey must
      be signed by that subkey's peer (`verify` runs first): nobody can make it refuse another peer's records;
    - only while that newer record is alive: until its expiration (as it was signed, but never counted
      beyond `MAX_TTL` after it was admitted) plus `CLOCK_SKEW`, the time `verify` itself accepts it.

    Bounded in memory: entries whose record has expired are dropped, and past `max_entries` the entries
    expiring soonest go first.
    """

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self._seen: dict[tuple[bytes, str], tuple[int, bytes, float]] = {}

    def admit(self, key_id: bytes, subkey: str, seq: int, value: bytes, expiration: float, now: float) -> None:
        entry = (key_id, subkey)
        digest = hashlib.sha256(value + struct.pack(">d", expiration)).digest()
        expiration = min(expiration, now + MAX_TTL)
        known = self._seen.get(entry)
        if known is not None and known[2] >= now - CLOCK_SKEW:
            if seq < known[0]:
                raise RecordRejected(f"sequence number {seq} is older than the stored {known[0]}")
            if seq == known[0] and digest != known[1]:
                raise RecordRejected(f"a different record with sequence number {seq} is already stored")
        if known is None or seq >= known[0] or known[2] < now - CLOCK_SKEW:
            self._seen[entry] = (seq, digest, expiration)
        if len(self._seen) > self.max_entries:
            self._prune(now)

    def _prune(self, now: float) -> None:
        live = {k: v for k, v in self._seen.items() if v[2] >= now - CLOCK_SKEW}
        if len(live) > self.max_entries:
            live = dict(sorted(live.items(), key=lambda kv: kv[1][2])[len(live) - self.max_entries:])
        self._seen = live

    def __len__(self) -> int:
        return len(self._seen)
