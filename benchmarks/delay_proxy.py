"""A delay proxy: TCP forwarders on 127.0.0.1 that add a round-trip time, to emulate a wide-area network.

Each forward listens on a port and relays every connection to a target port, holding each chunk for
rtt/2 in each direction, so a connection through it sees `rtt` more per round trip. Put one in front
of each peer (`swarm peer --port X --announce-port Y`, forward Y -> X): everyone dials the announced
port, and libp2p keeps one connection per pair of processes, so every pair sees the added time.

Invariants:
- bytes arrive unchanged and in order; a chunk read at time t is written at t + rtt/2, in order, so a
  chunk waits longer only while the far side does not read (never by queueing behind the delay);
- at most `max_in_flight` bytes wait per direction of a connection: reading pauses beyond that, so
  memory is bounded and TCP backpressure reaches the sender;
- an end of stream is passed on as a half-close after the bytes before it; an error on either side
  closes both sides; `aclose` closes every listener and connection;
- the delay may change while connections are open: chunks already waiting keep theirs;
- with a rate (`rate_mbit`, 0: none), each direction of a connection is a link of that bandwidth: a chunk
  starts to cross when the one before it has crossed, takes its size / rate, then the delay.

As a script (one process serving many forwards; LISTEN 0 takes any free port):

    python benchmarks/delay_proxy.py --rtt-ms 20 [--rate-mbit 100] LISTEN:TARGET [LISTEN:TARGET ...] [--control]

prints `forward 127.0.0.1:LISTEN -> 127.0.0.1:TARGET` per forward, then `ready`. With `--control` it
reads commands on stdin (`rtt MS`, `rate MBIT`, `stats`: one JSON line) and exits at their end; otherwise it runs
until SIGINT or SIGTERM. `ProxyProcess` drives such a process from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 64 * 2**10
MAX_IN_FLIGHT = 8 * 2**20  # per direction of one connection: a few of the swarm's biggest frames


@dataclass
class Forward:
    """One listening port and what went through it."""

    listen_port: int
    target_port: int
    server: asyncio.Server | None = None
    connections: int = 0  # accepted so far
    open: int = 0
    bytes_in: int = 0  # toward the target
    bytes_out: int = 0  # back from the target
    remotes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # source ports, latest

    def stats(self) -> dict:
        return {"listen": self.listen_port, "target": self.target_port, "connections": self.connections,
                "open": self.open, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "remotes": list(self.remotes)}


class DelayProxy:
    """`async with DelayProxy(rtt_ms=20) as proxy: fwd = await proxy.add(0, target_port)`."""

    def __init__(self, rtt_ms: float = 0.0, host: str = "127.0.0.1", max_in_flight: int = MAX_IN_FLIGHT,
                 rate_mbit: float = 0.0):
        if rtt_ms < 0 or max_in_flight < CHUNK or rate_mbit < 0:
            raise ValueError(f"rtt_ms and rate_mbit must be >= 0 (got {rtt_ms}, {rate_mbit}) and max_in_flight "
                             f">= {CHUNK} (got {max_in_flight})")
        self.rtt_ms, self.host, self.max_in_flight, self.rate_mbit = rtt_ms, host, max_in_flight, rate_mbit
        self.forwards: list[Forward] = []
        self._conns: set[asyncio.Task] = set()

    async def __aenter__(self) -> DelayProxy:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def add(self, listen_port: int, target_port: int) -> Forward:
        fwd = Forward(listen_port, target_port)
        fwd.server = await asyncio.start_server(lambda r, w: self._accept(fwd, r, w), self.host, listen_port)
        fwd.listen_port = fwd.server.sockets[0].getsockname()[1]
        self.forwards.append(fwd)
        return fwd

    def stats(self) -> dict:
        return {"rtt_ms": self.rtt_ms, "rate_mbit": self.rate_mbit, "forwards": [f.stats() for f in self.forwards]}

    async def aclose(self) -> None:
        for fwd in self.forwards:
            fwd.server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        for fwd in self.forwards:
            with contextlib.suppress(Exception):  # closing anyway
                await asyncio.wait_for(fwd.server.wait_closed(), 5)

    async def _accept(self, fwd: Forward, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        fwd.connections += 1
        fwd.open += 1
        fwd.remotes.append(writer.get_extra_info("peername")[1])
        writers = [writer]
        try:
            t_reader, t_writer = await asyncio.open_connection(self.host, fwd.target_port)
            writers.append(t_writer)
            for w in writers:
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tasks = [*self._pipe(reader, t_writer, fwd, "bytes_in"), *self._pipe(t_reader, writer, fwd, "bytes_out")]
            try:
                # an error on either side ends the connection: the other tasks are cancelled, both sides closed
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the target refused or a side reset: closing both is all there is to do
        except asyncio.CancelledError:
            pass  # `aclose`: the task ends here anyway (asyncio's server would log a cancelled handler)
        finally:
            fwd.open -= 1
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(Exception):  # the other side may already be gone
                    await asyncio.wait_for(w.wait_closed(), 2)
            self._conns.discard(task)

    def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fwd: Forward,
              counter: str) -> list[asyncio.Task]:
        """One direction: read chunks as they come, and have the loop write each at its arrival + rtt/2, in
        order (a timer per chunk flushes every chunk due by then, so ties never reorder). A task only reads;
        writing needs no task switch, so the proxy adds as little as it can beyond the delay itself."""
        loop = asyncio.get_running_loop()
        pending: collections.deque[tuple[float, bytes]] = collections.deque()
        room, done = asyncio.Event(), loop.create_future()
        waiting = 0
        free_at = 0.0  # when the link has sent everything before (with a rate)

        def flush() -> None:
            nonlocal waiting
            now = loop.time()
            while pending and pending[0][0] <= now:
                _, data = pending.popleft()
                if not data:  # end of stream: pass it on after the bytes before it
                    if not writer.is_closing() and writer.can_write_eof():
                        writer.write_eof()
                    if not done.done():
                        done.set_result(None)
                    return
                waiting -= len(data)
                if not writer.is_closing():
                    writer.write(data)
                    setattr(fwd, counter, getattr(fwd, counter) + len(data))
            room.set()

        async def read() -> None:
            nonlocal waiting, free_at
            while True:
                data = await reader.read(CHUNK)
                sent = loop.time()
                if self.rate_mbit > 0:
                    free_at = sent = max(sent, free_at) + len(data) * 8 / (self.rate_mbit * 1e6)
                due = sent + self.rtt_ms / 2e3
                pending.append((due, data))
                if due <= loop.time():
                    flush()
                else:
                    loop.call_at(due, flush)
                if not data:
                    await done
                    return
                waiting += len(data)
                while waiting > self.max_in_flight:  # held for the delay: wait for timers to write some
                    room.clear()
                    await room.wait()
                await writer.drain()  # the far side's own backpressure

        return [asyncio.ensure_future(read())]


class ProxyProcess:
    """The script run as a child process with `--control`: `set_rtt`, `stats`, `close` (by its PID).

    A process of its own, so the proxy's event loop never waits on the caller's interpreter lock."""

    def __init__(self, targets: list[int], rtt_ms: float = 0.0, timeout: float = 30.0, rate_mbit: float = 0.0):
        self.popen = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--rtt-ms", str(rtt_ms), "--rate-mbit", str(rate_mbit),
             "--control",
             *(f"0:{t}" for t in targets)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ports: dict[int, int] = {}  # target port -> listening port
        self._out: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_output, name="delay-proxy-output", daemon=True).start()
        try:
            for line in self._lines(timeout):
                if line == "ready":
                    break
                if line.startswith("forward "):
                    listen, target = (int(a.rsplit(":", 1)[1]) for a in line.split()[1::2])
                    self.ports[target] = listen
        except BaseException:
            self.close()
            raise

    def _lines(self, timeout: float):
        while True:
            try:
                line = self._out.get(timeout=timeout)
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"delay proxy (pid {self.popen.pid}) stopped answering")
            yield line.strip()

    def _read_output(self) -> None:
        for line in self.popen.stdout:
            self._out.put(line)
        self._out.put(None)

    def _ask(self, command: str) -> str:
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return next(self._lines(10))

    def set_rtt(self, rtt_ms: float) -> None:
        self._ask(f"rtt {rtt_ms}")

    def set_rate(self, rate_mbit: float) -> None:
        self._ask(f"rate {rate_mbit}")

    def stats(self) -> dict:
        return json.loads(self._ask("stats"))

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()  # end of commands: the proxy closes everything and exits
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _control(proxy: DelayProxy) -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := (await stdin.readline()).decode():
        cmd = line.split()
        if cmd[:1] == ["rtt"] and len(cmd) == 2:
            proxy.rtt_ms = max(0.0, float(cmd[1]))
            print(f"rtt {proxy.rtt_ms:g}", flush=True)
        elif cmd[:1] == ["rate"] and len(cmd) == 2:
            proxy.rate_mbit = max(0.0, float(cmd[1]))
            print(f"rate {proxy.rate_mbit:g}", flush=True)
        elif cmd == ["stats"]:
            print(json.dumps(proxy.stats()), flush=True)
        else:
            print(f"error: unknown command {line.strip()!r} (rtt MS | rate MBIT | stats)", flush=True)


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with DelayProxy(args.rtt_ms, rate_mbit=args.rate_mbit) as proxy:
        for pair in args.forwards:
            listen, target = (int(p) for p in pair.split(":"))
            fwd = await proxy.add(listen, target)
            print(f"forward {proxy.host}:{fwd.listen_port} -> {proxy.host}:{target}", flush=True)
        print("ready", flush=True)
        waits = [asyncio.ensure_future(stop.wait())]
        if args.control:
            waits.append(asyncio.ensure_future(_control(proxy)))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("forwards", nargs="+", metavar="LISTEN:TARGET", help="ports on 127.0.0.1 (LISTEN 0: any free)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added to every connection")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth of each direction of each connection, "
                    "in Mbit/s (0: unlimited)")
    ap.add_argument("--control", action="store_true", help="read commands on stdin; exit at its end")
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
