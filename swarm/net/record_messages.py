"""The records protocol's messages (`wire.RECORDS_PROTOCOL`): a client asks a node for the signed records it
reads under some DHT keys (`swarm.net.record_service`). Checked like every message (`swarm.net.messages`):
anything malformed is a `BadRequest`; nothing read here is trusted before `records.verify`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from swarm.errors import BadRequest
from swarm.net.messages import MAX_ID_CHARS, _check_type
from swarm.net.wire import GET_RECORDS, RECORDS, Blob, Message

MAX_RECORD_KEYS = 64  # keys per request (the directory's buckets, or a model's blocks in batches)
MAX_KEY_CHARS = 128
MAX_RECORD_ENTRIES = 256  # records per reply: a node with more for the keys asked says it left some out
MAX_RECORD_VALUE_BYTES = 4096  # above any valid record (`records.MAX_VALUE_BYTES`)
MAX_ADDR_PEERS, MAX_ADDRS, MAX_ADDR_CHARS = 64, 2, 96  # addresses in a reply: peers, per peer, characters
# (so a full reply's header stays well under `wire.MAX_HEADER_BYTES`)


@dataclass(frozen=True)
class GetRecords:
    """Client -> node (records protocol): the records you read under these DHT keys."""

    TYPE = GET_RECORDS
    keys: tuple[str, ...]

    def to_message(self) -> Message:
        return Message(GET_RECORDS, {"keys": list(self.keys)})

    @classmethod
    def from_message(cls, msg: Message) -> GetRecords:
        _check_type(msg, cls)
        keys = msg.fields.get("keys")
        if not (isinstance(keys, list) and 1 <= len(keys) <= MAX_RECORD_KEYS and len(set(map(str, keys))) == len(keys)
                and all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys)):
            raise BadRequest(f"'keys' must list 1-{MAX_RECORD_KEYS} distinct strings of at most {MAX_KEY_CHARS} "
                             "characters")
        return cls(tuple(keys))


@dataclass(frozen=True)
class RecordEntry:
    """One stored record as a node read it: key, subkey (the signer's peer id), the signed value, its expiration.
    Nothing here is trusted by a reader: `records.verify` checks each one."""

    key: str
    subkey: str
    value: bytes
    expiration: float


@dataclass(frozen=True)
class Records:
    """Node -> client (records protocol): the records read for the keys asked; `truncated` when some were
    left out (more than `MAX_RECORD_ENTRIES`). The values travel as one byte tensor, in order."""

    TYPE = RECORDS
    entries: tuple[RecordEntry, ...]
    truncated: bool = False
    addrs: dict = field(default_factory=dict)  # {peer id: [multiaddr, ...]} of signers the node can reach (unsigned)

    def to_message(self) -> Message:
        data = b"".join(e.value for e in self.entries)
        fields = {"entries": [[e.key, e.subkey, e.expiration, len(e.value)] for e in self.entries],
                  "truncated": self.truncated, **({"addrs": self.addrs} if self.addrs else {})}
        return Message(RECORDS, fields, (Blob("int8", (len(data),), data),) if data else ())

    @classmethod
    def from_message(cls, msg: Message) -> Records:
        _check_type(msg, cls)
        rows, truncated = msg.fields.get("entries"), msg.fields.get("truncated", False)
        if not isinstance(rows, list) or len(rows) > MAX_RECORD_ENTRIES or not isinstance(truncated, bool):
            raise BadRequest(f"'entries' must list at most {MAX_RECORD_ENTRIES} records")
        data = bytes(msg.tensors[0].data) if msg.tensors else b""
        if len(msg.tensors) > 1 or (msg.tensors and (msg.tensors[0].dtype != "int8" or len(msg.tensors[0].shape) != 1)):
            raise BadRequest("record values travel as one int8 tensor")
        entries, offset = [], 0
        for row in rows:
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and len(row[0]) <= MAX_KEY_CHARS
                    and isinstance(row[1], str) and len(row[1]) <= MAX_ID_CHARS and type(row[2]) in (int, float)
                    and math.isfinite(row[2]) and type(row[3]) is int and 0 < row[3] <= MAX_RECORD_VALUE_BYTES):
                raise BadRequest("each record must be [key, subkey, expiration, value length]")
            entries.append(RecordEntry(row[0], row[1], data[offset:offset + row[3]], float(row[2])))
            offset += row[3]
        if offset != len(data):
            raise BadRequest(f"record values add up to {offset} bytes, but {len(data)} came")
        addrs = msg.fields.get("addrs", {})
        if not (isinstance(addrs, dict) and len(addrs) <= MAX_ADDR_PEERS and all(
                isinstance(p, str) and len(p) <= MAX_ID_CHARS and isinstance(a, list) and len(a) <= MAX_ADDRS
                and all(isinstance(x, str) and x.startswith("/") and len(x) <= MAX_ADDR_CHARS for x in a)
                for p, a in addrs.items())):
            raise BadRequest(f"'addrs' must map at most {MAX_ADDR_PEERS} peer ids to at most {MAX_ADDRS} multiaddrs")
        return cls(tuple(entries), truncated, addrs)
