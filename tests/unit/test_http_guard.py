"""The guarded HTTP server, served for real on 127.0.0.1 and driven with raw sockets: the connection cap and
its eviction, the 503 when every connection is busy, the header and body deadlines, and handler
cancellation when a client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import pytest
from aiohttp import web

from swarm import http

pytestmark = pytest.mark.unit

GET_OK = b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n"
Routes = dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]


async def ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def serving(limits: http.Limits, routes: Routes | None = None,
                  host: str = "127.0.0.1") -> AsyncIterator[http.HttpServer]:
    app = http.make_app(limits)
    for path, handler in {"/ok": ok, **(routes or {})}.items():
        app.router.add_route("*", path, handler)
    server = await http.start(app, host, 0, limits)
    try:
        yield server
    finally:
        await asyncio.wait_for(server.close(), 10)


def run(coro, limit: float = 15.0):
    """Runs a test's coroutine on a fresh loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, limit))


async def connect(server: http.HttpServer, first: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if first:
        writer.write(first)
        await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader, timeout: float = 3.0) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout)
    return int(status_line.split()[1]), headers, body


async def seconds_until_closed(reader: asyncio.StreamReader, within: float) -> float:
    """Reads to the end of the connection; how long it took. Fails if it stays open `within` seconds."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        await asyncio.wait_for(reader.read(), within)
    return time.monotonic() - started


async def still_open(reader: asyncio.StreamReader, for_s: float = 0.2) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(1), for_s)
    except asyncio.TimeoutError:
        return True
    except ConnectionResetError:
        return False
    return bool(data)


async def wait_until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def close_all(*writers: asyncio.StreamWriter) -> None:
    for w in writers:
        w.close()


# ---- the connection cap ----

def test_at_the_cap_the_longest_waiting_connection_is_evicted():
    async def main():
        async with serving(http.Limits(max_connections=2, header_timeout=10)) as server:
            guard = server.guard
            old_r, old_w = await connect(server, b"GET /ok HTTP/1.1\r\n")  # headers never finished
            await wait_until(lambda: guard.open_connections() == 1)
            await asyncio.sleep(0.02)  # a clearly later start for the second one
            new_r, new_w = await connect(server, b"GET /ok HTTP/1.1\r\n")
            await wait_until(lambda: guard.open_connections() == 2)

            r, w = await connect(server, GET_OK)
            assert (await read_response(r))[::2] == (200, b"ok")
            assert await seconds_until_closed(old_r, 2.0) < 2.0  # EOF: evicted
            assert await still_open(new_r)
            assert guard.evicted == 1
            new_w.write(b"Host: test\r\n\r\n")  # the newer slow connection still works
            assert (await read_response(new_r))[::2] == (200, b"ok")
            close_all(old_w, new_w, w)

    run(main())


def test_a_burst_of_connections_does_not_exceed_the_cap():
    async def main():
        limits = http.Limits(max_connections=3, header_timeout=10)
        async with serving(limits) as server:
            guard = server.guard
            # as many as the listen backlog holds (twice the cap): more would wait for SYN retries
            burst = await asyncio.gather(*(connect(server) for _ in range(2 * limits.max_connections)))
            # each one is either refused, or accepted and then open or evicted
            await wait_until(lambda: guard.refused + guard.evicted + guard.open_connections() >= len(burst))
            live = [c for c in guard.server.connections if c.transport is not None]
            assert len(live) <= limits.max_connections
            assert guard.open_connections() <= limits.max_connections
            r, w = await connect(server, GET_OK)  # a real client still gets in
            assert (await read_response(r))[0] == 200
            close_all(w, *(w for _, w in burst))

    run(main())


def test_a_real_request_accepted_in_a_burst_evicts_a_connection_of_the_same_burst():
    async def main():
        limits = http.Limits(max_connections=3, header_timeout=10)
        async with serving(limits) as server:
            guard = server.guard
            # blocking connects from the loop's own thread: the kernel completes them all, and the server
            # accepts them in one burst once the loop runs again, with none of them listed yet
            slow = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(limits.max_connections)]
            for s in slow:
                s.sendall(b"GET /ok HTTP/1.1\r\n")  # headers never finished
            real = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            real.sendall(GET_OK)
            real.setblocking(False)
            r, w = await asyncio.open_connection(sock=real)
            assert (await read_response(r))[::2] == (200, b"ok")
            assert guard.refused == 0 and guard.evicted == 1
            close_all(w)
            for s in slow:
                s.close()

    run(main())


def blocking_route() -> tuple[asyncio.Event, list[int], Routes]:
    """`/block` waits for the event; `entered` counts the handlers that started."""
    release, entered = asyncio.Event(), []

    async def block(_request):
        entered.append(1)
        await release.wait()
        return web.Response(text="done")

    return release, entered, {"/block": block}


@contextlib.asynccontextmanager
async def released(event: asyncio.Event) -> AsyncIterator[None]:
    try:
        yield
    finally:
        event.set()  # a handler still blocked would hold up the server's shutdown


def test_when_every_connection_is_in_a_handler_a_new_one_gets_503():
    async def main():
        release, entered, routes = blocking_route()
        async with serving(http.Limits(max_connections=2, header_timeout=10), routes) as server, released(release):
            guard = server.guard
            busy = [await connect(server, b"GET /block HTTP/1.1\r\nHost: test\r\n\r\n") for _ in range(2)]
            await wait_until(lambda: len(entered) == 2)

            r, w = await connect(server, GET_OK)
            raw = await asyncio.wait_for(r.read(), 3.0)  # answered, then closed
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503")
            assert b"Retry-After: 1" in head
            error = json.loads(body)["error"]
            assert error["type"] == "server_busy" and error["code"] == "too_many_connections"
            assert set(error) == {"message", "type", "param", "code"}
            assert guard.refused == 1 and guard.evicted == 0
            close_all(w)

            release.set()
            for br, _ in busy:
                assert (await read_response(br))[::2] == (200, b"done")
            r, w = await connect(server, GET_OK)  # accepted again: an idle keep-alive one makes room
            assert (await read_response(r))[::2] == (200, b"ok")
            assert guard.evicted == 1
            close_all(w, *(bw for _, bw in busy))

    run(main())


def test_a_refused_client_that_sent_its_request_first_still_reads_the_503():
    """A plain blocking client sends the whole request, then reads: the 503 must not be lost to a reset."""
    def client(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(b"POST /ok HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\n\r\nhello")
            time.sleep(0.1)  # the server has refused and closed its side by now
            data = b""
            for _ in range(100):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data

    async def main():
        release, entered, routes = blocking_route()
        async with serving(http.Limits(max_connections=1, header_timeout=10), routes) as server, released(release):
            br, bw = await connect(server, b"GET /block HTTP/1.1\r\nHost: test\r\n\r\n")
            await wait_until(lambda: len(entered) == 1)
            for _ in range(3):
                answer = await asyncio.to_thread(client, server.port)
                assert answer.startswith(b"HTTP/1.1 503")
            assert server.guard.refused == 3
            release.set()
            assert (await read_response(br))[0] == 200
            close_all(bw)

    run(main())


# ---- the header deadline ----

def test_a_connection_without_complete_headers_is_closed_after_the_header_timeout():
    async def main():
        async with serving(http.Limits(header_timeout=0.5)) as server:
            r, w = await connect(server, b"GET /ok HTTP/1.1\r\nHost: te")
            took = await seconds_until_closed(r, 3.0)
            assert 0.4 <= took <= 1.5
            assert server.guard.timed_out == 1
            close_all(w)

    run(main())


def test_headers_that_trickle_in_are_still_cut_at_the_deadline():
    async def main():
        async with serving(http.Limits(header_timeout=0.5)) as server:
            r, w = await connect(server)
            started = time.monotonic()
            closed = False
            for byte in GET_OK[:-4]:  # one byte every 50 ms: never idle, never done
                try:
                    w.write(bytes([byte]))
                    await w.drain()
                except ConnectionError:
                    closed = True
                    break
                if not await still_open(r, 0.05):
                    closed = True
                    break
            assert closed
            assert time.monotonic() - started <= 1.5
            assert server.guard.timed_out == 1
            close_all(w)

    run(main())


def test_an_idle_keep_alive_connection_is_closed_after_the_header_timeout():
    async def main():
        async with serving(http.Limits(header_timeout=0.5)) as server:
            r, w = await connect(server, GET_OK)
            status, headers, _ = await read_response(r)
            assert status == 200 and headers.get("connection", "keep-alive").lower() != "close"
            took = await seconds_until_closed(r, 3.0)
            assert 0.3 <= took <= 1.5
            assert server.guard.timed_out == 1  # by the guard, not aiohttp's slower keep-alive timer
            close_all(w)

    run(main())


def test_time_inside_a_handler_does_not_count_against_the_header_timeout():
    async def slow(_request):
        await asyncio.sleep(0.8)
        return web.Response(text="slow")

    async def main():
        async with serving(http.Limits(header_timeout=0.3), {"/slow": slow}) as server:
            r, w = await connect(server, b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n")
            assert (await read_response(r))[::2] == (200, b"slow")
            assert server.guard.timed_out == 0
            close_all(w)

    run(main())


# ---- request bodies ----

def body_routes(limits: http.Limits, outcomes: list[str]) -> Routes:
    async def echo_length(request):
        try:
            data = await http.read_body(request, limits)
        except asyncio.TimeoutError:
            outcomes.append("timeout")
            return web.Response(status=408, text="slow body")
        except web.HTTPRequestEntityTooLarge:
            outcomes.append("too large")
            raise
        outcomes.append("read")
        return web.Response(text=str(len(data)))

    return {"/body": echo_length}


def test_a_declared_oversize_body_is_refused_without_reading_it():
    async def main():
        limits, outcomes = http.Limits(max_body_bytes=1000, body_timeout=5.0, header_timeout=5.0), []
        async with serving(limits, body_routes(limits, outcomes)) as server:
            r, w = await connect(server, b"POST /body HTTP/1.1\r\nHost: test\r\nContent-Length: 1000000000\r\n\r\n")
            started = time.monotonic()
            assert (await read_response(r, timeout=3.0))[0] == 413  # not one body byte was sent
            assert time.monotonic() - started < 2.0
            assert outcomes == ["too large"]
            close_all(w)

    run(main())


def test_an_oversize_chunked_body_is_refused_by_the_application_cap():
    async def main():
        limits, outcomes = http.Limits(max_body_bytes=1000, body_timeout=5.0, header_timeout=5.0), []
        async with serving(limits, body_routes(limits, outcomes)) as server:
            chunk = b"x" * 2000
            r, w = await connect(server, b"POST /body HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
            assert (await read_response(r))[0] == 413
            assert outcomes == ["too large"]
            close_all(w)

    run(main())


def test_a_body_within_the_limits_is_read():
    async def main():
        limits, outcomes = http.Limits(max_body_bytes=1000, body_timeout=2.0, header_timeout=2.0), []
        async with serving(limits, body_routes(limits, outcomes)) as server:
            r, w = await connect(server, b"POST /body HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n"
                                 + b"y" * 1000)
            assert (await read_response(r))[::2] == (200, b"1000")
            assert outcomes == ["read"]
            close_all(w)

    run(main())


def test_a_stalled_body_times_out_after_the_body_timeout():
    async def main():
        # the header deadline is shorter: a handler waiting for its body is not cut by it
        limits, outcomes = http.Limits(max_body_bytes=1000, body_timeout=0.6, header_timeout=0.3), []
        async with serving(limits, body_routes(limits, outcomes)) as server:
            r, w = await connect(server, b"POST /body HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n"
                                 + b"z" * 10)
            started = time.monotonic()
            status, _, body = await read_response(r, timeout=3.0)
            took = time.monotonic() - started
            assert (status, body) == (408, b"slow body")
            assert 0.5 <= took <= 2.0
            assert outcomes == ["timeout"]
            close_all(w)

    run(main())


# ---- handler cancellation ----

def test_a_handler_is_cancelled_when_its_client_disconnects():
    async def main():
        started, finished, cancelled = asyncio.Event(), asyncio.Event(), []

        async def hang(_request):
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            finally:
                finished.set()
            return web.Response(text="never")

        async with serving(http.Limits(header_timeout=5.0), {"/hang": hang}) as server:
            _, w = await connect(server, b"GET /hang HTTP/1.1\r\nHost: test\r\n\r\n")
            await asyncio.wait_for(started.wait(), 3.0)
            w.close()
            await asyncio.wait_for(finished.wait(), 2.0)
            assert cancelled == [True]
            await wait_until(lambda: not server.guard.in_handler and server.guard.open_connections() == 0)

    run(main())


# ---- the address ----

def fake_server(address: tuple) -> http.HttpServer:
    sock = SimpleNamespace(getsockname=lambda: address)
    return http.HttpServer(runner=None, server=SimpleNamespace(sockets=[sock]), guard=None, sweeper=None)


def test_url_brackets_ipv6_hosts():
    assert fake_server(("::1", 8123, 0, 0)).url == "http://[::1]:8123"
    assert fake_server(("fe80::1%eth0", 80, 0, 2)).url == "http://[fe80::1%eth0]:80"
    assert fake_server(("127.0.0.1", 8123)).url == "http://127.0.0.1:8123"
    assert fake_server(("0.0.0.0", 1)).host == "0.0.0.0"


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_a_real_server_url():
    async def main():
        async with serving(http.Limits()) as server:
            assert server.url == f"http://127.0.0.1:{server.port}"
            assert server.port > 0
        if ipv6_loopback():  # where the machine has no IPv6, the property is covered by the test above
            async with serving(http.Limits(), host="::1") as server:
                assert server.url == f"http://[::1]:{server.port}"
                r, w = await asyncio.open_connection("::1", server.port)
                w.write(GET_OK)
                assert (await read_response(r))[0] == 200
                close_all(w)

    run(main())


def test_a_port_in_use_is_a_config_error_naming_the_option():
    from swarm.errors import ConfigError

    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ConfigError, match=rf"cannot serve the API on 127.0.0.1:{port} .*--port"):
                await http.start(http.make_app(), "127.0.0.1", port, what="the API")

    run(scenario())
