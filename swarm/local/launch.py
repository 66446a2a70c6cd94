"""A real swarm on this machine: a bootstrap process and peer processes, for the demo, tests and
benchmarks.

Every process is started here and stopped by PID; every wait is a predicate with a deadline.
Peer identities are created here, so each peer's id is known before it starts. Logs go to files in
the swarm's directory and are shown when a wait fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm.net.identity import load_or_create

METRICS_LINE = re.compile(r"peer \S+ metrics at (http://\S+/metrics)")
SPAN_LINE = re.compile(r"peer \S+ (?:serving blocks|moved from blocks \S+ to) \[(\d+):(\d+)\)")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def cpu_quota_supported() -> bool:
    """Whether this machine lets us cap a process's CPU (cgroup v1 cpu controller, as root)."""
    return os.geteuid() == 0 and (CGROUP_CPU / "cgroup.procs").exists()

def wait_until(predicate, timeout: float, what: str, interval: float = 0.1, diagnostics=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnostics()}")
        time.sleep(interval)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    peer_id: str = ""
    extra: dict = field(default_factory=dict)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def span(self) -> tuple[int, int] | None:
        """The span this peer serves now, from its log (its last 'serving' or 'moved' line)."""
        found = SPAN_LINE.findall(self.text())
        return (int(found[-1][0]), int(found[-1][1])) if found else None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def children(self) -> list[int]:
        """PIDs of this process's direct children (the transport daemon, the reaper)."""
        try:
            tasks = Path(f"/proc/{self.popen.pid}/task")
            return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]
        except OSError:
            return []


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LocalSwarm:
    def __init__(self, root: Path, verbose: bool = False):
        """`verbose`: every process logs debug messages too (`swarm -v`)."""
        self.root = root
        self.verbose = verbose
        self.root.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.bootstrap_addrs: list[str] = []
        self.cgroups: list[Path] = []

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str] | None = None,
               program: Sequence[str] = ("-m", "swarm.cli")) -> Proc:
        log = self.root / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_HOME": str(self.root / "home"), **(env or {})}
        with open(log, "wb") as out:
            command = [sys.executable, *program, *(["-v"] if self.verbose else []), *args]
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def start_bootstrap(self, name: str = "bootstrap", *extra: str, timeout: float = 60,
                        program: Sequence[str] = ("-m", "swarm.cli")) -> Proc:
        """A bootstrap process; `program`: what runs the command line (as in `start_peer`)."""
        identity = self.root / f"{name}.key"
        proc = self._spawn(name, ["bootstrap", "--identity", str(identity), *extra], program=program)
        proc.peer_id = load_or_create(identity).peer_id if identity.exists() else ""

        def addrs():
            lines = [ln for ln in proc.text().splitlines() if ln.startswith("/ip4/")]
            if not proc.alive():
                raise RuntimeError(f"{name} exited:\n{proc.text()[-3000:]}")
            return lines

        proc.extra["maddrs"] = wait_until(addrs, timeout, f"{name} to print its address", diagnostics=proc.text)
        proc.peer_id = load_or_create(identity).peer_id
        if "--monitor-port" in extra:
            proc.extra["monitor_url"] = self._wait_url(proc, "monitor at ", timeout)
        if name == "bootstrap":
            self.bootstrap_addrs = proc.extra["maddrs"]
        return proc

    def start_peer(self, name: str, model: Path, *extra: str, wait: bool = True, timeout: float = 120,
                   env: Mapping[str, str] | None = None, program: Sequence[str] = ("-m", "swarm.cli")) -> Proc:
        """A peer process; `env`: variables added to its environment (e.g. `OMP_NUM_THREADS`); `program`: what
        runs the command line (tests run altered peers this way)."""
        identity = self.root / f"{name}.key"
        peer_id = load_or_create(identity).peer_id
        host = [] if "--host" in extra else ["--host", "127.0.0.1"]  # a local swarm: this machine only
        proc = self._spawn(name, ["peer", "--model", str(model), "--initial-peers", *self.bootstrap_addrs,
                                  "--identity", str(identity), *host, *extra], env, program)
        proc.peer_id = peer_id
        if wait:
            self.wait_serving(proc, timeout)
        return proc

    def wait_serving(self, proc: Proc, timeout: float = 120) -> None:
        def ready():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.text()[-3000:]}")
            return "serving blocks" in proc.text()

        wait_until(ready, timeout, f"{proc.name} to serve", diagnostics=lambda: proc.text()[-3000:])

    def start_api(self, name: str, model: Path | str | None, *extra: str, timeout: float = 120,
                  env: Mapping[str, str] | None = None) -> Proc:
        """`swarm api` for `model` (None: only what `extra` names) joined to this swarm, on a free port; its base
        URL is `extra["url"]`; `env`: variables added to its environment."""
        models = ["--model", str(model)] if model is not None else []
        proc = self._spawn(name, ["api", *models, "--initial-peers", *self.bootstrap_addrs, "--port", "0", *extra],
                           env)
        proc.extra["url"] = self._wait_url(proc, "api at ", timeout)
        return proc

    def start_monitor(self, name: str = "monitor", *extra: str, timeout: float = 60) -> Proc:
        """`swarm monitor` joined to this swarm, on a free port; its page's URL is `extra["url"]`."""
        proc = self._spawn(name, ["monitor", "--initial-peers", *self.bootstrap_addrs, "--port", "0", *extra])
        proc.extra["url"] = self._wait_url(proc, "monitor at ", timeout)
        return proc

    def metrics_url(self, proc: Proc, timeout: float = 30) -> str:
        """The `/metrics` URL a peer started with `--metrics-port` logs once it serves them."""
        def url():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.text()[-3000:]}")
            found = METRICS_LINE.search(proc.text())
            return found and found.group(1)

        return wait_until(url, timeout, f"{proc.name} to log its metrics URL", diagnostics=lambda: proc.text()[-3000:])

    def _wait_url(self, proc: Proc, prefix: str, timeout: float) -> str:
        """The URL that `proc` prints on a line starting with `prefix` once it serves."""
        def url():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.text()[-3000:]}")
            return next((ln.split()[-1] for ln in proc.text().splitlines() if ln.startswith(prefix)), None)

        return wait_until(url, timeout, f"{proc.name} to print '{prefix.strip()} URL'",
                          diagnostics=lambda: proc.text()[-3000:])

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        proc = self.procs[name]
        if proc.alive():
            proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            return proc.popen.wait(10)

    def stop_all(self) -> None:
        """Stop every process: all but the first started at once (each says goodbye to the swarm while the
        first, the bootstrap, still carries it), then the first."""
        names = list(self.procs)
        for name in names[:0:-1]:
            if self.procs[name].alive():
                self.procs[name].popen.send_signal(signal.SIGTERM)
        for name in names[:0:-1] + names[:1]:
            self.stop(name)
        for group in self.cgroups:
            with contextlib.suppress(OSError):
                group.rmdir()  # empty once its process exited
        self.cgroups.clear()

    def throttle(self, proc: Proc, share: float) -> None:
        """Cap `proc` at `share` of one CPU core (a cgroup v1 CPU quota; root only): an unequal machine."""
        group = CGROUP_CPU / f"swarm-{os.getpid()}-{proc.popen.pid}"
        group.mkdir(exist_ok=True)
        self.cgroups.append(group)
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * share))))
        (group / "cgroup.procs").write_text(str(proc.popen.pid))

    def unthrottle(self, proc: Proc) -> None:
        """Lift `throttle`: the process goes back to the root CPU group (its own group is removed at `stop_all`)."""
        (CGROUP_CPU / "cgroup.procs").write_text(str(proc.popen.pid))

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
