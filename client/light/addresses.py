"""Where the light client dials each peer: addresses heard from record sources, kept on trial. Sync, pure.

A record source's reply says where the signers of its records are; the source may lie (an address of nothing, or
of a black hole), and a connection authenticates the peer id, so a wrong address can only fail. So no address
is kept for good on a source's word: an address that fails to connect is dropped (and not taken again from a
source for `BAD_S`), one that connects goes first, and a peer has at most `PER_PEER` addresses on trial at a time,
so later replies can bring the right one in. The addresses the user gave (initial peers) are never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

PER_PEER = 4  # addresses kept per peer (those that connected, then those on trial)
BAD_S = 60.0  # an address that failed is not taken from a source again this long (a peer down a while is heard again)
MAX_BAD = 4096  # failed addresses remembered at most (the oldest are forgotten first)


class AddressBook:
    def __init__(self, given: Iterable[tuple[str, str]] = (), clock=time.monotonic):
        """`given`: (address, peer) pairs the user gave, kept whatever happens."""
        self.clock = clock
        self.addrs: dict[str, list[str]] = {}
        self.given: set[tuple[str, str]] = set()
        self.bad: dict[tuple[str, str], float] = {}  # (peer, address) -> when it failed
        for addr, peer in given:
            self.addrs.setdefault(peer, []).append(addr)
            self.given.add((peer, addr))

    def get(self, peer: str) -> list[str]:
        """The addresses to try for `peer`, in order."""
        return list(self.addrs.get(peer, ()))

    def heard(self, peer: str, addrs: Iterable[str]) -> None:
        """A source says `peer` is at `addrs`: new ones go on trial while there is room."""
        known = self.addrs.setdefault(peer, [])
        now = self.clock()
        for addr in addrs:
            if len(known) >= PER_PEER:
                break
            failed = self.bad.get((peer, addr))
            if addr not in known and (failed is None or now - failed >= BAD_S):
                known.append(addr)

    def connected(self, peer: str, addr: str) -> None:
        known = self.addrs.setdefault(peer, [])
        if addr in known:
            known.remove(addr)
        known.insert(0, addr)
        self.bad.pop((peer, addr), None)

    def failed(self, peer: str, addr: str) -> None:
        """`addr` did not connect to `peer`: dropped (unless the user gave it) and not taken again for a while."""
        if (peer, addr) in self.given:
            return
        known = self.addrs.get(peer, [])
        if addr in known:
            known.remove(addr)
        self.bad[(peer, addr)] = self.clock()
        if len(self.bad) > MAX_BAD:
            for key, _ in sorted(self.bad.items(), key=lambda e: e[1])[:len(self.bad) - MAX_BAD]:
                del self.bad[key]
