"""A DHT dictionary value (a node's reply to a read, or a value replicated to a node) is validated entry
by entry: a refused record is dropped alone, the other peers' records of the same value are kept."""

from __future__ import annotations

import time
import types

import pytest

from swarm import __version__

from swarm.net import records, transport
from swarm.net.identity import Identity
from swarm.net.transport import key_id

pytestmark = pytest.mark.unit

KEY = records.block_key("entries-test", 0)
HONEST = [Identity.generate() for _ in range(2)]
ATTACKER, FORGER, SKEWED = Identity.generate(), Identity.generate(), Identity.generate()


def sealed(identity: Identity, seq: int, expiration: float, signer: Identity | None = None) -> bytes:
    ann = records.Announcement(identity.peer_id, "entries-test", 0, 2, "online", 10.0, 100.0, 1024, __version__,
                               seq, time.time())
    payload = ann.to_payload()
    message = records.signed_message(key_id(KEY), identity.peer_id, expiration, payload)
    return bytes([records.ENVELOPE_VERSION]) + (signer or identity).sign(message) + payload


def protocol():
    """The parts of hivemind's DHT protocol that `_validate_entries` uses, with our validator."""
    hm = transport._hm()
    counters = {"accepted": 0, "rejected": 0}
    return types.SimpleNamespace(record_validator=transport._make_validator(counters), serializer=hm.MSGPackSerializer,
                                 counters=counters)


def dictionary(entries: dict[str, tuple[bytes, float]]):
    transport._hm()
    from hivemind.dht.storage import DictionaryDHTValue  # loaded by _hm() without hivemind's package __init__

    value = DictionaryDHTValue()
    for subkey, (envelope, expiration) in entries.items():
        value.store(subkey, transport._hm().MSGPackSerializer.dumps(envelope), expiration)
    return value


def record(subkey: str, envelope: bytes, expiration: float):
    hm = transport._hm()
    return hm.DHTRecord(key_id(KEY), hm.MSGPackSerializer.dumps(subkey), hm.MSGPackSerializer.dumps(envelope),
                        expiration)


def test_each_refused_entry_is_dropped_alone():
    proto, exp = protocol(), time.time() + 60
    newer = sealed(ATTACKER, 2, exp - 10)
    assert proto.record_validator.validate(record(ATTACKER.peer_id, newer, exp - 10))  # the reader saw it
    far = time.time() + records.MAX_TTL + 100
    value = dictionary({
        **{who.peer_id: (sealed(who, 1, exp), exp) for who in HONEST},
        ATTACKER.peer_id: (sealed(ATTACKER, 1, exp), exp),  # older than the one seen
        FORGER.peer_id: (sealed(FORGER, 1, exp, signer=ATTACKER), exp),  # not signed by its subkey
        SKEWED.peer_id: (sealed(SKEWED, 1, far), far),  # beyond the maximum TTL on this reader's clock
    })
    assert transport._validate_entries(proto, key_id(KEY), value) is True
    assert {subkey for subkey, _ in value.items()} == {who.peer_id for who in HONEST}
    assert proto.counters["rejected"] == 3


def test_a_value_whose_every_entry_is_refused_is_refused():
    proto, exp = protocol(), time.time() + 60
    assert proto.record_validator.validate(record(ATTACKER.peer_id, sealed(ATTACKER, 2, exp), exp))
    value = dictionary({ATTACKER.peer_id: (sealed(ATTACKER, 1, exp), exp)})
    assert transport._validate_entries(proto, key_id(KEY), value) is False
    assert not value
    assert transport._validate_entries(proto, key_id(KEY), dictionary({})) is True


def test_the_newer_record_is_kept_and_an_older_one_of_the_same_peer_refused():
    proto, exp = protocol(), time.time() + 60
    honest = sealed(HONEST[0], 1, exp)
    first = dictionary({ATTACKER.peer_id: (sealed(ATTACKER, 2, exp), exp), HONEST[0].peer_id: (honest, exp)})
    assert transport._validate_entries(proto, key_id(KEY), first) and len(first) == 2
    second = dictionary({ATTACKER.peer_id: (sealed(ATTACKER, 1, exp + 5), exp + 5), HONEST[0].peer_id: (honest, exp)})
    assert transport._validate_entries(proto, key_id(KEY), second)
    assert {subkey for subkey, _ in second.items()} == {HONEST[0].peer_id}
