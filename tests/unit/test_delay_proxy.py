"""The benchmarks' delay proxy: an echo server behind it sees every byte in order, and a round trip
through it takes the set delay more, not much more."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from delay_proxy import DelayProxy, ProxyProcess  # noqa: E402


async def echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()  # after the client's end of stream: ours follows it through the proxy

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def ping_ms(reader, writer) -> float:
    started = time.perf_counter()
    writer.write(b"x")
    await writer.drain()
    assert await reader.readexactly(1) == b"x"
    return (time.perf_counter() - started) * 1e3


def test_payload_integrity_and_round_trip():
    async def main():
        server, port = await echo_server()
        async with server, DelayProxy(rtt_ms=20) as proxy:
            fwd = await proxy.add(0, port)
            reader, writer = await asyncio.open_connection("127.0.0.1", fwd.listen_port)
            rtts = [await ping_ms(reader, writer) for _ in range(7)]
            assert 20 <= statistics.median(rtts) < 20 + 15, rtts
            assert min(rtts) >= 20, rtts

            payload = os.urandom(2**20)
            started = time.perf_counter()
            send = asyncio.ensure_future(writer.drain())
            writer.write(payload)
            await send
            echoed = await reader.readexactly(len(payload))
            assert echoed == payload
            assert time.perf_counter() - started < 2.0  # the delay is paid once, not once per chunk

            proxy.rtt_ms = 60  # a live change applies to what arrives afterwards
            assert statistics.median([await ping_ms(reader, writer) for _ in range(3)]) >= 60

            writer.write_eof()  # our end of stream reaches the server, its close comes back
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            assert fwd.connections == 1 and fwd.bytes_in == fwd.bytes_out == len(payload) + 10
            for _ in range(50):  # the proxy closes its side once both directions ended
                if fwd.open == 0:
                    break
                await asyncio.sleep(0.02)
            assert fwd.open == 0

    asyncio.run(main())


def test_a_rate_limit_makes_a_transfer_take_its_size_over_the_rate():
    async def main():
        server, port = await echo_server()
        async with server, DelayProxy(rtt_ms=10, rate_mbit=40) as proxy:  # 5 MB/s each way
            fwd = await proxy.add(0, port)
            reader, writer = await asyncio.open_connection("127.0.0.1", fwd.listen_port)
            assert 10 <= await ping_ms(reader, writer) < 10 + 15  # one byte: the delay alone
            payload = os.urandom(2**20)
            started = time.perf_counter()
            writer.write(payload)
            echoed = await reader.readexactly(len(payload))
            took = time.perf_counter() - started
            assert echoed == payload
            # 1 MiB at 5 MB/s is 0.21 s one way; the echo pipelines behind it (chunks cross both links at once)
            assert 0.2 <= took < 0.2 + 0.6, took
            writer.close()

    asyncio.run(main())


def test_backpressure_bounds_what_waits():
    async def main():
        got = asyncio.Event()
        async def slow(reader, writer):  # reads nothing until told
            await got.wait()
            total = 0
            while data := await reader.read(65536):
                total += len(data)
            writer.write(str(total).encode())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(slow, "127.0.0.1", 0)
        async with server, DelayProxy(rtt_ms=0, max_in_flight=2**17) as proxy:
            fwd = await proxy.add(0, server.sockets[0].getsockname()[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", fwd.listen_port)
            writer.write(b"y" * 2**24)
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
                drained = True
            except asyncio.TimeoutError:
                drained = False
            assert not drained  # the proxy stopped reading: 16 MiB cannot all sit in it or the kernel buffers
            got.set()
            await writer.drain()
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 10) == str(2**24).encode()
            writer.close()

    asyncio.run(main())


def test_proxy_process_forwards_and_exits():
    async def main():
        server, port = await echo_server()
        async with server:
            proxy = await asyncio.to_thread(ProxyProcess, [port], 10)
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[port])
                assert statistics.median([await ping_ms(reader, writer) for _ in range(5)]) >= 10
                await asyncio.to_thread(proxy.set_rtt, 0)
                assert statistics.median([await ping_ms(reader, writer) for _ in range(5)]) < 10
                stats = await asyncio.to_thread(proxy.stats)
                assert stats["forwards"][0]["connections"] == 1
                writer.close()
            finally:
                await asyncio.to_thread(proxy.close)
            assert proxy.popen.returncode == 0

    asyncio.run(main())
