"""How a node is reached: a dial-back check, the transport daemon's relay settings, and the reach protocol.

A node behind a home router cannot be dialled; it learns so by asking nodes it is connected to to dial it
back (`/swarm/reach/1.0.0`, `dial`): the helper opens a plain TCP connection to the port the asker names,
at the address the asker's connection comes from (never another address: a helper cannot be made to
connect anywhere else), within `DIAL_TIMEOUT_S`, and says whether it got through and where it sees the
asker. One helper getting through makes the node public; every helper answering and none getting through
makes it private; no answer leaves it unknown (the first node of a swarm has nobody to ask).

A private node reserves slots on relays (circuit relay v2 of the daemon, `-autoRelay` with static relays:
the public nodes it knows) and is announced under its relayed addresses. A public node relays for others
within limits (`RelayLimits`), so that strangers' circuits never exhaust it. The daemon punches holes
(DCUtR) when AutoNAT is on; a relayed connection is upgraded to a direct one where the routers allow.

The same protocol's `addrs` request returns a node's own dialable addresses (how a node learns where the
peers it met can be found again, `swarm.net.known_peers`) and whether it relays with its own limits
(`swarm.net.relays`); `peers` returns the public peers it met, with two addresses each: relay candidates.

Messages are one JSON object each way, 4-byte big-endian length first, 4 KiB at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import struct
import time
from dataclasses import dataclass

from swarm.errors import ConfigError

logger = logging.getLogger(__name__)

REACH_PROTOCOL = "/swarm/reach/1.0.0"
MAX_MESSAGE = 4096
DIAL_TIMEOUT_S = 3.0  # a helper's TCP connect to the asker
ASK_TIMEOUT_S = DIAL_TIMEOUT_S + 3.0  # the asker's wait for a helper's answer
MAX_HELPERS = 3  # helpers asked at once
HELPER_INTERVAL_S = 2.0  # a helper dials the same asker at most this often
MAX_DIALS = 8  # dial-backs a helper runs at once
MAX_PEERS_ANSWERED = 12  # peers met, in one `peers` answer (within MAX_MESSAGE)
PUBLIC, PRIVATE, UNKNOWN, LOCAL = "public", "private", "unknown", "local"


@dataclass(frozen=True)
class RelayLimits:
    """What a public node gives strangers as a relay (the daemon's circuit relay v2 resources).

    `circuits`: relayed connections open at once to one reserved peer; `reservations`: peers holding a slot;
    `hours` and `gib`: the life and the bytes (each way) of one relayed connection before the relay ends it
    (a session it carried then fails over, like any lost peer); `buffer_kib`: per relayed connection.

    Measured with hivemind 1.1.12's daemon: it also starts a relay service of its own, with its built-in
    limits, on the same protocol, and whichever registers last serves. The counts here are the built-in
    ones, so either way they hold; the life and bytes are ours only when ours registers last (a relayed
    connection carried 4 MB and lived 150 s in the box either way)."""

    circuits: int = 16
    reservations: int = 128
    hours: float = 6.0
    gib: float = 4.0
    buffer_kib: int = 1024

    def daemon_flags(self) -> dict[str, object]:
        return {"relayService": 1, "relayMaxCircuits": self.circuits, "relayMaxReservations": self.reservations,
                "relayTimeLimit": f"{int(self.hours * 3600)}s", "relayDataLimit": int(self.gib * 2**30),
                "relayBufferSize": self.buffer_kib * 1024}


def daemon_settings(reach: str, *, relays: list[str], limits: RelayLimits | None) -> tuple[dict, dict]:
    """(`P2P.create` keyword arguments, extra daemon flags) for a node of this reachability."""
    kwargs: dict[str, object] = {"auto_nat": True, "nat_port_map": True}
    extra: dict[str, object] = {"relayService": 0}
    if reach == PUBLIC:
        kwargs["force_reachability"] = "public"
        if limits is not None:
            extra = limits.daemon_flags()
    elif reach == PRIVATE:
        kwargs["force_reachability"] = "private"
        if relays:
            kwargs.update(use_auto_relay=True, trusted_relays=relays)
            extra["relayDiscovery"] = 0  # the static relays at once: discovery waits minutes for candidates
    elif reach == UNKNOWN and limits is not None:
        extra = limits.daemon_flags()  # relays only once the daemon's AutoNAT finds it public
    return kwargs, extra


def check_initial_peer(addr: str, parse_maddr, parse_peer_id) -> None:
    """A full multiaddr with a valid peer id, else a `ConfigError` naming it. The parsers are the transport's
    (hivemind's own copy of the multiaddr library: the `multiaddr` package is not always installed)."""
    example = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
    if not isinstance(addr, str) or not addr.startswith("/") or "/p2p/" not in addr:
        raise ConfigError(f"initial peer {addr!r} is not a full multiaddr like {example}")
    try:
        parse_maddr(addr)
        parse_peer_id(peer_of(addr))
    except Exception as e:  # boundary: the parsers raise assorted errors for assorted typos
        raise ConfigError(f"initial peer {addr!r} is not a valid multiaddr ({e}); expected one like "
                          f"{example}") from None


def peer_of(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[-1]


def free_port(host: str) -> int:
    """A port free on `host` now for both TCP and UDP (the daemon listens on it for TCP and QUIC, across its
    restarts while joining); a few tries, then any TCP port."""
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
                return port
    return port


# ---- messages ----

async def send(writer: asyncio.StreamWriter, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> dict:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > MAX_MESSAGE:
        raise ValueError(f"reach message of {size} bytes (at most {MAX_MESSAGE})")
    obj = json.loads(await reader.readexactly(size))
    if not isinstance(obj, dict):
        raise ValueError("reach message is not an object")
    return obj


def ip_of(maddr: str) -> str | None:
    """The IP of a direct multiaddr (/ip4/A/tcp/P or /ip6/...); None for a relayed, malformed or other one."""
    parts = maddr.split("/") if isinstance(maddr, str) else []
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    return parts[2]


def dialable(maddr: str) -> bool:
    """A direct TCP or QUIC address with a valid IP (not loopback) and port: one worth dialling again."""
    parts = maddr.split("/") if isinstance(maddr, str) else []
    if ip_of(maddr) is None or is_loopback_addr(maddr) or len(parts) < 5 or parts[3] not in ("tcp", "udp"):
        return False
    if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536 or len(maddr) > 200:
        return False
    return len(parts) == 5 or parts[5:] in (["quic-v1"], ["quic"])


def is_global_addr(maddr: str) -> bool:
    ip = ip_of(maddr)
    return ip is not None and ipaddress.ip_address(ip).is_global


def is_loopback_addr(maddr: str) -> bool:
    ip = ip_of(maddr)
    return ip is not None and ipaddress.ip_address(ip).is_loopback


def is_private_addr(maddr: str) -> bool:
    """A LAN, carrier-grade NAT, link-local or loopback address: reachable only within its own network."""
    ip = ip_of(maddr)
    return ip is not None and not ipaddress.ip_address(ip).is_global


class Helper:
    """The answering side: dial-backs bounded per asker and in number; the node's own addresses."""

    def __init__(self, observed_ip, own_addrs, relay_state=lambda: None, known=dict):
        self._observed_ip = observed_ip  # async (peer id) -> the IP its connection comes from, or None
        self._own_addrs = own_addrs  # async () -> this node's dialable multiaddrs
        self._relay_state = relay_state  # () -> whether it relays with its own limits (None: unknown, or no relay)
        self._known = known  # () -> the peers met: {peer id: {"addrs": [...], "seen": t, ...}}
        self._last: dict[str, float] = {}  # per IP asked for: peer ids cost nothing, addresses do
        self._dialing = 0

    async def handle(self, reader, writer, remote: str) -> None:
        try:
            request = await asyncio.wait_for(receive(reader), ASK_TIMEOUT_S)
        except (ValueError, RecursionError, struct.error) as e:  # a malformed request: say so, no traceback
            logger.debug("bad reach request from …%s: %s", remote[-8:], e)
            await send(writer, {"error": f"bad request: {e}"[:200]})
            return
        if "dial" in request:
            await send(writer, await self._dial(remote, request["dial"]))
        elif request.get("addrs"):
            await send(writer, {"addrs": (await self._own_addrs())[:8], "relay": self._relay_state()})
        elif request.get("peers"):  # the public peers met, most recently seen first: relay candidates
            met = sorted(self._known().items(), key=lambda kv: -kv[1]["seen"])[:MAX_PEERS_ANSWERED]
            await send(writer, {"peers": {peer: v["addrs"][:2] for peer, v in met}})
        else:
            await send(writer, {"error": "unknown request"})

    async def _dial(self, remote: str, port) -> dict:
        if type(port) is not int or not 0 < port < 65536:
            return {"error": "port must be an integer from 1 to 65535"}
        ip = await self._observed_ip(remote)
        if ip is None:
            return {"error": "no direct connection to dial back along"}
        now = time.monotonic()
        if now - self._last.get(ip, -1e9) < HELPER_INTERVAL_S:
            return {"error": "asked too often"}
        if self._dialing >= MAX_DIALS:
            return {"error": "busy"}
        self._last[ip] = now
        if len(self._last) > 1024:
            self._last = {k: v for k, v in self._last.items() if now - v < HELPER_INTERVAL_S}
        self._dialing += 1
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            return {"reached": False, "seen": ip, "why": type(e).__name__}
        finally:
            self._dialing -= 1
        writer.close()
        with contextlib.suppress(Exception):  # closing a probe connection is best effort
            await writer.wait_closed()
        return {"reached": True, "seen": ip}


async def ask(open_stream, helper: str, request: dict) -> dict:
    """One request to `helper` over `open_stream(peer, protocol)` -> (reader, writer); its answer."""
    async def exchange() -> dict:
        reader, writer = await open_stream(helper, REACH_PROTOCOL)
        try:
            await send(writer, request)
            return await receive(reader)
        finally:
            writer.close()

    return await asyncio.wait_for(exchange(), ASK_TIMEOUT_S)


async def check(open_stream, helpers: list[str], port: int) -> tuple[str, str]:
    """Ask up to `MAX_HELPERS` helpers to dial `port` back: (PUBLIC | PRIVATE | UNKNOWN, why)."""
    asked = helpers[:MAX_HELPERS]

    async def one(helper):
        try:
            return helper, await ask(open_stream, helper, {"dial": port})
        except Exception as e:  # boundary: a helper that fails to answer is just not counted
            return helper, {"error": f"{type(e).__name__}: {e}"[:200]}

    answers = await asyncio.gather(*(one(h) for h in asked))
    reached = [(h, a) for h, a in answers if a.get("reached") is True]
    refused = [(h, a) for h, a in answers if a.get("reached") is False]

    def seen_global(answer: dict) -> bool:
        return is_global_addr(f"/ip4/{answer.get('seen')}")  # ip_of takes an IPv6 address there too

    # A dial-back from the internet (the helper saw a global address) decides; one from this node's own network
    # (a helper on the same LAN) makes it public only if no helper on the internet failed to reach it.
    far_reached = [x for x in reached if seen_global(x[1])]
    far_refused = [x for x in refused if seen_global(x[1])]
    if far_reached or (reached and not far_refused):
        h, a = (far_reached or reached)[0]
        return PUBLIC, f"…{h[-8:]} dialled port {port} at {a.get('seen')}"
    if refused:
        h, a = (far_refused or refused)[0]
        return PRIVATE, (f"{len(refused)} of {len(asked)} peers could not dial port {port} at {a.get('seen')} "
                         f"({a.get('why')})")
    errors = "; ".join(f"…{h[-8:]}: {a.get('error')}" for h, a in answers) or "no peer to ask"
    return UNKNOWN, errors


__all__ = ["REACH_PROTOCOL", "RelayLimits", "Helper", "ask", "check", "daemon_settings", "ip_of",
           "is_private_addr", "is_loopback_addr", "is_global_addr", "dialable", "check_initial_peer", "peer_of", "free_port", "PUBLIC", "PRIVATE", "UNKNOWN", "LOCAL"]
