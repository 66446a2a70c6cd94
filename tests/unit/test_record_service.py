"""The records protocol's parts without a swarm: key ids as the DHT computes them, the typed messages, and
how a reader checks and merges what sources send (forged, re-stamped, misplaced and older records)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from swarm.net import record_messages, records
from swarm.errors import BadRequest
from swarm.net.identity import Identity
from swarm.net.record_service import Found

pytestmark = pytest.mark.unit

MODEL = "tiny-llama"
HONEST, ATTACKER = Identity.generate(), Identity.generate()


@pytest.mark.parametrize("length", [0, 1, 31, 32, 255, 256, 70_000])
def test_key_ids_are_the_dht_s(length):
    from swarm.net.transport import _hm

    key = ("k" * length) + "é"
    assert records.key_id(key) == _hm().DHTID.generate(source=key).to_bytes()
    block = records.block_key(MODEL, 3)
    assert records.key_id(block) == _hm().DHTID.generate(source=block).to_bytes()


def announcement(identity: Identity = HONEST, **changes) -> records.Announcement:
    fields = dict(peer=identity.peer_id, model=MODEL, start=0, end=2, state="online", throughput=12.5,
                  prefill_tps=300.0, cache_tokens_left=4096, version="0.1.0", seq=7, issued_at=time.time())
    return records.Announcement(**{**fields, **changes})


def entry(ann: records.Announcement, block: int = 0, signer: Identity = HONEST,
          expiration: float | None = None) -> record_messages.RecordEntry:
    key = records.block_key(MODEL, block)
    expiration = time.time() + 60 if expiration is None else expiration
    signed = records.signed_message(records.key_id(key), ann.peer, expiration, ann.to_payload())
    value = bytes([records.ENVELOPE_VERSION]) + signer.sign(signed) + ann.to_payload()  # any signer, as a forger can
    return record_messages.RecordEntry(key, ann.peer, value, expiration)


def test_records_round_trip_through_their_message():
    reply = record_messages.Records((entry(announcement()), entry(announcement(seq=8), block=1)), truncated=True,
                             addrs={HONEST.peer_id: ["/ip4/127.0.0.1/tcp/4001"]})
    assert record_messages.Records.from_message(reply.to_message()) == reply
    empty = record_messages.Records(())
    assert record_messages.Records.from_message(empty.to_message()) == empty
    ask = record_messages.GetRecords((records.block_key(MODEL, 0), records.DIRECTORY_KEYS[5]))
    assert record_messages.GetRecords.from_message(ask.to_message()) == ask


def test_addresses_in_a_reply_are_bounded():
    msg = record_messages.Records((entry(announcement()),)).to_message()
    for addrs in ({HONEST.peer_id: ["/ip4/1.2.3.4/tcp/1"] * (record_messages.MAX_ADDRS + 1)}, {HONEST.peer_id: ["not"]},
                  {f"p{i}": [] for i in range(record_messages.MAX_ADDR_PEERS + 1)}, [1]):
        with pytest.raises(BadRequest):
            record_messages.Records.from_message(dataclasses.replace(msg, fields={**msg.fields, "addrs": addrs}))


@pytest.mark.parametrize("fields", [{}, {"keys": []}, {"keys": ["a", "a"]}, {"keys": ["x" * 200]}, {"keys": [3]},
                                    {"keys": [f"k{i}" for i in range(record_messages.MAX_RECORD_KEYS + 1)]}])
def test_malformed_requests_are_bad_requests(fields):
    from swarm.net.wire import GET_RECORDS, Message

    with pytest.raises(BadRequest):
        record_messages.GetRecords.from_message(Message(GET_RECORDS, fields))


def test_a_reply_whose_values_do_not_add_up_is_refused():
    msg = record_messages.Records((entry(announcement()),)).to_message()
    bad = dataclasses.replace(msg, fields={**msg.fields, "entries": [[*msg.fields["entries"][0][:3], 5]]})
    with pytest.raises(BadRequest):
        record_messages.Records.from_message(bad)


def test_a_reader_keeps_the_newest_honest_record_and_refuses_forgeries():
    honest = announcement(seq=7)
    older = entry(dataclasses.replace(honest, seq=3))
    newest = entry(honest)
    offline = dataclasses.replace(honest, seq=10**6, state="offline")
    forged = entry(offline, signer=ATTACKER)  # the honest peer's subkey, the attacker's signature
    restamped = dataclasses.replace(newest, expiration=newest.expiration + 30)  # signed for another expiration
    moved = record_messages.RecordEntry(records.block_key(MODEL, 5), newest.subkey, newest.value, newest.expiration)
    expired = entry(honest, expiration=time.time() - 2 * records.CLOCK_SKEW)
    found = Found()
    found.merge(record_messages.Records((older, forged, restamped, moved, expired)))  # a lying source
    found.merge(record_messages.Records((newest,)))  # an honest one
    assert found.refused == 4
    assert found.announcements == {records.block_key(MODEL, 0): {HONEST.peer_id: honest}}
    found.merge(record_messages.Records((older,)))  # an older record never replaces a newer one
    assert found.announcements[records.block_key(MODEL, 0)][HONEST.peer_id].seq == 7
