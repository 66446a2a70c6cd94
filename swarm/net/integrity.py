"""What binds a chained step together: input digests and push tags. Pure, no network.

- `input_digest(position, hidden, mask)`: what a peer computed on, as it received it (the position, the
  hidden states' encoding, shape and bytes, the attention mask). A peer puts it in every step's output;
  the client compares it with the digest of what it sent, or of the previous hop's output it received
  (a chained step), so a hop whose input was altered on the way is caught (`ChainMismatch`).
- Push tags: at open, a peer gives the client a secret push key for the session (`new_push_key`). For a
  chained step the client tags each later hop with `push_tag(key, session, step, sender)`, where sender
  is the peer id of the hop that will push into it. A peer takes a push only if the tag matches the
  pushing stream's authenticated peer id, so no peer but the route's previous hop can push into a
  session, and that one only for the step the client named. The tags travel through the route, but a
  tag is worth nothing to any peer except the one it names as sender.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from swarm.net.hidden import Hidden
from swarm.net.wire import Blob

DIGEST_CHARS = 32  # hex characters of an input digest (128 bits)
TAG_CHARS = 32  # hex characters of a push tag (128 bits)
KEY_CHARS = 32  # hex characters of a push key (128 bits)


def input_digest(position: int, hidden: Hidden, mask: Blob | None) -> str:
    h = hashlib.blake2b(digest_size=DIGEST_CHARS // 2)
    h.update(struct.pack(">q", position))
    h.update(hidden.encoding.encode())
    for blob in hidden.blobs + ((mask,) if mask is not None else ()):
        h.update(f"|{blob.dtype}{list(blob.shape)}|".encode())
        h.update(blob.data)
    return h.hexdigest()


def new_push_key() -> str:
    return secrets.token_hex(KEY_CHARS // 2)


def push_tag(key: str, session: str, step: int, sender: str) -> str:
    message = f"{session}|{step}|{sender}".encode()
    return hmac.new(bytes.fromhex(key), message, hashlib.sha256).hexdigest()[:TAG_CHARS]


def tag_ok(key: str, session: str, step: int, sender: str, tag: str) -> bool:
    return hmac.compare_digest(push_tag(key, session, step, sender), tag)
