"""A swarm inside a `netbox.Box`: a bootstrap, peers and clients, each a process on a host of the box.

The test process itself stays outside the box (it cannot reach the box's addresses at all): it starts
processes in the hosts' namespaces, reads their logs, and talks to clients through `box_client.py` (one
JSON event per line on stdout, a line on stdin to go on after a pause).

Invariants: every process is started through the box, so `Box.close` stops it whatever happens; every
wait has a deadline and says, when it runs out, what it waited for with the tail of the relevant logs;
each process has a cache home of its own (`SWARM_HOME`: capacity cache, known peers), as it would on a
machine of its own; identities are made here, so every peer id is known before its process starts.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from netbox import Box, Host
from swarm.local.launch import wait_until
from swarm.net.identity import load_or_create

REPO = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).resolve().parent / "box_client.py"
BOOT_PORT = 31337
PEER_PORT = 31338  # public peers listen on a fixed port, so their address is known before they start
TAIL = 3000


@dataclass
class BoxProc:
    name: str
    host: Host
    popen: subprocess.Popen
    log: Path
    peer_id: str = ""
    addr: str = ""  # a full multiaddr on the public segment, where one is known
    started: float = field(default_factory=time.monotonic)
    extra: dict = field(default_factory=dict)  # what a caller notes about it

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = TAIL) -> str:
        return f"--- {self.name} ({self.host.name}, {self.host.address}) ---\n{self.text()[-n:]}"

    def alive(self) -> bool:
        return self.popen.poll() is None


class ClientRun:
    """One `box_client.py` process: its JSON events as they come, its log (stderr) in a file."""

    def __init__(self, proc: BoxProc):
        self.proc = proc
        self.events: list[dict] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.popen.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._queue.put(json.loads(line))
        self._queue.put({"event": "exit"})

    def expect(self, event: str, timeout: float) -> dict:
        """The next event named `event` (or a final "done"/"error"/"exit" instead), within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for client {self.proc.name} to "
                                   f"report {event!r}\n{self.proc.tail()}") from None
            self.events.append(item)
            if item["event"] in (event, "done", "error", "exit"):
                return item

    def go(self) -> None:
        """Let a paused generation go on."""
        self.proc.popen.stdin.write("go\n")
        self.proc.popen.stdin.flush()


