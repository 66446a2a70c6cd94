"""The records protocol: any node of the swarm (a peer, a bootstrap) answers with the signed announcement
records it reads for some DHT keys, so a reader that does not join the DHT (a light client) can find who
serves what. Torch-free.

Trust: a node answering this protocol is a source, not an authority. The reader checks every record itself
(`records.verify`: the signature over key, subkey, expiration and payload, the schema, the expiration, the
span), so a source can withhold records but never forge or re-stamp one; it asks several sources when it
knows several and keeps, per key and signer, the record with the highest sequence number (`merge`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from swarm.net import messages, record_messages, records, wire
from swarm.net.calls import decode_reply, exchange
from swarm.errors import BadRequest, Busy, ProtocolError, SwarmError

logger = logging.getLogger(__name__)

MAX_REPLY_BYTES = record_messages.MAX_RECORD_ENTRIES * record_messages.MAX_RECORD_VALUE_BYTES
MAX_READS = 8  # requests a node answers at once (each reads the DHT); more get `Busy`


def records_handler(node, timeout: float = 10.0, max_reads: int = MAX_READS):
    """The protocol's handler for `node.serve(wire.RECORDS_PROTOCOL, ...)`: one request, one reply per stream;
    at most `max_reads` requests read the DHT at once, the others are answered `Busy` at once."""
    reads = asyncio.Semaphore(max_reads)

    async def serve(stream) -> None:
        try:
            msg = await asyncio.wait_for(wire.read_message(stream.reader, 0), timeout)
            request = record_messages.GetRecords.from_message(msg)
        except (EOFError, asyncio.TimeoutError):
            return
        except (ProtocolError, BadRequest) as e:
            await wire.write_message(stream.writer, messages.Error.of(e).to_message())
            return
        if reads.locked():
            await wire.write_message(stream.writer, messages.Error.of(Busy("too many records requests")).to_message())
            return
        async with reads:
            found = await node.get_records(request.keys)
        entries = [record_messages.RecordEntry(key, subkey, value, expiration)
                   for key in request.keys for subkey, (value, expiration) in found.get(key, {}).items()]
        entries, truncated = entries[:record_messages.MAX_RECORD_ENTRIES], len(entries) > record_messages.MAX_RECORD_ENTRIES
        reply = record_messages.Records(tuple(entries), truncated, await addresses(node, {e.subkey for e in entries}))
        await wire.write_message(stream.writer, reply.to_message())

    return serve


async def addresses(node, peers: set[str]) -> dict[str, list[str]]:
    """Where the node can reach `peers` (the signers of a reply), in a reply's limits; local-network-only
    addresses are kept (a swarm on one machine or LAN uses them), circuit and unparsable ones are not."""
    try:
        known = await node.peer_addrs()
    except (SwarmError, OSError, asyncio.TimeoutError):
        return {}
    out = {}
    for peer in sorted(peers):
        addrs = [a for a in known.get(peer, []) if len(a) <= record_messages.MAX_ADDR_CHARS and "/p2p-circuit" not in a]
        if addrs:
            out[peer] = addrs[:record_messages.MAX_ADDRS]
        if len(out) == record_messages.MAX_ADDR_PEERS:
            break
    return out


async def fetch(node, peer: str, keys: list[str] | tuple[str, ...], timeout: float = 10.0) -> record_messages.Records:
    """The records `peer` reads for `keys` (at most `record_messages.MAX_RECORD_KEYS`), unchecked. `node`: anything
    that opens streams (`open(peer, protocol)`)."""
    stream = await node.open(peer, wire.RECORDS_PROTOCOL)
    try:
        reply = await exchange(stream, record_messages.GetRecords(tuple(keys)).to_message(), timeout,
                               max_tensor_bytes=MAX_REPLY_BYTES)
    finally:
        await stream.aclose()
    return decode_reply(record_messages.Records, reply, peer, "get_records")


@dataclass
class Found:
    """Records checked and merged from one or more sources: per key, per signer, the newest record."""

    kept: dict[str, dict[str, tuple[records.Announcement, bytes, float]]] = field(default_factory=dict)
    refused: int = 0  # records that failed `records.verify` (forged, re-stamped, expired, misplaced)
    truncated: bool = False  # some source left records out
    addrs: dict[str, list[str]] = field(default_factory=dict)  # where sources said the signers are (hints:
    # a wrong address only fails to connect, since a connection authenticates the peer id)

    @property
    def announcements(self) -> dict[str, dict[str, records.Announcement]]:
        return {key: {sub: ann for sub, (ann, _, _) in subs.items()} for key, subs in self.kept.items()}

    def values(self) -> dict[str, dict[str, tuple[bytes, float]]]:
        """{key: {subkey: (value, expiration)}}: what a DHT node's `get_records` gives."""
        return {key: {sub: (value, exp) for sub, (_, value, exp) in subs.items()} for key, subs in self.kept.items()}

    def merge(self, reply: record_messages.Records, now: float | None = None) -> None:
        """Check every record of `reply` and keep each that is newer (by sequence number) than the one kept
        for its key and signer."""
        now = time.time() if now is None else now
        self.truncated |= reply.truncated
        for peer, addrs in reply.addrs.items():
            known = self.addrs.setdefault(peer, [])
            known += [a for a in addrs if a not in known][:max(0, 8 - len(known))]
        for entry in reply.entries:
            try:
                ann = records.verify(records.key_id(entry.key), entry.subkey, entry.value, entry.expiration, now,
                                     records.key_id)
            except records.RecordRejected as e:
                self.refused += 1
                logger.info("refused a record of %s under %s: %s", entry.subkey[-8:], entry.key, e)
                continue
            kept = self.kept.setdefault(entry.key, {})
            if entry.subkey not in kept or ann.seq > kept[entry.subkey][0].seq:
                kept[entry.subkey] = (ann, entry.value, entry.expiration)


async def read(node, sources: list[str], keys: list[str], timeout: float = 10.0, min_sources: int = 2) -> Found:
    """The records under `keys`, checked, from `min_sources` of `sources` that answer (in order; as many at
    once as are still needed), merged by sequence number. Keys go in batches of `record_messages.MAX_RECORD_KEYS`. A
    source that fails is skipped; none answering is a `SwarmError`."""
    found, answered, pending = Found(), 0, list(sources)
    batches = [keys[i:i + record_messages.MAX_RECORD_KEYS] for i in range(0, len(keys), record_messages.MAX_RECORD_KEYS)]

    async def ask(source: str) -> list[record_messages.Records]:
        return list(await asyncio.gather(*(fetch(node, source, batch, timeout) for batch in batches)))

    while pending and answered < min_sources:
        group, pending = pending[:min_sources - answered], pending[min_sources - answered:]
        for source, replies in zip(group, await asyncio.gather(*map(ask, group), return_exceptions=True)):
            if isinstance(replies, (SwarmError, OSError, asyncio.TimeoutError)):
                logger.info("records source %s failed: %s", source[-8:], replies)
                continue
            if isinstance(replies, BaseException):
                raise replies
            for reply in replies:
                found.merge(reply)
            answered += 1
    if not answered:
        raise SwarmError(f"none of {len(sources)} records sources answered")
    return found
