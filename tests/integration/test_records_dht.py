"""Forged announcements stored through the real DHT are refused by every node and never displace the
honest record: fixed cases of every rule, and hypothesis-generated forgeries."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from swarm.net import discovery, records
from swarm.net.identity import Identity, load_or_create
from swarm.net.transport import key_id
from swarm_harness import MODEL_ID

pytestmark = pytest.mark.integration
BLOCK = 0
KEY = records.block_key(MODEL_ID, BLOCK)


@pytest.fixture(scope="module")
def honest(swarm):
    """The identity of the peer serving block 0 (its key file was made by the harness)."""
    return load_or_create(swarm.root / "peer0.key")


def current(client, loop, peer: str) -> records.Announcement:
    found = loop.run(client.get_records([KEY]))[KEY]
    assert peer in found, f"the honest record of {peer} is missing: {list(found)}"
    value, _ = found[peer]
    return records.Announcement.from_payload(records.open_envelope(value)[1])


def store(client, loop, subkey: str, value: bytes, expiration: float) -> bool:
    return loop.run(client.put_records([(KEY, subkey, value, expiration)]))[(KEY, subkey)]


def forge_cases(honest: Identity, base: records.Announcement) -> dict[str, tuple[str, bytes, float]]:
    """name -> (subkey, value, expiration): every way a record can be wrong."""
    attacker = Identity.generate()
    now = time.time()
    exp = now + 8
    kid = key_id(KEY)
    newer = dataclasses.replace(base, seq=base.seq + 10**6, issued_at=now, state="offline")
    payload = newer.to_payload()

    def raw(identity: Identity, subkey: str, payload: bytes, expiration: float) -> bytes:
        sig = identity.sign(records.signed_message(kid, subkey, expiration, payload))
        return bytes([records.ENVELOPE_VERSION]) + sig + payload

    attacker_ann = dataclasses.replace(newer, peer=attacker.peer_id)
    far = now + 100 * records.MAX_TTL
    return {
        "unsigned": (honest.peer_id, bytes([records.ENVELOPE_VERSION]) + os.urandom(64) + payload, exp),
        "signed by another key": (honest.peer_id, raw(attacker, honest.peer_id, payload, exp), exp),
        "subkey is not the signer": (honest.peer_id, records.seal(attacker, attacker_ann, kid, exp), exp),
        "attacker's offline with far-future expiration": (honest.peer_id, raw(attacker, honest.peer_id, payload, far),
                                                          far),
        "older sequence number": (honest.peer_id, records.seal(
            honest, dataclasses.replace(base, seq=base.seq - 1, issued_at=now, state="offline"), kid, exp + 30), exp + 30),
        "expiration beyond the maximum TTL": (honest.peer_id, records.seal(honest, newer, kid, far), far),
        "schema: unknown state": (honest.peer_id, records.seal(honest, dataclasses.replace(newer, state="hijacked"),
                                                               kid, exp), exp),
        "schema: empty span": (honest.peer_id, records.seal(honest, dataclasses.replace(newer, end=newer.start),
                                                            kid, exp), exp),
        "oversize value": (honest.peer_id, raw(honest, honest.peer_id, dataclasses.replace(
            newer, extra={"pad": "x" * 4000}).to_payload(), exp), exp),
        "re-stamped expiration": (honest.peer_id, records.seal(honest, newer, kid, exp), exp + 20),
        "moved from another block": (honest.peer_id, records.seal(honest, newer, key_id(records.block_key(MODEL_ID, 1)),
                                                                  exp), exp),
    }


def test_every_forged_record_is_refused_and_the_honest_one_stays(swarm, client, loop, honest):
    before = current(client, loop, honest.peer_id)
    assert before.state == "online"
    for name, (subkey, value, expiration) in forge_cases(honest, before).items():
        assert store(client, loop, subkey, value, expiration) is False, f"'{name}' was stored"
        after = current(client, loop, honest.peer_id)
        assert after.state == "online" and after.seq >= before.seq, f"'{name}' displaced the honest record"
        assert after.peer == honest.peer_id and after.span == before.span


def test_the_honest_peer_keeps_announcing_after_the_attack(swarm, client, loop, honest):
    first = current(client, loop, honest.peer_id)
    deadline = time.monotonic() + 20
    while current(client, loop, honest.peer_id).seq == first.seq:  # re-announced every 2 s
        assert time.monotonic() < deadline, "the honest peer stopped re-announcing"
        time.sleep(0.2)
    assert current(client, loop, honest.peer_id).state == "online"


def test_every_peer_is_listed_in_its_own_directory_bucket_only(swarm, client, loop, honest):
    listed = loop.run(discovery.directory(client))
    assert {a.peer for a in listed} == {swarm.procs[f"peer{i}"].peer_id for i in range(3)}
    own = records.directory_key(honest.peer_id)
    ann = next(a for a in listed if a.peer == honest.peer_id)
    newer = dataclasses.replace(ann, seq=ann.seq + 10**6, issued_at=time.time(), state="offline")
    exp = time.time() + 8
    other = next(k for k in records.DIRECTORY_KEYS if k != own)
    padded = dataclasses.replace(newer, extra={"pad": "x" * 100})
    for key, forged in ((other, newer), (own, padded)):
        value = records.seal(honest, forged, key_id(key), exp)
        assert loop.run(client.put_records([(key, honest.peer_id, value, exp)]))[(key, honest.peer_id)] is False
    after = next(a for a in loop.run(discovery.directory(client)) if a.peer == honest.peer_id)
    assert after.state == "online" and after.num_blocks == ann.num_blocks


forgeries = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 400), st.just(0)),
    st.tuples(st.just("restamp"), st.integers(-5, 400), st.just(0)),
    st.tuples(st.just("attacker"), st.sampled_from(["joining", "online", "offline"]), st.integers(-10**6, 10**6)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forgery=forgeries)
def test_generated_forgeries_are_refused(swarm, client, loop, honest, forgery):
    found = loop.run(client.get_records([KEY]))[KEY]
    value, expiration = found[honest.peer_id]
    kind, a, b = forgery
    if kind == "flip":
        i = a % len(value)
        forged, exp = value[:i] + bytes([value[i] ^ b]) + value[i + 1:], expiration
    elif kind == "truncate":
        forged, exp = value[:a % len(value)], expiration
    elif kind == "restamp":
        forged, exp = value, expiration + a + 0.5
    else:
        attacker = Identity.generate()
        ann = records.Announcement.from_payload(records.open_envelope(value)[1])
        fake = dataclasses.replace(ann, peer=attacker.peer_id, state=a, seq=max(0, ann.seq + b))
        exp = time.time() + 8
        forged = records.seal(attacker, fake, key_id(KEY), exp)
    assert store(client, loop, honest.peer_id, forged, exp) is False
    after = current(client, loop, honest.peer_id)
    assert after.state == "online" and after.peer == honest.peer_id
