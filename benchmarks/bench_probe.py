"""What the swarm benchmark observes: token times, each session step and its peers' compute, bytes on the
wire, process memory, and which TCP connections go through the delay proxy.

Invariants: probes only read (timers wrap a session by composition, counters are snapshots); nothing
here changes what the client or the peers do, except `StepTimer`'s optional counter reads between steps,
which happen only in runs that are not timed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.net import calls, wire
from swarm.errors import ConnectionLost


class TokenTimes:
    """A transformers streamer that only records when each new token came (the first call is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
        else:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def stats(self, started: float) -> dict:
        n = len(self.times)
        decode = self.times[-1] - self.times[0] if n > 1 else 0.0
        return {"ttft_s": self.times[0] - started, "tokens_per_s": (n - 1) / decode if decode > 0 else 0.0}


@dataclass
class Step:
    tokens: int
    ms: float  # the client's `InferenceSession.step`, all hops
    compute_ms: float  # sum of the peers' reported compute for it
    hops: int


@dataclass
class Counters:
    """Wire bytes of the client (in-process) and of each peer (from its info reply), at one moment."""

    client: dict[str, int]
    peers: dict[str, dict[str, int]]
    info_reply: dict[str, int] = field(default_factory=dict)  # per peer: bytes of the reply that carried it
    info_request: int = 0


class StepTimer:
    """Stands in for a `TokenSession`'s `InferenceSession`: times each step and sums its links' compute.

    With `count_bytes`, reads every peer's counters after the first step (the prefill)."""

    def __init__(self, inner, node=None, peers: list[str] = (), count_bytes: bool = False):
        self.inner, self.node, self.peers, self.count_bytes = inner, node, list(peers), count_bytes
        self.steps: list[Step] = []
        self.snapshots: list[Counters] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def step(self, hidden, position=None, attention_mask=None):
        started = time.perf_counter()
        out = await self.inner.step(hidden, position, attention_mask)
        ms = (time.perf_counter() - started) * 1e3
        links = self.inner.links
        compute = sum(float(getattr(link.session, "last_compute_ms", 0.0) or 0.0) for link in links if link.session)
        self.steps.append(Step(hidden.shape[1], ms, compute, len(links)))
        if self.count_bytes and not self.snapshots:  # after the prefill; the caller reads the last after the run
            self.snapshots.append(await self.counters())
        return out

    async def counters(self) -> Counters:
        snap = Counters({}, {})
        for peer in self.peers:
            before = wire.traffic()
            reply = await calls.info(self.node, peer)
            after = wire.traffic()
            snap.peers[peer] = dict(reply.wire_bytes or {"sent": 0, "received": 0})
            snap.info_reply[peer] = after["received"] - before["received"]
            snap.info_request = after["sent"] - before["sent"]
        snap.client = wire.traffic()
        return snap


INFO_TRIES = 3  # an info stream closed without a reply (seen about once in three smoke runs through the delay
# proxy) is tried again on a new stream, as a client's ping would be; a peer that fails every try fails the run


async def info_ms(node, peer: str, n: int) -> float:
    """Median time of `n` info calls to `peer`: a stream opened, one request, one reply. A call whose
    stream is lost is timed again (and said on stderr), up to `INFO_TRIES` times."""
    times = []
    for _ in range(n):
        for attempt in range(1, INFO_TRIES + 1):
            started = time.perf_counter()
            try:
                await calls.info(node, peer)
            except ConnectionLost as e:
                if attempt == INFO_TRIES:
                    raise
                print(f"[bench] info call to {peer[-8:]} lost ({e}); timing a new one", file=sys.stderr, flush=True)
                continue
            times.append((time.perf_counter() - started) * 1e3)
            break
    return statistics.median(times)


def decode_bytes(first: Counters, last: Counters) -> dict[str, int]:
    """Bytes sent between two snapshots by the client and by the peers, less the info calls' own."""
    client = last.client["sent"] - first.client["sent"] - last.info_request * len(last.peers)
    peers_sent = sum(last.peers[p]["sent"] - first.peers[p]["sent"] - first.info_reply[p] for p in first.peers)
    peers_received = sum(last.peers[p]["received"] - first.peers[p]["received"] - last.info_request
                         for p in first.peers)
    return {"client_sent": client, "peers_sent": peers_sent, "peers_received": peers_received,
            "peer_to_peer": max(0, peers_received - client)}


# ---- processes ----

def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def daemon_of(proc) -> int | None:
    """The transport daemon among a `swarm.local.launch.Proc`'s children."""
    for pid in proc.children():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
                return pid
        except OSError:
            continue
    return None


def memory(proc) -> dict[str, float]:
    """RSS and peak RSS of a peer process and RSS of its transport daemon, in MiB."""
    own = _status(proc.popen.pid)
    daemon = daemon_of(proc)
    return {"rss": own.get("VmRSS", 0) / 2**20, "peak": own.get("VmHWM", 0) / 2**20,
            "daemon": (_status(daemon).get("VmRSS", 0) / 2**20) if daemon else float("nan")}


def _sockets(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def tcp_table() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state hex, inode) of every IPv4 TCP socket in this network namespace."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        rows.append((int(cols[1].split(":")[1], 16), int(cols[2].split(":")[1], 16), cols[3], int(cols[9])))
    return rows


def connection_audit(daemons: dict[str, int], proxied: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """Which established connections between the named daemons go through a proxy port.

    `daemons`: name -> transport daemon pid; `proxied`: peer name -> its proxy's listening port. Returns
    `via_proxy` and `direct` lists of (from, to) names: a connection is direct when its far end is another
    daemon's own listening port; the side that accepts from a proxy sees the proxy's port, and is not counted."""
    rows = tcp_table()
    owner = {inode: name for name, pid in daemons.items() for inode in _sockets(pid)}
    listening = {lp: owner[ino] for lp, _, st, ino in rows if st == "0A" and ino in owner}
    by_proxy = {port: name for name, port in proxied.items()}
    out: dict[str, list[tuple[str, str]]] = {"via_proxy": [], "direct": []}
    for _, remote, state, inode in rows:
        if state != "01" or inode not in owner:
            continue
        # daemons dial from their own listening port (port reuse): only the far end tells a connection apart
        if remote in by_proxy:
            out["via_proxy"].append((owner[inode], by_proxy[remote]))
        elif remote in listening and listening[remote] != owner[inode]:
            out["direct"].append((owner[inode], listening[remote]))
    return out
