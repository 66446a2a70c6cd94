"""The peers a node has met, kept in a small file next to its identity: another way in when the bootstrap is gone.

The file (JSON, `{"peers": {peer id: {"addrs": [...], "seen": unix time}}}`) holds at most `MAX_PEERS`
peers, the most recently seen first, and only addresses others can dial: direct ones that are not
loopback (a swarm on one machine needs no memory of it). It is written whole, atomically; a file that
cannot be read is ignored with a warning and replaced on the next write. `join_addrs` gives the full
multiaddrs to join through, for peers not already among the initial ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from swarm.net.identity import public_key_of
from swarm.net.reach import dialable, is_global_addr

logger = logging.getLogger(__name__)

MAX_PEERS = 16
MAX_ADDRS = 4  # per peer
FILE_NAME = "known-peers.json"


def path_for(identity_path: Path | None, home: Path) -> Path:
    """`<identity>.known-peers.json` beside a key file, else `known-peers.json` in the cache home."""
    if identity_path is not None:
        return Path(identity_path).with_name(Path(identity_path).name + "." + FILE_NAME)
    return Path(home) / FILE_NAME


def _is_peer_id(text: object) -> bool:
    """A peer id of ours (what a multiaddr's /p2p/ part must hold, or the daemon refuses to start)."""
    try:
        public_key_of(text)
    except ValueError:
        return False
    return True


class KnownPeers:
    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
            peers = data["peers"]
            return {str(p): {"addrs": [a for a in v["addrs"] if isinstance(a, str) and dialable(a)][:MAX_ADDRS],
                             "seen": float(v["seen"])}
                    for p, v in peers.items() if isinstance(v, dict) and _is_peer_id(p)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring the known peers file %s: %s", self.path, e)
            return {}

    def remember(self, addrs_by_peer: dict[str, list[str]], now: float | None = None) -> int:
        """Merge newly seen peers' dialable addresses; returns how many peers the file holds."""
        now = time.time() if now is None else now
        peers = self.load()
        for peer, addrs in addrs_by_peer.items():
            if not _is_peer_id(peer):
                continue
            good = [a.split("/p2p/")[0] for a in addrs if isinstance(a, str) and "p2p-circuit" not in a]
            good = sorted(dict.fromkeys(a for a in good if dialable(a)), key=lambda a: not is_global_addr(a))
            if good:
                peers[peer] = {"addrs": good[:MAX_ADDRS], "seen": now}
        kept = dict(sorted(peers.items(), key=lambda kv: -kv[1]["seen"])[:MAX_PEERS])
        self._write({"peers": kept})
        return len(kept)

    def join_addrs(self, exclude: set[str] = frozenset()) -> list[str]:
        """Full multiaddrs of the peers met (every address of each), most recent first, skipping `exclude`."""
        return [f"{addr}/p2p/{peer}" for peer, v in sorted(self.load().items(), key=lambda kv: -kv[1]["seen"])
                if peer not in exclude for addr in v["addrs"]]

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".known-peers-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("cannot write the known peers file %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)


__all__ = ["KnownPeers", "path_for", "dialable", "MAX_PEERS"]
