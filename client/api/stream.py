"""The gateway's generations in flight: the generations of one request run at once (`Runs`), and a response
streamed as server-sent events (`Writer`). Async; no HTTP routing (that is `client/api/gateway.py`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from client.api.requests import ApiError
from client.generation import Delta, Generation
from swarm.errors import NoRoute, SwarmError


class ClientGone(Exception):
    """The client of a stream stopped reading or went away."""


class Runs:
    """The generations of one request (one per prompt), run at once; their deltas come as `(prompt, deltas)`
    in the order they are made. `close()` ends every generation (their peer sessions close in `closing`)."""

    def __init__(self, gens: list[Generation]):
        self.gens = gens
        self.iters: list[AsyncIterator[list[Delta]]] = [g.run() for g in gens]
        self.tasks: dict[int, asyncio.Future] = {}  # prompt -> its generation's next step
        self.done: set[int] = set()

    @property
    def waiting(self) -> str | None:
        """While a generation waits for blocks to be served again, what it waits for."""
        return next((g.waiting for g in self.gens if g.waiting), None)

    def _start(self) -> None:
        for p, it in enumerate(self.iters):
            if p not in self.done and p not in self.tasks:
                self.tasks[p] = asyncio.ensure_future(anext(it, None))

    def _take(self, p: int) -> tuple[int, list[Delta]] | None:
        result = self.tasks.pop(p).result()  # raises the generation's error
        if result is None:
            self.done.add(p)
            return None
        return p, result

    async def first(self) -> list[tuple[int, list[Delta]]]:
        """Every generation's first deltas (each one's prompt has run): the first error, if any, is raised."""
        self._start()
        pending = set(self.tasks.values())
        while pending:  # bounded: one round per generation at most
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done):
                break
        out = []
        for p in sorted(self.tasks):
            if self.tasks[p].done() and (taken := self._take(p)) is not None:
                out.append(taken)
        return out

    async def next(self, timeout: float) -> list[tuple[int, list[Delta]]] | None:
        """Deltas of the generations that made some within `timeout` seconds ([] if none did); None once
        every generation has ended."""
        self._start()
        if not self.tasks:
            return None
        done, _ = await asyncio.wait(set(self.tasks.values()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        out = []
        for p in sorted(self.tasks):
            if self.tasks[p] in done and (taken := self._take(p)) is not None:
                out.append(taken)
        if not out and not self.tasks and len(self.done) == len(self.iters):
            return None
        return out

    async def drain(self) -> None:
        """Run every generation to its end."""
        for _ in range(1_000_000):  # bounded: each round takes at least one step of some generation
            if await self.next(timeout=3600) is None:
                return
        raise RuntimeError("generations never ended")

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks.values()))
        self.tasks.clear()
        for it in self.iters:
            await it.aclose()  # ends the generation; its peer sessions close in `gen.closing`


class Writer:
    """Writes server-sent events; a client that takes more than `timeout` seconds to accept one (it
    stopped reading) is cut off, so it cannot hold a generation slot and peer sessions forever."""

    def __init__(self, request: web.Request, response: web.StreamResponse, timeout: float):
        self.request, self.response, self.timeout = request, response, timeout

    async def send(self, data: dict[str, Any]) -> None:
        await self.send_raw(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

    async def send_raw(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.response.write(data), self.timeout)
        except (asyncio.TimeoutError, ConnectionError) as e:
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ClientGone("it stopped reading" if isinstance(e, asyncio.TimeoutError) else "connection lost") \
                from None

    async def end(self) -> None:
        """The stream's end; a client that closed the connection once it read the last event lost nothing."""
        try:
            await asyncio.wait_for(self.response.write_eof(), self.timeout)
        except (asyncio.TimeoutError, ConnectionError):
            if self.request.transport is not None:
                self.request.transport.abort()


def api_error(err: SwarmError, retry_after: int) -> ApiError:
    """The answer to a generation's failure."""
    if isinstance(err, NoRoute):
        return ApiError(503, str(err), type="service_unavailable", code="no_route",
                        headers={"Retry-After": str(retry_after)})
    if err.code == "bad_request":
        return ApiError(400, str(err), code="bad_request")
    if err.code == "unchecked":  # refused by this server's --require-checked: more peers may make it checkable
        return ApiError(503, str(err), type="service_unavailable", code="unchecked",
                        headers={"Retry-After": str(retry_after)})
    return ApiError(502, f"the swarm failed: {err}", type="server_error", code=err.code)
