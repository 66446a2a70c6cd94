"""The reach protocol between real nodes on loopback: a dial-back to a port that listens and to one that
does not, the helper's bounds (one asker, one dial-back every 2 s; ports in range; unknown requests), what a
node tells of its own addresses, and initial peers that are malformed or do not answer."""

from __future__ import annotations

import asyncio
import socket

import pytest

from swarm.errors import ConfigError, SwarmUnreachable
from swarm.net import reach
from swarm.net.identity import Identity
from swarm.net.known_peers import KnownPeers
from swarm.net.transport import Node

pytestmark = pytest.mark.integration


def listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def two_nodes():
    first = await Node(Identity.generate()).__aenter__()
    addr = (await first.maddrs())[0]
    second = await Node(Identity.generate(), initial_peers=[addr]).__aenter__()
    return first, second


def test_a_helper_dials_back_only_the_asker_and_says_what_it_found():
    async def main():
        first, second = await two_nodes()
        try:
            with listening_socket() as sock:
                state, why = await reach.check(second._open_rw, [first.peer_id], sock.getsockname()[1])
            assert state == reach.PUBLIC and "127.0.0.1" in why
            await asyncio.sleep(reach.HELPER_INTERVAL_S)
            state, why = await reach.check(second._open_rw, [first.peer_id], closed_port())
            assert state == reach.PRIVATE and "could not dial" in why
            # one asker, one dial-back per interval: the next is refused, and refusals alone decide nothing
            assert (await reach.ask(second._open_rw, first.peer_id, {"dial": 1}))["error"] == "asked too often"
            state, why = await reach.check(second._open_rw, [first.peer_id], 1)
            assert state == reach.UNKNOWN and "asked too often" in why
            await asyncio.sleep(reach.HELPER_INTERVAL_S)
            for bad in (0, 70000, "80", None):
                answer = await reach.ask(second._open_rw, first.peer_id, {"dial": bad})
                assert "port must be an integer" in answer["error"]
            assert (await reach.ask(second._open_rw, first.peer_id, {"what": 1}))["error"] == "unknown request"
            # nodes on one machine tell no dialable address: nothing of a local swarm is remembered
            assert (await reach.ask(second._open_rw, first.peer_id, {"addrs": True})) == {"addrs": [], "relay": None}
            assert (await reach.ask(second._open_rw, first.peer_id, {"peers": True})) == {"peers": {}}
            assert first.reach == second.reach == reach.LOCAL and first.reached_by is None
        finally:
            await second.__aexit__(None, None, None)
            await first.__aexit__(None, None, None)

    asyncio.run(main())


def test_a_client_serves_no_dial_back_and_nobody_to_ask_is_unknown():
    async def main():
        first = await Node(Identity.generate()).__aenter__()
        addr = (await first.maddrs())[0]
        client = await Node(Identity.generate(), initial_peers=[addr], client_mode=True).__aenter__()
        try:
            state, why = await reach.check(first._open_rw, [client.peer_id], closed_port())
            assert state == reach.UNKNOWN and client.peer_id[-8:] in why
            assert await reach.check(first._open_rw, [], 1) == (reach.UNKNOWN, "no peer to ask")
        finally:
            await client.__aexit__(None, None, None)
            await first.__aexit__(None, None, None)

    asyncio.run(main())


@pytest.mark.parametrize("addr, says", [
    ("/ip4/127.0.0.1/tcp/31337", "not a full multiaddr"),
    ("/ip4/999.0.0.1/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo", "not a valid multiaddr"),
    ("/ip4/127.0.0.1/tcp/31337/p2p/not-a-peer-id", "not a valid multiaddr"),
])
def test_a_malformed_initial_peer_is_named(addr, says):
    async def main():
        with pytest.raises(ConfigError, match=says):
            await Node(Identity.generate(), initial_peers=[addr]).__aenter__()

    asyncio.run(main())


def test_no_initial_peer_answering_falls_back_to_the_peers_met_then_fails_clearly(tmp_path):
    """Off loopback (0.0.0.0), a node whose initial peer is gone joins through a peer it met before; with
    neither answering, the error names what it tried."""
    async def main():
        first = await Node(Identity.generate(), host="127.0.0.1").__aenter__()
        try:
            live = [a for a in await first.maddrs() if "/tcp/" in a][0]
            dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{Identity.generate().peer_id}"
            known = KnownPeers(tmp_path / "known-peers.json")
            # the file keeps only dialable addresses: a loopback one is dropped, so write the entry by hand
            known._write({"peers": {first.peer_id: {"addrs": [live.split("/p2p/")[0]], "seen": 1.0}}})
            assert known.join_addrs() == []  # loopback is never joined through from the file
            with pytest.raises(SwarmUnreachable, match="cannot reach any initial peer"):
                await Node(Identity.generate(), host="0.0.0.0", initial_peers=[dead], client_mode=True,
                           known_peers=tmp_path / "known-peers.json").__aenter__()
        finally:
            await first.__aexit__(None, None, None)

    asyncio.run(main())
