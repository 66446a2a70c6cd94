"""The internet in a box (`tests/netbox.py`) does what the home-router tests rely on: a home reaches the
public segment and is seen there as its router's address; nothing reaches a home or its router unasked,
from the public segment or from another home; an uplink cap holds; regions put their delays on every
packet; `close` and `sweep` leave no namespace behind. Plain TCP only (tiny servers and probes, no swarm): a few seconds in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netbox
from netbox import Box, Host
from swarm.local.launch import pid_alive

pytestmark = pytest.mark.integration

if netbox.available() is not None and os.geteuid() != 0:  # CI runs as root; missing tools there are a failure
    pytest.skip(netbox.available(), allow_module_level=True)

# A server on PORT: for each connection, sends the address it sees the connection come from, or (`sink`) reads
# to the end, then sends how many bytes it read.
SERVER = r"""
import socket, sys
port, mode = int(sys.argv[1]), sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen(16)
while True:
    c, addr = s.accept()
    if mode == "sink":
        n = 0
        while chunk := c.recv(1 << 16):
            n += len(chunk)
        c.sendall(str(n).encode())
    else:
        c.sendall(addr[0].encode())
    c.close()
"""

# Connects to every HOST:PORT given, all at once, and prints {target: what came back, or why not}.
PROBE = r"""
import concurrent.futures, json, socket, sys
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=float(sys.argv[1])) as s:
            try:
                return "reply " + s.recv(64).decode()
            except socket.timeout:
                return "connected"  # a sink: it answers at the end of what it is sent
    except socket.timeout:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return f"unreachable ({e.strerror})"
with concurrent.futures.ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(probe, sys.argv[2:])))))
"""

# Sends N bytes to HOST:PORT (a sink), waits for its count, prints the rate in Mbit/s.
SEND = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=30)
started = time.monotonic()
s.sendall(b"x" * n); s.shutdown(socket.SHUT_WR)
got = int(s.recv(64))
elapsed = time.monotonic() - started
assert got == n, (got, n)
print(n * 8 / elapsed / 1e6)
"""