class BoxSwarm:
    def __init__(self, box: Box, root: Path, model: Path, model_id: str, peer_options: tuple[str, ...] = (),
                 repo: Path = REPO):
        """`repo`: the source tree the processes run (another checkout, to compare two versions)."""
        self.box, self.root, self.model, self.model_id, self.repo = box, root, model, model_id, repo
        self.peer_options = peer_options
        self.procs: dict[str, BoxProc] = {}
        root.mkdir(parents=True, exist_ok=True)

    # ---- processes ----

    def env(self, name: str) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_HOME": str(self.root / name / "home"),
                "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(self.repo)}

    def spawn(self, name: str, host: Host, argv: list[str], *, client: bool = False) -> BoxProc:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        log = self.root / name / "log.txt"
        with open(log, "wb") as out:
            if client:
                popen = self.box.spawn(host, argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=out,
                                       text=True, env=self.env(name), cwd=self.repo)
            else:
                popen = self.box.spawn(host, argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(name),
                                       cwd=self.repo)
        proc = self.procs[name] = BoxProc(name, host, popen, log)
        return proc

    def identity(self, name: str) -> tuple[Path, str]:
        path = self.root / name / "identity.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, load_or_create(path).peer_id

    def bootstrap(self, host: Host, *extra: str, name: str = "bootstrap", timeout: float = 30) -> BoxProc:
        """`swarm bootstrap --host 0.0.0.0` on `host`; returns once it printed its address on the public
        segment (`proc.addr`)."""
        key, peer_id = self.identity(name)
        proc = self.spawn(name, host, [sys.executable, "-m", "swarm.cli", "bootstrap", "--host", "0.0.0.0", "--port",
                                       str(BOOT_PORT), "--identity", str(key), *extra])
        proc.peer_id = peer_id

        def public_addr():
            if not proc.alive():
                raise RuntimeError(f"{name} exited\n{proc.tail()}")
            return next((ln.strip() for ln in proc.text().splitlines()
                         if ln.startswith(f"/ip4/{host.address}/") and "/p2p/" in ln), None)

        proc.addr = wait_until(public_addr, timeout, f"{name} to print an address on {host.address}", diagnostics=proc.tail)
        return proc

    def peer(self, name: str, host: Host, blocks: str | None, initial_peers: list[str], *extra: str) -> BoxProc:
        """`swarm peer` serving `blocks` (None: the placement chooses) on `host` (not waited for: see `wait_serving`), listening where a peer
        listens by default (every interface). A public peer listens on `PEER_PORT`, so its address
        (`proc.addr`) is known at once."""
        key, peer_id = self.identity(name)
        port = ("--port", str(PEER_PORT)) if host.public else ()
        proc = self.spawn(name, host, [sys.executable, "-m", "swarm.cli", "peer", "--model", str(self.model),
                                       "--model-id", self.model_id, "--initial-peers", *initial_peers,
                                       "--identity", str(key), *(("--blocks", blocks) if blocks else ()), *port,
                                       "--threads", "1", *self.peer_options, *extra])
        proc.peer_id = peer_id
        if host.public:
            proc.addr = f"/ip4/{host.address}/tcp/{PEER_PORT}/p2p/{peer_id}"
        return proc

    def wait_log(self, proc: BoxProc, needle: str, timeout: float) -> None:
        def seen():
            if needle in proc.text():
                return True
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited before logging {needle!r}\n{proc.tail()}")
            return False

        wait_until(seen, timeout, f"{proc.name} to log {needle!r}", diagnostics=proc.tail)

    def wait_serving(self, procs: list[BoxProc], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        for proc in procs:
            self.wait_log(proc, "serving blocks", max(1.0, deadline - time.monotonic()))

    def client(self, name: str, host: Host, initial_peers: list[str], prompt: list[int], new_tokens: int, *,
               pause_after: int | None = None, debug: bool = False, probe: tuple[str, ...] = (),
               **config) -> ClientRun:
        """`box_client.py` on `host`: joins, generates greedily, reports (see that module); `config`: settings of
        `ClientConfig`; `debug`: its log has debug messages too; `probe`: peers it calls once more if it fails."""
        argv = [sys.executable, str(CLIENT), "--model", str(self.model), "--model-id", self.model_id,
                "--initial-peers", *initial_peers, "--prompt", ",".join(map(str, prompt)),
                "--new-tokens", str(new_tokens), "--config", json.dumps(config)]
        if pause_after is not None:
            argv += ["--pause-after", str(pause_after)]
        if debug:
            argv.append("--debug")
        if probe:
            argv += ["--probe", *probe]
        return ClientRun(self.spawn(name, host, argv, client=True))

    def status(self, host: Host, initial_peers: list[str], as_json: bool = True, timeout: float = 60) -> dict | str:
        """`swarm status` of the model, run on `host`: its JSON, or (`as_json=False`) its table."""
        name = f"status-{len(self.procs)}"
        (self.root / name).mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "swarm.cli", "status", "--model", str(self.model), "--model-id", self.model_id,
                "--initial-peers", *initial_peers, *(["--json"] if as_json else [])]
        done = subprocess.run(self.box.command(host, argv), capture_output=True, text=True, timeout=timeout,
                              env=self.env(name), cwd=self.repo)
        if done.returncode != 0:
            raise RuntimeError(f"swarm status failed ({done.returncode}):\n{done.stderr[-TAIL:]}")
        return json.loads(done.stdout) if as_json else done.stdout

    def kill(self, proc: BoxProc, sig: int = signal.SIGKILL) -> None:
        """`sig` to the process's whole group (its transport daemon and reaper with it)."""
        self.box.stop(proc.popen, sig)

    def diagnostics(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())


def note_lines(procs: list[BoxProc], patterns: tuple[str, ...], until, timeout: float) -> None:
    """Poll `procs`' logs, noting in `proc.extra[pattern]` the seconds from its start to the first line matching
    each pattern (regular expressions; log lines carry whole seconds only, so lines are timed when first seen,
    every 50 ms), until `until()` or `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            text = proc.text()
            for pattern in patterns:
                if pattern not in proc.extra and re.search(pattern, text):
                    proc.extra[pattern] = time.monotonic() - proc.started
        if until():
            return
        time.sleep(0.05)


__all__ = ["BoxProc", "BoxSwarm", "ClientRun", "wait_until", "note_lines", "BOOT_PORT", "PEER_PORT"]
