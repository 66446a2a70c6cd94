"""Distance for the internet in a box: one process in the public segment's namespace holds every packet
that crosses the segment for the one-way delay between its source's and its destination's regions.

The segment's namespace routes every packet between hosts (`netbox.Box`); with regions, a policy rule sends
each of them into a TUN device instead (`dly0`), where this process reads it, and writes it back after the
delay; a packet coming out of the TUN is routed on as usual. It works below TCP and UDP, so every connection
of every process sees the delay, ports and addresses unchanged (a home router's NAT behaves as without it).

Run as `python box_delay.py TUN` in the segment's namespace; commands on stdin, one per line, each answered
by one line on stdout:
    host ADDRESS REGION     packets from and to ADDRESS belong to REGION        -> ok
    delay R1 R2 MS          one-way delay between R1 and R2 (both ways; R1 == R2: within a region) -> ok
    stats                   -> one JSON line: packets and bytes held, by pair of regions
`ready` is printed once the TUN exists. It exits at the end of stdin (the box closes it) or on SIGTERM.

Invariants: a packet leaves in the order it came among packets of the same delay (a FIFO per delay, so TCP
sees no reordering); a packet between addresses of no known region passes at once; delays may change at
any time (packets already held keep theirs); at most `MAX_HELD` bytes are held, beyond which packets are
dropped (as a full router queue drops them; TCP resends).
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import os
import signal
import struct
import sys

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_HELD = 64 * 2**20
BATCH = 256  # packets read per wake-up at most


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Delayer:
    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop):
        self.fd, self.loop = fd, loop
        self.region: dict[bytes, str] = {}  # packed IPv4 address -> region
        self.delay_s: dict[tuple[str, str], float] = {}
        self.queues: dict[float, collections.deque] = {}
        self.held = 0
        self.counts: collections.Counter = collections.Counter()  # (region pair, "packets" | "bytes" | "dropped")

    def readable(self) -> None:
        for _ in range(BATCH):
            try:
                packet = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            self.route(packet)

    def route(self, packet: bytes) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return self.send(packet)  # not IPv4: nothing of the box, passed on
        source, dest = self.region.get(packet[12:16]), self.region.get(packet[16:20])
        delay = self.delay_s.get((source, dest), 0.0) if source and dest else 0.0
        pair = f"{source}>{dest}"
        if delay <= 0:
            self.counts[pair, "packets"] += 1
            return self.send(packet)
        if self.held + len(packet) > MAX_HELD:
            self.counts[pair, "dropped"] += 1
            return
        self.counts[pair, "packets"] += 1
        self.counts[pair, "bytes"] += len(packet)
        queue = self.queues.setdefault(delay, collections.deque())
        queue.append((self.loop.time() + delay, packet))
        self.held += len(packet)
        if len(queue) == 1:
            self.loop.call_at(queue[0][0], self.flush, queue)

    def flush(self, queue: collections.deque) -> None:
        now = self.loop.time()
        while queue and queue[0][0] <= now + 1e-4:
            _, packet = queue.popleft()
            self.held -= len(packet)
            self.send(packet)
        if queue:
            self.loop.call_at(queue[0][0], self.flush, queue)

    def send(self, packet: bytes) -> None:
        try:
            os.write(self.fd, packet)
        except OSError:
            pass  # as a lost packet: the transport above resends

    def command(self, line: str) -> str:
        words = line.split()
        if words[:1] == ["host"] and len(words) == 3:
            self.region[bytes(int(x) for x in words[1].split("."))] = words[2]
            return "ok"
        if words[:1] == ["delay"] and len(words) == 4:
            seconds = float(words[3]) / 1e3
            self.delay_s[words[1], words[2]] = self.delay_s[words[2], words[1]] = seconds
            return "ok"
        if words == ["stats"]:
            stats: dict = {}
            for (pair, kind), n in self.counts.items():
                stats.setdefault(pair, {})[kind] = n
            return json.dumps(stats)
        return f"error: unknown command {line.strip()!r}"


async def main(name: str) -> None:
    loop = asyncio.get_running_loop()
    delayer = Delayer(open_tun(name), loop)
    loop.add_reader(delayer.fd, delayer.readable)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)

    async def commands() -> None:
        while line := await reader.readline():
            try:
                answer = delayer.command(line.decode())
            except (ValueError, IndexError) as e:  # a malformed address or number: answered, never left unanswered
                answer = f"error: {line.decode().strip()!r}: {e}"
            print(answer, flush=True)
        stop.set()

    task = asyncio.ensure_future(commands())
    await stop.wait()
    task.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
