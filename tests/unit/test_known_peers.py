"""The file of peers met: only dialable addresses, the longest-known peers first and at most 16 of them, newcomers
only where there is room and two a round (a crowd of fresh identities cannot fill it), a broken file ignored and
replaced, and the file's place next to an identity."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.net import known_peers, reach
from swarm.net.identity import Identity
from swarm.net.known_peers import KnownPeers


IDS = [Identity.generate().peer_id for _ in range(known_peers.MAX_PEERS + 5)]


def peer(n: int) -> str:
    return IDS[n]


def test_only_dialable_addresses_are_kept_longest_known_first(tmp_path):
    known = KnownPeers(tmp_path / "k.json")
    assert known.load() == {} and known.join_addrs() == []
    known.remember({peer(1): ["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.2/tcp/7", "/ip4/11.0.0.2/tcp/31337",
                              "/ip4/11.0.0.2/tcp/31337"],
                    peer(2): ["/ip4/127.0.0.1/tcp/2"],  # loopback only: not kept
                    peer(3): ["/ip4/11.0.0.2/tcp/1/p2p/X/p2p-circuit"],  # relayed: not kept
                    "not-a-peer-id": ["/ip4/11.0.0.9/tcp/9"]}, now=10.0)  # the daemon would refuse it
    known.remember({peer(4): ["/ip4/11.0.0.4/tcp/4/p2p/" + peer(4)]}, now=20.0)
    assert set(known.load()) == {peer(1), peer(4)}
    assert known.load()[peer(1)]["addrs"] == ["/ip4/11.0.0.2/tcp/31337", "/ip4/192.168.1.2/tcp/7"]  # global first
    assert known.join_addrs() == [f"/ip4/11.0.0.2/tcp/31337/p2p/{peer(1)}", f"/ip4/192.168.1.2/tcp/7/p2p/{peer(1)}",
                                  f"/ip4/11.0.0.4/tcp/4/p2p/{peer(4)}"]
    assert known.join_addrs(exclude={peer(1)}) == [f"/ip4/11.0.0.4/tcp/4/p2p/{peer(4)}"]


def test_addresses_the_daemon_would_refuse_are_never_kept(tmp_path):
    """An address that fails to parse would stop the daemon at every start: a peer's answer cannot plant one."""
    known = KnownPeers(tmp_path / "k.json")
    bad = ["/ip4/1.2.3.4/tcp/99999999", "/ip4/evil/tcp/1", "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/udp/1/webrtc",
           "/ip4/1.2.3.4/tcp/1/x" * 40, "/dns/example.org/tcp/1", 7]
    known.remember({peer(1): bad}, now=1.0)
    assert known.load() == {}
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"peers": {peer(2): {"addrs": bad + ["/ip4/1.2.3.4/udp/5/quic-v1"], "seen": 1}}}))
    assert known.join_addrs() == [f"/ip4/1.2.3.4/udp/5/quic-v1/p2p/{peer(2)}"]


def test_at_most_sixteen_peers_newcomers_only_where_there_is_room(tmp_path):
    known = KnownPeers(tmp_path / "k.json")
    for n in range(known_peers.MAX_PEERS + 5):
        known.remember({peer(n): [f"/ip4/11.0.0.{n + 2}/tcp/31337"]}, now=float(n))
    kept = known.load()
    assert len(kept) == known_peers.MAX_PEERS and peer(0) in kept and peer(known_peers.MAX_PEERS) not in kept
    others = {peer(n): [f"/ip4/11.0.0.{n + 2}/tcp/31337"] for n in range(1, known_peers.MAX_PEERS + 5)}
    known.remember(others, now=100.0)  # all seen again but peer 0: still no room
    assert peer(known_peers.MAX_PEERS) not in known.load()
    known.remember(others, now=known_peers.STALE_S + 50.0)  # peer 0 not seen for long: its place goes to a newcomer
    kept = known.load()
    assert peer(0) not in kept and peer(known_peers.MAX_PEERS) in kept and len(kept) == known_peers.MAX_PEERS


def test_a_crowd_of_fresh_identities_cannot_fill_the_file(tmp_path):
    """Ten identities connect and say where they are, round after round: two enter a round while there is room,
    and the peers known longest stay first in line at the next start."""
    known = KnownPeers(tmp_path / "k.json")
    known.remember({peer(n): [f"/ip4/11.0.0.{n + 2}/tcp/1"] for n in range(6)}, now=0.0)
    known.remember({peer(n): [f"/ip4/11.0.0.{n + 2}/tcp/1"] for n in range(6)}, now=1.0)
    known.remember({peer(n): [f"/ip4/11.0.0.{n + 2}/tcp/1"] for n in range(6)}, now=2.0)
    assert len(known.load()) == 6
    crowd = {peer(n): [f"/ip4/11.0.1.{n}/tcp/1"] for n in range(6, 16)}
    assert known.remember(crowd, now=3.0) == 8
    first = [reach.peer_of(a) for a in known.join_addrs()][:6]
    assert first == [peer(n) for n in range(6)]


def test_a_broken_file_is_ignored_and_replaced(tmp_path, caplog):
    path = tmp_path / "k.json"
    for text in ("not json", json.dumps({"peers": [1, 2]}), json.dumps([1])):
        path.write_text(text)
        assert KnownPeers(path).load() == {}
    assert "ignoring the known peers file" in caplog.text
    KnownPeers(path).remember({peer(1): ["/ip4/11.0.0.2/tcp/1"]})
    assert set(json.loads(path.read_text())["peers"]) == {peer(1)}


def test_the_file_sits_next_to_the_identity():
    assert known_peers.path_for(Path("/k/peer.key"), Path("/home")) == Path("/k/peer.key.known-peers.json")
    assert known_peers.path_for(None, Path("/home")) == Path("/home/known-peers.json")


def test_addresses_are_told_apart():
    assert reach.ip_of("/ip4/11.0.0.2/tcp/1") == "11.0.0.2" and reach.ip_of("/ip4/1.2.3.4/tcp/1/p2p/X/p2p-circuit") is None
    assert reach.is_private_addr("/ip4/192.168.1.2/tcp/1") and not reach.is_private_addr("/ip4/11.0.0.2/tcp/1")
    assert reach.is_private_addr("/ip4/100.64.0.1/tcp/1")  # carrier-grade NAT: not reachable from outside
    assert reach.is_loopback_addr("/ip4/127.0.0.1/tcp/1") and not reach.is_loopback_addr("/ip4/10.0.0.1/tcp/1")


def test_relay_limits_become_daemon_flags():
    kwargs, extra = reach.daemon_settings(reach.PUBLIC, relays=[], limits=reach.RelayLimits(circuits=3))
    assert kwargs["force_reachability"] == "public"
    assert extra["relayService"] == 1 and extra["relayMaxCircuits"] == 3 and extra["relayTimeLimit"] == "21600s"
    kwargs, extra = reach.daemon_settings(reach.PRIVATE, relays=["/ip4/11.0.0.2/tcp/1/p2p/X"], limits=None)
    assert kwargs["use_auto_relay"] and kwargs["trusted_relays"] and extra == {"relayService": 0,
                                                                               "relayDiscovery": 0}
    kwargs, extra = reach.daemon_settings("client", relays=[], limits=reach.RelayLimits())
    assert extra == {"relayService": 0} and "force_reachability" not in kwargs
