"""Peers that stalled a client of this machine, remembered across its client processes. Sync, small.

A peer that misses a step's deadline before it ever completed a step for this client (a fresh identity that
accepts work and never answers, or one that claims a speed it does not have) is avoided for `STALL_S`
(`SwarmClient.ban`), and written here, so that the machine's next clients (a new `swarm generate`, a
restarted gateway) do not pay its deadline again: identities cost nothing, but each costs a client at most one
deadline per `STALL_S`, and a machine's later clients none. Only this machine's own clients write the file,
from their own deadlines: no peer's word enters it. Entries expire; the file holds at most `KEEP` of them.
Writes are atomic (a temporary file renamed) and merge what the file held when read; two processes writing at
the same moment may lose one entry, which costs one more deadline.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from swarm.files import write_json

logger = logging.getLogger(__name__)

STALL_S = 600.0  # a peer that stalled before it ever answered a step is avoided this long, here and by the machine
KEEP = 4096  # entries at most; the soonest to expire go first
NAME = "stalled-peers.json"


class StallMemory:
    """The stalled peers of `path` (a JSON object: peer id -> until, in seconds since the epoch)."""

    def __init__(self, path: Path, clock=time.time):
        self.path, self.clock = Path(path), clock

    @classmethod
    def of(cls, config) -> StallMemory | None:
        """The machine's memory (in its cache home) for a client of `config`; None with `--no-remember-stalls`."""
        from swarm.cli import cache_home

        return cls(Path(cache_home()) / NAME) if config.remember_stalls else None

    def load(self) -> dict[str, float]:
        """Peers still to avoid -> seconds left."""
        now = self.clock()
        return {peer: until - now for peer, until in self._read().items() if until > now}

    def remember(self, peer: str, seconds: float = STALL_S) -> None:
        entries = self._read()
        entries[peer] = max(entries.get(peer, 0.0), self.clock() + seconds)
        now = self.clock()
        kept = sorted(((p, u) for p, u in entries.items() if u > now), key=lambda e: -e[1])[:KEEP]
        try:
            write_json(self.path, dict(kept))
        except OSError as e:
            logger.debug("could not remember stalled peers in %s: %s", self.path, e)

    def _read(self) -> dict[str, float]:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(entries, dict):
            return {}
        return {p: float(u) for p, u in entries.items()
                if isinstance(p, str) and len(p) <= 128 and isinstance(u, (int, float))}
