"""HTTP servers that stay up under abuse: the API gateway, the health page and `/metrics` use this.

`start(app, host, port, limits)` serves an aiohttp application with these guards:

- a connection is closed when it spends more than `header_timeout` seconds outside a request handler,
  that is, while its request line and headers trickle in, or idle between keep-alive requests;
- at most `max_connections` are open; at the cap, a new connection evicts the connection that has
  waited longest for its headers or is still sending its body, so a flood of slow connections cannot
  lock real clients out (a burst of accepts evicts the oldest of its own if nothing older waits). If
  every connection is inside a handler past its body, the new one gets 503 and is closed;
- a client that disconnects cancels its handler (aiohttp's `handler_cancellation`, turned on here), so
  the work it started (a generation, its peer sessions) is released at once.

Request bodies are bounded by the application's `client_max_size`; handlers bound their body reads
in time with `read_body`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass

from aiohttp import web

from swarm.errors import ConfigError

logger = logging.getLogger(__name__)

_REFUSAL_BODY = json.dumps({"error": {"message": "too many open connections; retry shortly", "type": "server_busy",
                                      "param": None, "code": "too_many_connections"}}).encode()
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)


@dataclass(frozen=True)
class Limits:
    max_connections: int = 512
    header_timeout: float = 10.0  # seconds a connection may spend outside a request handler
    body_timeout: float = 30.0  # seconds a handler waits for a request body
    max_body_bytes: int = 1 << 20
    shutdown_timeout: float = 5.0  # seconds requests in progress may take to finish when the server stops


_LINGER = 1.0  # seconds a refused connection may take to close its side after the 503


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: for a connection over the cap when no waiting one can be evicted.

    The request it sent is read and dropped until the client closes (at most `_LINGER` seconds): closing a
    socket with unread input resets the connection, and the client would lose the 503 it was sent."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        with contextlib.suppress(Exception):
            transport.write(_REFUSAL)  # type: ignore[attr-defined]
            transport.write_eof()  # type: ignore[attr-defined]
        self._timer = asyncio.get_running_loop().call_later(_LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()


class _Guard:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.server: web.Server | None = None
        self.waiting_since: dict[object, float] = {}  # connection -> when it last left a handler
        self.in_handler: set[object] = set()  # aiohttp runs one handler per connection at a time
        self.reading: set[object] = set()  # in a handler, but its request body has not all arrived yet
        self.accepting: set[object] = set()  # created in this loop turn, not yet listed by the server
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0

    def protocol(self) -> asyncio.Protocol:
        assert self.server is not None
        # a burst of accepts creates several connections in one loop turn, before the server lists any of
        # them: those count too; connections already closed (evicted) but not yet forgotten do not
        if len(self.server.connections) + len(self.accepting) >= self.limits.max_connections and \
                len(open_now := [c for c in self.server.connections if c.transport is not None]) + \
                len(self.accepting) >= self.limits.max_connections:
            # connections accepted earlier in this burst wait for their headers too: they can be evicted
            waiting = [c for c in open_now if c not in self.in_handler or c in self.reading] + list(self.accepting)
            if not waiting:
                self.refused += 1
                return _Refuse()
            oldest = min(waiting, key=lambda c: self.waiting_since.get(c, 0.0))
            if oldest in self.accepting:
                # its transport has scheduled `connection_made` already; close right after it
                self.accepting.discard(oldest)
                self.waiting_since.pop(oldest, None)
                asyncio.get_running_loop().call_soon(oldest.force_close)
            else:
                self._close(oldest)
            self.evicted += 1
        handler = self.server()
        self.waiting_since[handler] = time.monotonic()
        self.accepting.add(handler)
        # the transport schedules connection_made (which lists it) right after this; callbacks run in order
        asyncio.get_running_loop().call_soon(self.accepting.discard, handler)
        return handler

    def _close(self, conn) -> None:
        self.waiting_since.pop(conn, None)
        self.in_handler.discard(conn)
        self.reading.discard(conn)
        conn.force_close()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = request.protocol
        self.in_handler.add(conn)
        if request.body_exists:
            self.reading.add(conn)  # until `read_body` has it all
        try:
            return await handler(request)
        finally:
            self.reading.discard(conn)
            self.in_handler.discard(conn)
            self.waiting_since[conn] = time.monotonic()

    async def sweep(self) -> None:
        """Close connections waiting too long for a request; forget closed ones. Runs until cancelled."""
        assert self.server is not None
        interval = max(0.05, min(1.0, self.limits.header_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            live = set(self.server.connections)
            for conn in list(self.waiting_since):
                if conn not in live:
                    if now - self.waiting_since[conn] > 5.0:  # created but never connected, or closed
                        self.waiting_since.pop(conn, None)
                    continue
                if conn not in self.in_handler and now - self.waiting_since[conn] > self.limits.header_timeout:
                    self.timed_out += 1
                    self._close(conn)
            for conn in list(self.in_handler):
                if conn not in live and conn not in self.waiting_since:
                    self.in_handler.discard(conn)
                    self.reading.discard(conn)

    def open_connections(self) -> int:
        return len(self.server.connections) if self.server is not None else 0


class HttpServer:
    """A running guarded server; `await close()` stops it."""

    def __init__(self, runner: web.AppRunner, server: asyncio.base_events.Server, guard: _Guard,
                 sweeper: asyncio.Task):
        self.runner, self._server, self.guard, self._sweeper = runner, server, guard, sweeper

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def host(self) -> str:
        return self._server.sockets[0].getsockname()[0]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper
        self._server.close()
        await self.runner.cleanup()


_GUARD = web.AppKey("connection_guard", _Guard)


def make_app(limits: Limits = Limits()) -> web.Application:
    """An application whose request bodies are capped at `limits.max_body_bytes`."""
    return web.Application(client_max_size=limits.max_body_bytes)


async def start(app: web.Application, host: str, port: int, limits: Limits = Limits(), *,
                what: str = "HTTP", flag: str = "--port") -> HttpServer:
    """Serve `app` on host:port; a port that cannot be bound is a `ConfigError` naming `what` and `flag`."""
    guard = _Guard(limits)
    app[_GUARD] = guard
    app.middlewares.insert(0, guard.middleware)
    # aiohttp's own keep-alive timer is only a fallback here: the guard's sweep closes first, and counts it
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=limits.shutdown_timeout,
                           keepalive_timeout=2 * limits.header_timeout)
    await runner.setup()
    guard.server = runner.server
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(guard.protocol, host, port, backlog=min(4096, max(128, limits.max_connections * 2)),
                                          reuse_address=True)
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot serve {what} on {host}:{port} ({e.strerror or e}); choose another {flag}") from None
    return HttpServer(runner, server, guard, asyncio.create_task(guard.sweep()))


async def read_body(request: web.Request, limits: Limits) -> bytes:
    """The request body, within `limits.body_timeout` seconds (`asyncio.TimeoutError` otherwise) and
    `max_body_bytes` (aiohttp raises `HTTPRequestEntityTooLarge`)."""
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=limits.max_body_bytes, actual_size=declared)
    body = await asyncio.wait_for(request.read(), limits.body_timeout)
    guard = request.app.get(_GUARD)
    if guard is not None:
        guard.reading.discard(request.protocol)  # from now on the request is real work: never evicted
    return body


def content_policy(page: bytes) -> str:
    """The page's Content-Security-Policy: nothing but its own inline scripts and styles (named by their
    hashes, so an injected one cannot run) and fetches from its own origin."""
    markup = re.sub(rb"<!--.*?-->", b"", page, flags=re.S)  # a tag named in a comment is no element

    def hashes(tag: bytes) -> str:
        bodies = re.findall(rb"<%s>(.*?)</%s>" % (tag, tag), markup, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in bodies)

    return (f"default-src 'none'; script-src {hashes(b'script')}; style-src {hashes(b'style')}; "
            "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
