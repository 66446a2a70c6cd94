"""Processes come and go cleanly: the bootstrap keeps its address across restarts and leaves no
daemon behind however it is stopped; a peer announces offline on a clean stop, and the records of a
peer that vanishes expire."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from swarm.net import discovery
from swarm.errors import ConfigError, SwarmUnreachable
from swarm.net.identity import Identity
from swarm.net.transport import Node
from swarm_harness import LocalSwarm, pid_alive, wait_until

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_pids(proc) -> list[int]:
    """The bootstrap's children: the transport daemon and its reaper."""
    return wait_until(lambda: proc.children() if len(proc.children()) >= 2 else None, 10, "the daemon and reaper")


def loaded_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["term", "int", "kill"])
def test_bootstrap_keeps_its_address_and_leaves_nothing_behind(tmp_path, sig):
    net = LocalSwarm(tmp_path)
    port = str(free_port())
    try:
        first = net.start_bootstrap("boot", "--port", port, "--log-interval", "0.5")
        children = daemon_pids(first)
        assert not loaded_torch(first.popen.pid), "the bootstrap imported torch"
        wait_until(lambda: "swarm size:" in first.text(), 10, "a swarm size report")
        code = net.stop("boot", sig)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), first.text()[-2000:]
        wait_until(lambda: not any(pid_alive(p) for p in children), 15, f"children {children} to exit")

        again = net.start_bootstrap("boot", "--port", port)
        assert again.extra["maddrs"] == first.extra["maddrs"]
        assert again.extra["maddrs"][0].endswith(f"/tcp/{port}/p2p/{first.peer_id}")
    finally:
        net.stop_all()


def test_peer_announces_offline_on_clean_stop_and_vanished_records_expire(swarm, client, loop, tiny_llama):
    model = "tiny-llama-lifecycle"  # its own model id, so the shared swarm's coverage is untouched
    options = ("--model-id", model, "--announce-interval", "1", "--record-ttl", "4")
    leaving = swarm.start_peer("leaving", tiny_llama, "--blocks", "0:1", *options)
    vanishing = swarm.start_peer("vanishing", tiny_llama, "--blocks", "1:2", *options)

    def states(block: int) -> dict[str, str]:
        return {a.peer: a.state for a in loop.run(discovery.announcements(client, model, 2))[block]}

    wait_until(lambda: states(0).get(leaving.peer_id) == "online" and states(1).get(vanishing.peer_id) == "online",
               15, "both peers online")
    children = vanishing.children()
    assert swarm.stop("leaving", signal.SIGTERM) == 0
    assert "announcing blocks [0:1) offline" in leaving.text()
    wait_until(lambda: states(0).get(leaving.peer_id) == "offline", 10, "the offline announcement")

    swarm.stop("vanishing", signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in children), 15, "the killed peer's daemon to be reaped")
    started = time.monotonic()
    wait_until(lambda: vanishing.peer_id not in states(1), 20, "the vanished peer's records to expire")
    assert time.monotonic() - started < 4 + 10


def test_joining_an_unreachable_swarm_is_a_clear_error(loop):
    nobody = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{Identity.generate().peer_id}"
    with pytest.raises(SwarmUnreachable, match="initial peer"):
        loop.run(Node(Identity.generate(), initial_peers=[nobody]).__aenter__())
    with pytest.raises(ConfigError, match="full multiaddr"):
        loop.run(Node(Identity.generate(), initial_peers=["/ip4/127.0.0.1/tcp/1"]).__aenter__())


def test_a_peer_keeps_trying_to_join_and_serves_once_the_bootstrap_is_up(tmp_path, tiny_llama):
    """A peer started before its bootstrap (or while it is down) says so and tries again, with growing waits,
    instead of exiting; once the bootstrap answers at its address, the peer joins and serves."""
    from swarm.net.identity import load_or_create

    port = free_port()
    boot_id = load_or_create(tmp_path / "bootstrap.key").peer_id  # the address is known before it runs
    with LocalSwarm(tmp_path) as net:
        net.bootstrap_addrs = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"]
        peer = net.start_peer("early", tiny_llama, "--blocks", "0:6", wait=False)
        wait_until(lambda: "trying again in 5 s" in peer.text(), 60, "the peer to say it tries again",
                   diagnostics=peer.text)
        assert peer.alive() and "serving blocks" not in peer.text()
        net.start_bootstrap("bootstrap", "--port", str(port))
        net.wait_serving(peer, 90)
        assert "cannot reach any initial peer" in peer.text()
