"""An internet in a box: hosts in network namespaces on one machine, some public, some behind home routers.

    with Box() as box:
        boot = box.public("boot")              # on the public segment, reachable by everyone
        home = box.home("alice", uplink_mbit=20)  # behind its own NAT router; nothing reaches it unasked
        proc = box.spawn(home, [sys.executable, "-m", "swarm", ...])

Layout: one namespace holds the public segment, a router: each public host and each home's router gets a
veth into it with an address in `PUBLIC_NET` (on-link for them: the segment answers their ARP for every
address by proxy, and routes each packet by a host route per address). A home is two namespaces: a router (WAN address on the segment,
LAN `192.168.N.1`, forwarding on, nftables masquerade out of the WAN, and a forward and input policy that
drops what is not `ct state established,related` or from the LAN) and the host behind it (`192.168.N.2`,
default route via the router). `uplink_mbit` caps the router's WAN egress with `tc tbf` (a home uplink), or a
public host's own.

Distance: a box made with regions (`Box(regions={"eu": 1.0, "us": 1.0}, between_ms=30.0)`: one-way ms
within each region, and between any two, or per pair `{("eu", "us"): 30.0}`) puts each host in one
(`public(name, region="eu")`), and every packet crossing the segment is held for the one-way delay between
its ends' regions by `box_delay.py`, a process in the segment's namespace reading a TUN device: a round
trip between regions takes twice `between_ms`, whatever process, protocol or port, and NAT sees the
packets as without it. `set_delay` changes a delay while the box runs.

The public segment uses `11.0.0.0/24`, not a documentation range: libp2p treats documentation and
benchmarking ranges (192.0.2/24, 198.18/15, 198.51.100/24, 203.0.113/24) as unroutable, and would then
never see the box's public hosts as public. The namespaces are isolated: nothing of the box reaches the
machine's own network, and the machine's network is untouched.

Teardown (`close`, also on failure and at exit): stops the processes the box started (by PID, their
process groups), then deletes every namespace it made; interfaces go with their namespaces. Namespaces are
named `sbx<pid>-<n>-...` (`n` counts the boxes of one process, so two can exist at once), so `sweep()` can
remove what a killed run left behind (the PID no longer running).
Needs root, `ip` (iproute2), `nft` (nftables) and `tc`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PUBLIC_NET = "11.0.0"  # /24; .1 is unused, hosts from .2
PREFIX = "sbx"
STOP_S = 5.0  # per process, SIGTERM then SIGKILL
DELAYER = Path(__file__).resolve().parent / "box_delay.py"
TUN = "dly0"
DELAY_TABLE = "200"
_boxes = itertools.count()  # boxes made by this process: two at once get different names

ROUTER_RULES = """
table ip box_nat {{
    chain post {{ type nat hook postrouting priority 100; oifname "wan0" masquerade; }}
}}
table ip box_filter {{
    chain forward_home {{
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }}
    chain input_home {{
        type filter hook input priority 0; policy drop;
        ct state established,related accept
        iifname {{ "lan0", "lo" }} accept
    }}
}}
"""


class BoxError(RuntimeError):
    pass


def available() -> str | None:
    """None if a box can be built here, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 nftables)"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise BoxError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _in(ns: str, *argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30,
                          input=stdin)
    if check and proc.returncode != 0:
        raise BoxError(f"[{ns}] {' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


@dataclass
class Host:
    name: str
    ns: str  # the namespace processes of this host run in
    address: str  # its own address (public, or its LAN address behind a router)
    public: bool
    router_ns: str | None = None
    wan_address: str | None = None  # the router's public address (what others see), for a home
    region: str | None = None

    @property
    def seen_as(self) -> str:
        """The address other hosts see this host's connections come from."""
        return self.address if self.public else self.wan_address


@dataclass
class Box:
    regions: dict[str, float] = field(default_factory=dict)  # region -> one-way ms within it
    between_ms: float | dict[tuple[str, str], float] = 0.0  # one-way ms between regions (any two, or per pair)
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{next(_boxes)}")
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _next_public: int = 2
    _next_home: int = 1
    _delayer: subprocess.Popen | None = None

    def __post_init__(self):
        reason = available()
        if reason:
            raise BoxError(f"cannot build the box: {reason}")
        sweep()
        atexit.register(self.close)  # before the first namespace: a failure below leaves none behind either
        try:
            self.wan = self._namespace("wan")
            for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
                _in(self.wan, "sysctl", "-q", "-w", key)
            if self.regions:
                self._start_delayer()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Box:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- building ----

    def _namespace(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _in(ns, "ip", "link", "set", "lo", "up")
        return ns

    def _start_delayer(self) -> None:
        """`box_delay.py` on a TUN in the segment's namespace, and the rules that pass every routed packet
        through it once (packets coming out of the TUN take the main table)."""
        self._delayer = self.spawn(Host("segment", self.wan, "", True), [sys.executable, str(DELAYER), TUN],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._delayer.stdout.readline().strip() != "ready":
            raise BoxError(f"the delayer did not start (exit code {self._delayer.poll()})")
        for argv in (("ip", "link", "set", TUN, "up"), ("sysctl", "-q", "-w", f"net.ipv4.conf.{TUN}.rp_filter=0"),
                     ("ip", "route", "add", "default", "dev", TUN, "table", DELAY_TABLE),
                     ("ip", "rule", "add", "pref", "100", "iif", TUN, "lookup", "main"),
                     # no host route for it: dropped, not sent round the TUN again until its TTL runs out
                     ("ip", "rule", "add", "pref", "101", "iif", TUN, "unreachable"),
                     ("ip", "rule", "add", "pref", "200", "lookup", DELAY_TABLE)):
            _in(self.wan, *argv)
        names = sorted(self.regions)
        for a in names:
            for b in names:
                if a <= b:
                    self.set_delay(a, b, self.regions[a] if a == b else self._between(a, b))

    def _between(self, a: str, b: str) -> float:
        if isinstance(self.between_ms, dict):
            return self.between_ms.get((a, b), self.between_ms.get((b, a), 0.0))
        return self.between_ms

    def _tell(self, line: str) -> str:
        self._delayer.stdin.write(line + "\n")
        answer = self._delayer.stdout.readline().strip()
        if answer.startswith("error") or not answer:
            raise BoxError(f"delayer: {line!r}: {answer or 'no answer'}")
        return answer

    def set_delay(self, a: str, b: str, one_way_ms: float) -> None:
        """The one-way delay between regions `a` and `b` (within one when equal), from now on."""
        if a not in self.regions or b not in self.regions:
            raise BoxError(f"unknown region in {a!r}, {b!r} (the box has {sorted(self.regions)})")
        self._tell(f"delay {a} {b} {one_way_ms}")

    def delay_stats(self) -> dict:
        """Packets (and bytes held) per pair of regions, `source>dest`, as the delayer counted them."""
        return json.loads(self._tell("stats"))

    def _region(self, region: str | None, address: str) -> str | None:
        if not self.regions:
            if region is not None:
                raise BoxError(f"region {region!r} in a box made without regions")
            return None
        if region not in self.regions:
            raise BoxError(f"a host of this box needs one of the regions {sorted(self.regions)} (got {region!r})")
        self._tell(f"host {address} {region}")
        return region

    def _plug(self, ns: str, ifname: str, address: str) -> None:
        """A veth from `ns` (named `ifname`, with `address`/24) into the public segment, which routes to it."""
        peer = f"v{len(self.namespaces)}{ifname[:3]}"
        _in(self.wan, "ip", "link", "add", peer, "type", "veth", "peer", "name", ifname, "netns", ns)
        _in(self.wan, "ip", "link", "set", peer, "up")
        _in(self.wan, "sysctl", "-q", "-w", f"net.ipv4.conf.{peer}.proxy_arp=1", f"net.ipv4.neigh.{peer}.proxy_delay=0")
        _in(self.wan, "ip", "route", "add", f"{address}/32", "dev", peer)
        _in(ns, "ip", "addr", "add", f"{address}/24", "dev", ifname)
        _in(ns, "ip", "link", "set", ifname, "up")

    def public(self, name: str, *, region: str | None = None, uplink_mbit: float | None = None) -> Host:
        """A host on the public segment: everyone reaches it."""
        ns = self._namespace(name)
        address = f"{PUBLIC_NET}.{self._next_public}"
        self._next_public += 1
        self._plug(ns, "eth0", address)
        if uplink_mbit:
            self.cap(ns, "eth0", uplink_mbit)
        host = self.hosts[name] = Host(name, ns, address, public=True, region=self._region(region, address))
        return host

    def home(self, name: str, *, region: str | None = None, uplink_mbit: float | None = None) -> Host:
        """A host behind its own NAT router: it reaches the public segment; nothing reaches it unasked."""
        index = self._next_home
        self._next_home += 1
        router, ns = self._namespace(f"{name}-r"), self._namespace(name)
        wan_address = f"{PUBLIC_NET}.{100 + index}"
        self._plug(router, "wan0", wan_address)
        lan = f"192.168.{index}"
        _in(router, "ip", "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _in(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _in(router, "ip", "link", "set", "lan0", "up")
        _in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _in(router, "nft", "-f", "-", stdin=ROUTER_RULES.format())
        _in(ns, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _in(ns, "ip", "link", "set", "eth0", "up")
        _in(ns, "ip", "route", "add", "default", "via", f"{lan}.1")
        if uplink_mbit:
            self.cap(router, "wan0", uplink_mbit)
        host = self.hosts[name] = Host(name, ns, f"{lan}.2", public=False, router_ns=router, wan_address=wan_address,
                                       region=self._region(region, wan_address))
        return host

    @staticmethod
    def cap(ns: str, ifname: str, mbit: float) -> None:
        """Cap egress of `ifname` in `ns` to `mbit` Mbit/s (token bucket; 100 ms of queue)."""
        burst_kbit = max(32, int(mbit * 1000 / 250))  # at least one tick's worth at HZ=250
        _in(ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{mbit}mbit",
            "burst", f"{burst_kbit}kbit", "latency", "100ms")

    # ---- running ----

    def command(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.ns, *argv]

    def spawn(self, host: Host, argv: list[str], **popen) -> subprocess.Popen:
        """Start `argv` on `host` in a new process group; the box stops it on close."""
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **popen)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
        """Stop one process the box started (its whole group): `sig`, then SIGKILL after `STOP_S`."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_S)
        with contextlib.suppress(ProcessLookupError):  # children left in its group (a daemon, a reaper)
            os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        if self._delayer is not None:
            for pipe in (self._delayer.stdin, self._delayer.stdout):
                with contextlib.suppress(Exception):
                    pipe.close()  # the end of its commands: it exits (stopped below if not)
            self._delayer = None
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):  # teardown goes on whatever one process does
                self.stop(proc)
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _kill_in(ns)
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        atexit.unregister(self.close)


def _kill_in(ns: str) -> None:
    """Kill whatever still runs in `ns` (started by a process of the box, then detached)."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + STOP_S
    while pids and time.monotonic() < deadline:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        time.sleep(0.05)


def sweep() -> list[str]:
    """Delete the namespaces of boxes whose process is gone (a run that was killed); returns their names."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _kill_in(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


__all__ = ["Box", "BoxError", "Host", "available", "sweep", "PUBLIC_NET"]