BLOCKED_WAIT_S = 1.0  # a probe of a dropped destination gives up after this


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def probe(box: Box, host: Host, *targets: str) -> dict[str, str]:
    done = box.run(host, [sys.executable, "-c", PROBE, str(BLOCKED_WAIT_S), *targets], timeout=20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def serve(box: Box, host: Host, port: int, mode: str = "who") -> None:
    """A server on `host`, returned once it answers there (on its loopback)."""
    box.spawn(host, [sys.executable, "-c", SERVER, str(port), mode])
    deadline = time.monotonic() + 10
    target = f"127.0.0.1:{port}"
    while not probe(box, host, target)[target].startswith(("reply", "connected")):
        assert time.monotonic() < deadline, f"the server on {host.name}:{port} did not start"
        time.sleep(0.05)


def router_of(home: Host) -> Host:
    """The home's router as a host of its own, to run a process there."""
    return Host(f"{home.name}-router", home.router_ns, home.wan_address, public=True)


@pytest.fixture(scope="module")
def box():
    with Box() as b:
        srv = b.public("srv")
        alice, bob = b.home("alice"), b.home("bob", uplink_mbit=8)
        serve(b, srv, 9000)
        serve(b, alice, 9001)
        serve(b, router_of(alice), 9002)
        serve(b, srv, 9003, "sink")
        assert (srv.address, alice.address, bob.address) == ("11.0.0.2", "192.168.1.2", "192.168.2.2")
        assert (alice.seen_as, bob.seen_as) == ("11.0.0.101", "11.0.0.102")
        yield b


def test_a_home_reaches_a_public_host_as_its_router(box):
    srv, alice, bob = (box.hosts[n] for n in ("srv", "alice", "bob"))
    for home in (alice, bob):
        target = f"{srv.address}:9000"
        assert probe(box, home, target) == {target: f"reply {home.seen_as}"}  # masqueraded to the router's address


def test_a_home_reaches_its_own_router(box):
    target = "192.168.1.1:9002"
    assert probe(box, box.hosts["alice"], target) == {target: "reply 192.168.1.2"}


def test_nothing_reaches_a_home_or_its_router_unasked(box):
    srv, alice, bob = (box.hosts[n] for n in ("srv", "alice", "bob"))
    router, lan = f"{alice.wan_address}:9002", f"{alice.address}:9001"
    forwarded = f"{alice.wan_address}:9001"  # no port is forwarded to the home
    from_public = probe(box, srv, router, forwarded, lan)
    assert from_public[router] == "timeout" and from_public[forwarded] == "timeout", from_public
    assert from_public[lan].startswith("unreachable") or from_public[lan] == "timeout", from_public
    from_home = probe(box, bob, router, forwarded, lan)  # another home: as the public segment, or worse
    assert from_home[router] == "timeout" and from_home[forwarded] == "timeout", from_home
    assert from_home[lan].startswith("unreachable") or from_home[lan] == "timeout", from_home


def test_the_uplink_cap_holds(box):
    """bob's uplink is capped at 8 Mbit/s, alice's is not: 1 MB each to a sink on the public segment."""
    srv = box.hosts["srv"]

    def rate(home: str) -> float:
        done = box.run(box.hosts[home], [sys.executable, "-c", SEND, srv.address, "9003", str(1 << 20)], timeout=30)
        assert done.returncode == 0, done.stderr
        return float(done.stdout)

    capped, free = rate("bob"), rate("alice")
    assert 4 < capped < 8 * 1.25, capped
    assert free > 5 * capped, (free, capped)


def test_close_stops_its_processes_and_deletes_every_namespace():
    box = Box()
    home = box.home("carol", uplink_mbit=20)
    box.public("dave")
    sleeper = box.spawn(home, ["sleep", "600"])
    mine = {ns for ns in namespaces() if ns.startswith(f"{box.tag}-")}
    assert len(mine) == 4, mine  # the segment, dave, carol and carol's router
    box.close()
    assert sleeper.poll() is not None
    assert not {ns for ns in namespaces() if ns.startswith(f"{box.tag}-")}
    box.close()  # twice is harmless


def test_sweep_removes_what_a_killed_run_left_and_nothing_else(tmp_path: Path):
    """A process builds a box, starts a process in it and is killed: its namespaces and that process stay,
    until `sweep()` (which every new box runs) removes them, leaving live boxes alone."""
    script = (f"import os, signal, subprocess, sys; sys.path.insert(0, {str(Path(netbox.__file__).parent)!r}); import netbox\n"
              "box = netbox.Box(); home = box.home('erin')\n"
              "p = box.spawn(home, ['sleep', '600'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              "print(box.tag, p.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    with Box() as live:
        live.public("frank")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        assert done.returncode == -signal.SIGKILL, done.stderr
        tag, orphan = done.stdout.split()
        left = {ns for ns in namespaces() if ns.startswith(f"{tag}-")}
        assert len(left) == 3, left  # what close() would have deleted: the segment, erin and erin's router
        assert pid_alive(int(orphan))
        removed = set(netbox.sweep())
        assert left <= removed and not any(ns.startswith(f"{live.tag}-") for ns in removed)
        assert {f"{live.tag}-wan", f"{live.tag}-frank"} <= namespaces()  # a live box's (its process runs)
        assert not left & namespaces()
    deadline = time.monotonic() + 5
    while pid_alive(int(orphan)):
        assert time.monotonic() < deadline, f"process {orphan} left by the killed run still runs"
        time.sleep(0.05)


# Opens a TCP connection to HOST:PORT `n` times, one after another; prints the least time a connection took (ms):
# the SYN and its SYN-ACK, one round trip.
CONNECT = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
best = float("inf")
for _ in range(n):
    started = time.perf_counter()
    socket.create_connection((host, port), timeout=10).close()
    best = min(best, (time.perf_counter() - started) * 1e3)
print(best)
"""


def test_regions_put_their_delay_on_every_packet_and_nat_still_holds():
    """Two regions, 5 ms one way within eu, 2 ms within us, 25 ms between: a TCP handshake (one round trip)
    takes twice the one-way delay of its ends' regions, from a public host or from behind a home router
    (seen there as the router, nothing reaching the home unasked); a delay changed at run time applies to the
    next packets; the delayer counted them by pair of regions; closing removes every namespace."""
    with Box(regions={"eu": 5.0, "us": 2.0}, between_ms=25.0) as box:
        a, b, c = box.public("a", region="eu"), box.public("b", region="eu"), box.public("c", region="us")
        home = box.home("h", region="us")
        for host in (a, b, c):
            serve(box, host, 9000)

        def rtt(src: Host, dst: Host) -> float:
            done = box.run(src, [sys.executable, "-c", CONNECT, dst.address, "9000", "3"], timeout=30)
            assert done.returncode == 0, done.stderr
            return float(done.stdout)

        within_eu, between, within_us, home_to_eu = rtt(a, b), rtt(a, c), rtt(home, c), rtt(home, a)
        assert 10 <= within_eu < 10 + 5, within_eu
        assert 50 <= between < 50 + 5 and 50 <= home_to_eu < 50 + 5, (between, home_to_eu)
        assert 4 <= within_us < 4 + 5, within_us
        target = f"{a.address}:9000"
        assert probe(box, home, target) == {target: f"reply {home.seen_as}"}
        assert probe(box, a, f"{home.wan_address}:9000")[f"{home.wan_address}:9000"] == "timeout"
        box.set_delay("eu", "us", 10.0)
        assert 20 <= rtt(a, c) < 20 + 5
        stats = box.delay_stats()
        assert {"eu>eu", "eu>us", "us>eu", "us>us"} <= set(stats) and all(s["packets"] > 0 for s in stats.values())
        tag = box.tag
    assert not {ns for ns in namespaces() if ns.startswith(f"{tag}-")}
