"""Which connection two nodes of a box are on, seen from outside the box through their transport daemons.

Every node (bootstrap, peer, client) runs a `p2pd` as a child process; its control socket is a file in
/tmp, which the process outside the box reaches whatever the namespaces. hivemind's `P2P.replicate` attaches
a second client to such a daemon: it can list the daemon's connections (each with the remote address it is
on: one ending in `/p2p-circuit` is relayed) and open streams from it by peer id, exactly as the node's own
`Node.open` does (the daemon finds the way). A probe protocol registered on every daemon answers a byte
with itself, so a stream's success means a round trip through that connection.

Invariants: only reads and probe streams; the nodes' own protocols and connections are left as they are;
a replica's shutdown closes this process's client, never the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

PROBE = "/swarm-box/probe/1.0.0"


def daemon_socket(pid: int) -> str | None:
    """The control socket (a multiaddr) of the transport daemon among the descendants of `pid`."""
    todo, seen = [pid], set()
    while todo:
        current = todo.pop()
        seen.add(current)
        try:
            if Path(f"/proc/{current}/comm").read_text().strip() == "p2pd":
                for arg in Path(f"/proc/{current}/cmdline").read_bytes().decode().split("\0"):
                    if arg.startswith("-listen="):
                        return arg[len("-listen="):]
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split() if int(c) not in seen]
        except OSError:
            continue
    return None


async def replicate(pid: int, name: str = ""):
    from swarm.net.dht_glue import hm

    p2p_class = hm().P2P  # first: hivemind without its package __init__ (torch), as the transport loads it
    from hivemind.utils.multiaddr import Multiaddr

    socket = daemon_socket(pid)
    if socket is None:
        raise RuntimeError(f"{name or pid}: no transport daemon among the processes of pid {pid}")
    return await p2p_class.replicate(Multiaddr(socket))


async def identify(pid: int) -> str:
    """The peer id of the daemon under `pid` (a client's, made up at its start)."""
    p2p = await replicate(pid)
    try:
        return str(p2p.peer_id)
    finally:
        await p2p.shutdown()


async def relays(pid: int) -> list[str]:
    """The relays the daemon under `pid` holds a slot on: those its current addresses go through (asked anew,
    not the addresses it had at its start)."""
    p2p = await replicate(pid)
    try:
        addrs = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
    finally:
        await p2p.shutdown()
    return sorted({a.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1] for a in addrs if "/p2p-circuit" in a})


class SlotWatch:
    """Notes in `proc.extra["relay slot"]` when a NAT'd peer's daemon first holds a slot on a relay (its own
    addresses, asked anew every half second); true once it does, or at once for a public peer."""

    def __init__(self, proc):
        self.proc, self.last = proc, 0.0

    def __call__(self) -> bool:
        if self.proc.host.public or "relay slot" in self.proc.extra:
            return True
        if time.monotonic() - self.last >= 0.5:
            self.last = time.monotonic()
            with contextlib.suppress(Exception):  # no daemon yet, or one restarting
                if asyncio.run(relays(self.proc.popen.pid)):
                    self.proc.extra["relay slot"] = time.monotonic() - self.proc.started
        return "relay slot" in self.proc.extra


def carrier(addrs: list[str]) -> str:
    """What connections with these remote addresses run on: tcp, quic, a relay (circuit), or none."""
    found = {"circuit" if "/p2p-circuit" in a else "quic" if "/quic" in a else "tcp" for a in addrs}
    return "+".join(sorted(found)) or "none"


@dataclass(eq=False)  # one object per node: hashable by identity
class End:
    """One node, as the links see it: `nat` when it sits behind a home router."""

    name: str
    peer_id: str
    nat: bool
    pid: int
    p2p: object = None


def kind(a: End, b: End, addrs: list[str]) -> str:
    """What carries a's connections to b: direct, hole-punched (both NAT'd, yet direct), relayed or failed."""
    if not addrs:
        return "failed"
    if any("/p2p-circuit" not in x for x in addrs):
        return "hole-punched" if a.nat and b.nat else "direct"
    return "relayed"


class Daemons:
    """Every end's daemon, replicated here (`async with`), each answering `PROBE`."""

    def __init__(self, ends: list[End]):
        self.ends = ends

    async def __aenter__(self) -> Daemons:
        async def echo(info, reader, writer):
            with contextlib.suppress(Exception):  # a probe that gave up is no error here
                writer.write(await reader.readexactly(1))
                await writer.drain()
            writer.close()

        try:
            for end in self.ends:
                end.p2p = await replicate(end.pid, end.name)
                if str(end.p2p.peer_id) != end.peer_id:
                    raise RuntimeError(f"{end.name}: its daemon is {end.p2p.peer_id}, expected {end.peer_id}")
                await end.p2p.add_binary_stream_handler(PROBE, echo)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        for end in self.ends:
            if end.p2p is not None:
                with contextlib.suppress(Exception):  # a daemon gone already
                    await end.p2p.remove_binary_stream_handler(PROBE)
                with contextlib.suppress(Exception):
                    await end.p2p.shutdown()
                end.p2p = None

    async def probe(self, a: End, b: End, timeout: float) -> tuple[float | None, str]:
        """(ms to open a stream from a to b and get a byte echoed, or None if it failed; the error)."""
        from swarm.net.dht_glue import hm

        async def echo():
            _, reader, writer = await a.p2p.call_binary_stream_handler(hm().PeerID.from_base58(b.peer_id), PROBE)
            writer.write(b"x")
            await writer.drain()
            await reader.readexactly(1)
            writer.close()

        started = time.perf_counter()
        try:
            await asyncio.wait_for(echo(), timeout)
        except Exception as e:  # boundary: a failed pair is a result
            return None, f"{type(e).__name__}: {e}"[:200]
        return (time.perf_counter() - started) * 1e3, ""

    async def addrs(self, a: End, b: End) -> list[str]:
        """The remote addresses of a's connections to b."""
        with contextlib.suppress(Exception):
            return [str(x) for info in await a.p2p.list_peers() if str(info.peer_id) == b.peer_id for x in info.addrs]
        return []

    async def link(self, a: End, b: End) -> str:
        return kind(a, b, await self.addrs(a, b))


__all__ = ["End", "Daemons", "PROBE", "SlotWatch", "carrier", "daemon_socket", "identify", "kind", "relays",
           "replicate"]
