"""Identities: base58, peer ids that carry their public key, signatures, and the libp2p key file."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given, settings, strategies as st

from swarm.net.identity import (Identity, IdentityError, b58decode, b58encode, load_or_create, peer_id_of,
                            public_key_of, verify)

pytestmark = pytest.mark.unit

ALICE = Identity.generate()
BOB = Identity.generate()


# ---- base58 ----

def test_b58_known_vectors():
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"
    assert b58encode(b"\0\0\x01") == "112"
    assert b58encode(b"") == "" and b58decode("") == b""
    assert b58decode("StV1DL6CwTryKyV") == b"hello world"


@settings(max_examples=200, deadline=None)
@given(zeros=st.integers(0, 4), body=st.binary(max_size=48))
def test_b58_round_trip_keeps_leading_zeros(zeros, body):
    data = b"\0" * zeros + body
    text = b58encode(data)
    assert b58decode(text) == data
    leading = len(data) - len(data.lstrip(b"\0"))
    assert len(text) - len(text.lstrip("1")) == leading


@pytest.mark.parametrize("text", ["0", "O", "I", "l", "abc+", "12D3 Koo"])
def test_b58_rejects_characters_outside_the_alphabet(text):
    with pytest.raises(ValueError, match="not base58"):
        b58decode(text)


# ---- peer ids ----

def test_peer_id_is_an_ed25519_identity_multihash():
    assert ALICE.peer_id.startswith("12D3KooW") and len(ALICE.peer_id) == 52
    assert public_key_of(ALICE.peer_id) == ALICE.public_key
    assert len(ALICE.public_key) == 32
    assert peer_id_of(ALICE.public_key) == ALICE.peer_id
    assert ALICE.peer_id != BOB.peer_id


@pytest.mark.parametrize("peer_id", [
    "", "12D3KooW", "x" * 52, "0" * 52,
    "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # a sha2-256 multihash (RSA-style id), not an identity one
    ALICE.peer_id + "1", ALICE.peer_id[:-1], None, 123, b"12D3KooW",
])
def test_public_key_of_rejects_what_is_not_an_ed25519_peer_id(peer_id):
    with pytest.raises(ValueError):
        public_key_of(peer_id)


# ---- signatures ----

def test_sign_and_verify():
    sig = ALICE.sign(b"message")
    assert len(sig) == 64
    assert verify(ALICE.peer_id, sig, b"message") is True
    assert verify(ALICE.peer_id, sig, b"messagE") is False
    assert verify(BOB.peer_id, sig, b"message") is False
    assert verify(ALICE.peer_id, sig[:63], b"message") is False
    assert verify(ALICE.peer_id, bytes(64), b"message") is False
    assert verify(ALICE.peer_id, bytes([sig[0] ^ 1]) + sig[1:], b"message") is False


@pytest.mark.parametrize("peer_id", ["", "garbage", "0" * 52, "1" * 52, ALICE.peer_id[:-2] + "zz", None, 42])
def test_verify_with_garbage_peer_ids_is_false_not_an_error(peer_id):
    assert verify(peer_id, ALICE.sign(b"m"), b"m") is False


# ---- the libp2p key file format ----

def test_libp2p_bytes_round_trip():
    raw = ALICE.to_libp2p_bytes()
    assert raw[:4] == bytes([0x08, 0x01, 0x12, 0x40]) and len(raw) == 68
    assert raw[36:] == ALICE.public_key
    back = Identity.from_libp2p_bytes(raw)
    assert back.peer_id == ALICE.peer_id
    assert verify(ALICE.peer_id, back.sign(b"m"), b"m")


def _corruptions():
    raw = ALICE.to_libp2p_bytes()
    return {
        "rsa key type": bytes([0x08, 0x00]) + raw[2:],
        "wrong length field": raw[:3] + bytes([0x20]) + raw[4:],
        "truncated": raw[:-1],
        "extended": raw + b"\0",
        "empty": b"",
        "public half of another key": raw[:36] + BOB.public_key,
        "public half flipped": raw[:-1] + bytes([raw[-1] ^ 1]),
    }


@pytest.mark.parametrize("name", list(_corruptions()))
def test_from_libp2p_bytes_rejects_corrupted_keys(name):
    with pytest.raises(ValueError):
        Identity.from_libp2p_bytes(_corruptions()[name])


# ---- key files ----

def test_load_or_create_writes_an_owner_only_file_once(tmp_path):
    path = tmp_path / "keys" / "peer.key"
    first = load_or_create(path)
    assert path.is_file()
    assert os.stat(path).st_mode & 0o777 == 0o600
    content = path.read_bytes()
    assert Identity.from_libp2p_bytes(content).peer_id == first.peer_id
    second = load_or_create(path)
    assert second.peer_id == first.peer_id
    assert path.read_bytes() == content
    assert sorted(p.name for p in path.parent.iterdir()) == ["peer.key"]  # no temporary file left behind


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "peer.key"
    ALICE.save(path)
    with pytest.raises(FileExistsError):
        BOB.save(path)
    assert load_or_create(path).peer_id == ALICE.peer_id


def test_unusable_key_file_names_its_path(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"garbage")
    with pytest.raises(IdentityError, match="move it away") as info:
        load_or_create(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == b"garbage"  # never replaced behind the user's back


def test_key_path_that_is_a_directory_is_an_identity_error(tmp_path):
    with pytest.raises(IdentityError, match=re.escape(str(tmp_path))):
        load_or_create(tmp_path)
