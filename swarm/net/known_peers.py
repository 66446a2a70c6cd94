"""The peers a node has met, kept in a small file next to its identity: another way in when the bootstrap is gone.

The file (JSON, `{"peers": {peer id: {"addrs": [...], "seen": unix time, "since": unix time}}}`) holds at most
`MAX_PEERS` peers and only addresses others can dial: direct ones that are not loopback (a swarm on one machine
needs no memory of it). Identities cost nothing, so a crowd of fresh ones that connect to this node must not
fill the file and eclipse it at the next start: peers are kept by how long this node has known them (`since`),
the longest first, a newcomer enters only where there is room (a peer not seen for `STALE_S` leaves room), and
at most `NEW_PER_ROUND` newcomers enter per round. It is written whole, atomically; a file that
cannot be read is ignored with a warning and replaced on the next write. `join_addrs` gives the full
multiaddrs to join through, for peers not already among the initial ones.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from swarm.files import write_json
from swarm.net.identity import public_key_of
from swarm.net.reach import dialable, is_global_addr

logger = logging.getLogger(__name__)

MAX_PEERS = 16
MAX_ADDRS = 4  # per peer
STALE_S = 7 * 86400.0  # a peer not seen this long leaves its place to newcomers
NEW_PER_ROUND = 2  # newcomers taken into the file per `remember` at most
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
                             "seen": float(v["seen"]), "since": float(v.get("since", v["seen"]))}
                    for p, v in peers.items() if isinstance(v, dict) and _is_peer_id(p)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring the known peers file %s: %s", self.path, e)
            return {}

    def remember(self, addrs_by_peer: dict[str, list[str]], now: float | None = None) -> int:
        """Merge seen peers' dialable addresses (newcomers as the module docstring says); returns how many peers
        the file holds."""
        now = time.time() if now is None else now
        peers = {p: v for p, v in self.load().items() if now - v["seen"] < STALE_S}
        newcomers = 0
        for peer, addrs in addrs_by_peer.items():
            if not _is_peer_id(peer):
                continue
            good = [a.split("/p2p/")[0] for a in addrs if isinstance(a, str) and "p2p-circuit" not in a]
            good = sorted(dict.fromkeys(a for a in good if dialable(a)), key=lambda a: not is_global_addr(a))
            if not good:
                continue
            if peer in peers:
                peers[peer].update(addrs=good[:MAX_ADDRS], seen=now)
            elif len(peers) < MAX_PEERS and newcomers < NEW_PER_ROUND:
                peers[peer] = {"addrs": good[:MAX_ADDRS], "seen": now, "since": now}
                newcomers += 1
        self._write({"peers": peers})
        return len(peers)

    def join_addrs(self, exclude: set[str] = frozenset()) -> list[str]:
        """Full multiaddrs of the peers met (every address of each), the longest known first, skipping
        `exclude`."""
        return [f"{addr}/p2p/{peer}" for peer, v in sorted(self.load().items(), key=lambda kv: kv[1]["since"])
                if peer not in exclude for addr in v["addrs"]]

    def _write(self, data: dict) -> None:
        try:
            write_json(self.path, data, indent=1)
        except OSError as e:
            logger.warning("cannot write the known peers file %s: %s", self.path, e)


__all__ = ["KnownPeers", "path_for", "dialable", "MAX_PEERS"]
