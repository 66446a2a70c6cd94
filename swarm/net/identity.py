"""Ed25519 identities of peers and bootstrap nodes, and the libp2p peer ids they imply.

Invariants:
- The key file is libp2p's own private-key encoding (protobuf: key type Ed25519, 64 bytes of seed +
  public key), so the transport daemon takes it as its identity unchanged: the libp2p peer id that
  authenticates every stream IS the id derived here, and the public key can be read back out of it.
- A peer id is the base58 identity multihash of the encoded public key ("12D3KooW..."); verifying a
  signature needs nothing but the peer id, so records do not carry keys.
- Key files are written once, atomically, readable by the owner only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.errors import SwarmError

PeerId = NewType("PeerId", str)

_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_ED25519 = 1  # libp2p KeyType enum value
# protobuf field headers: 0x08 = field 1 varint (key type), 0x12 = field 2 bytes (key data)
_PUBLIC_PREFIX = bytes([0x08, _ED25519, 0x12, 32])
_PRIVATE_PREFIX = bytes([0x08, _ED25519, 0x12, 64])
_IDENTITY_MULTIHASH = bytes([0x00, len(_PUBLIC_PREFIX) + 32])


class IdentityError(SwarmError):
    code = "bad_identity"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        i = _ALPHABET.find(ch)
        if i < 0:
            raise ValueError(f"not base58: {ch!r}")
        n = n * 58 + i
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_of(public_key: bytes) -> PeerId:
    return PeerId(b58encode(_IDENTITY_MULTIHASH + _PUBLIC_PREFIX + public_key))


def public_key_of(peer_id: str) -> bytes:
    """The Ed25519 public key inside a peer id; ValueError if the id is not an Ed25519 identity id."""
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 64:
        raise ValueError("peer id has the wrong length")
    raw = b58decode(peer_id)
    head = _IDENTITY_MULTIHASH + _PUBLIC_PREFIX
    if len(raw) != len(head) + 32 or not raw.startswith(head):
        raise ValueError("peer id is not an Ed25519 identity multihash")
    return raw[len(head):]


def verify(peer_id: str, signature: bytes, message: bytes) -> bool:
    """Whether `signature` over `message` was made by the key behind `peer_id`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key_of(peer_id)).verify(signature, message)
        return True
    except (ValueError, InvalidSignature):
        return False



def describe_peer(peer: str) -> str:
    """Short form of a peer id for logs: the last 8 characters."""
    return f"…{peer[-8:]}"


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def peer_id(self) -> PeerId:
        return peer_id_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_libp2p_bytes(self) -> bytes:
        seed = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
        return _PRIVATE_PREFIX + seed + self.public_key

    @classmethod
    def from_libp2p_bytes(cls, data: bytes) -> Identity:
        if len(data) != len(_PRIVATE_PREFIX) + 64 or not data.startswith(_PRIVATE_PREFIX):
            raise ValueError("not a libp2p Ed25519 private key")
        key = Ed25519PrivateKey.from_private_bytes(data[len(_PRIVATE_PREFIX):len(_PRIVATE_PREFIX) + 32])
        ident = cls(key)
        if ident.public_key != data[len(_PRIVATE_PREFIX) + 32:]:
            raise ValueError("public half does not match the private key")
        return ident

    def save(self, path: str | Path) -> None:
        """Write the key file atomically with owner-only permissions; never overwrite one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.to_libp2p_bytes())
        try:
            os.link(tmp, path)  # fails if another process created the file first: theirs wins
        finally:
            os.unlink(tmp)


def load_or_create(path: str | Path) -> Identity:
    """The identity stored at `path`, created there on first use."""
    path = Path(path)
    if not path.exists():
        try:
            Identity.generate().save(path)
        except FileExistsError:
            pass  # created concurrently: load the winner below
    try:
        return Identity.from_libp2p_bytes(path.read_bytes())
    except (OSError, ValueError) as e:
        raise IdentityError(f"identity file {path} is unusable ({e}); move it away to create a new identity") from e
