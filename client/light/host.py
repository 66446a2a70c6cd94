"""The light client's libp2p host: py-libp2p's TCP transport, Noise, yamux and multistream-select, and nothing
else (dials out, serves nothing).

Why not `libp2p.new_host()`: importing the `libp2p` package loads every transport and service it ships
(QUIC, WebSocket, AutoTLS with two HTTP clients, mDNS, UPnP, circuit relay, Kademlia), and its host class
imports most of them again. That was 1.3 s of a light client's 2 s to join, measured on the reference
machine; the parts below take 0.35-0.43 s. So, as `swarm.net.transport` does for hivemind, the package is
loaded without its `__init__` (nor `libp2p.transport`'s and `libp2p.security`'s), QUIC's stream module is a
placeholder, and dnspython is told that DNS over QUIC and HTTPS are absent, so neither aioquic, httpx nor
x509 is loaded (below, each with what it saves). The host is built from the same classes
`new_host()` uses, with the same defaults where the client needs them: an Ed25519 identity, Noise, yamux,
one connection per peer. These are internal constructors of libp2p 0.8.1, which the `light` extra pins;
`tests/integration/test_light_client.py` runs them against real peers.

Streams a peer opens to the client (libp2p's identify, for one) are reset at once: the client serves no
protocol, and a stream left open would hold the peer's handler until its timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import AsyncIterator, Sequence

NEGOTIATE_TIMEOUT = 10  # seconds for multistream-select on a new stream (libp2p's default is 5 at the host)


# Packages loaded without their `__init__`: each one's init only imports submodules for its namespace (every
# transport, every security protocol: QUIC, WebSocket, TLS with x509, SECIO, ...), and the host imports the
# submodules it uses by their full names.
_SHELLS = ("", ".transport", ".security")
# Imported by `libp2p.custom_types` for one type alias; the real module loads aioquic and with it TLS, x509 and
# pyOpenSSL (0.18 s on the reference machine). The client never makes a QUIC stream.
_PLACEHOLDERS = {"libp2p.transport.quic.stream": ("QUICStream",)}
# dnspython (multiaddr's resolver of /dns4 and /dnsaddr addresses) loads aioquic and httpx at import for DNS over
# QUIC and over HTTPS, unless told they are absent; a dial resolves over plain DNS.
_DNS_FEATURES_OFF = ("doq", "doh")


class _Absent:
    """A class of a module the light client does not load: a name to annotate with, never to make."""

    def __new__(cls, *args, **kwargs):
        raise ImportError(f"{cls.__module__}.{cls.__qualname__} is not loaded in the light client "
                          "(see client/light/host.py)")


def _shell(name: str, path: str) -> None:
    module = types.ModuleType(name)
    module.__path__, module.__package__ = [path], name
    sys.modules[name] = module


def _placeholder(name: str, classes: Sequence[str]) -> None:
    module = types.ModuleType(name, "placeholder of the light client: never loaded (see client/light/host.py)")
    for cls in classes:
        setattr(module, cls, type(cls, (_Absent,), {"__module__": name}))
    sys.modules[name] = module


def _load() -> types.SimpleNamespace:
    """The parts of py-libp2p the host uses. If `libp2p` was already imported normally, it is used as is."""
    skipped_init = "libp2p" not in sys.modules
    if skipped_init:
        spec = importlib.util.find_spec("libp2p")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("no module named 'libp2p'")
        root = spec.submodule_search_locations[0]
        for sub in _SHELLS:
            if "libp2p" + sub not in sys.modules:
                _shell("libp2p" + sub, root + sub.replace(".", "/"))
        for name, classes in _PLACEHOLDERS.items():
            if name not in sys.modules:
                _placeholder(name, classes)
        if "dns" not in sys.modules:  # before dnspython reads its features (a process that loaded it keeps them)
            import dns._features

            for feature in _DNS_FEATURES_OFF:
                dns._features.force(feature, False)
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_noise_key_pair
    from libp2p.network.config import ConnectionConfig
    from libp2p.network.swarm import Swarm
    from libp2p.peer.id import ID
    from libp2p.peer.peerstore import PeerStore
    from libp2p.protocol_muxer.multiselect_client import MultiselectClient
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID, Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID, Yamux
    from libp2p.tools.anyio_service import background_trio_service
    from libp2p.transport.manager import TransportManager
    from libp2p.transport.tcp.tcp import TCP
    from libp2p.transport.upgrader import TransportUpgrader

    if skipped_init:  # what the package's __init__ would have done: its loggers at WARNING unless LIBP2P_DEBUG
        from libp2p.utils.logging import setup_logging

        setup_logging()
    return types.SimpleNamespace(
        multiaddr=multiaddr, create_new_key_pair=create_new_key_pair, create_noise_key_pair=create_noise_key_pair,
        ConnectionConfig=ConnectionConfig, Swarm=Swarm, ID=ID, PeerStore=PeerStore, MultiselectClient=MultiselectClient,
        MultiselectCommunicator=MultiselectCommunicator, NOISE_PROTOCOL_ID=NOISE_PROTOCOL_ID, NoiseTransport=NoiseTransport,
        YAMUX_PROTOCOL_ID=YAMUX_PROTOCOL_ID, Yamux=Yamux, background_trio_service=background_trio_service,
        TransportManager=TransportManager, TCP=TCP, TransportUpgrader=TransportUpgrader)


_parts: types.SimpleNamespace | None = None


def parts() -> types.SimpleNamespace:
    global _parts
    if _parts is None:
        _parts = _load()
    return _parts


async def _refuse(stream) -> None:
    with contextlib.suppress(Exception):
        await stream.reset()


class ClientHost:
    """Made and used in trio. `run()` keeps its network running; `connect` and `new_stream` as a host's."""

    def __init__(self):
        lp = parts()
        key_pair = lp.create_new_key_pair()
        self.id = lp.ID.from_pubkey(key_pair.public_key)
        peerstore = lp.PeerStore()
        peerstore.add_key_pair(self.id, key_pair)
        upgrader = lp.TransportUpgrader(
            secure_transports_by_protocol={
                lp.NOISE_PROTOCOL_ID: lp.NoiseTransport(key_pair, noise_privkey=lp.create_noise_key_pair().private_key)},
            muxer_transports_by_protocol={lp.YAMUX_PROTOCOL_ID: lp.Yamux})
        # one connection per peer: libp2p otherwise waits 250 ms at every dial for a second one
        self.network = lp.Swarm(self.id, peerstore, upgrader, transports=[lp.TCP()],
                                connection_config=lp.ConnectionConfig(max_connections_per_peer=1),
                                transport_manager=lp.TransportManager())
        self.network.set_stream_handler(_refuse)

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        async with parts().background_trio_service(self.network):
            yield

    async def connect(self, maddr: str) -> None:
        """A connection to the peer of the full multiaddr `maddr` (`.../p2p/<id>`), ready for streams."""
        lp = parts()
        addr = lp.multiaddr.Multiaddr(maddr)
        peer = lp.ID.from_base58(addr.value_for_protocol("p2p"))
        self.network.peerstore.add_addrs(peer, [addr.decapsulate(lp.multiaddr.Multiaddr(f"/p2p/{peer}"))], 120)
        if not self.network.get_connections(peer):
            await self.network.dial_peer(peer)
        for conn in self.network.get_connections(peer)[:1]:
            started = getattr(conn, "event_started", None)
            if started is not None:
                await started.wait()

    async def new_stream(self, peer: str, protocol: str):
        """A stream to `peer` (connected before, or dialled at an address known for it) on `protocol`."""
        lp = parts()
        stream = await self.network.new_stream(lp.ID.from_base58(peer))
        try:
            selected = await lp.MultiselectClient().select_one_of([protocol], lp.MultiselectCommunicator(stream),
                                                                 NEGOTIATE_TIMEOUT)
        except BaseException:
            with contextlib.suppress(Exception):
                await stream.reset()
            raise
        stream.set_protocol(selected)
        return stream


__all__ = ["ClientHost", "parts"]
