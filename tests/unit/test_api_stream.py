"""The gateway's streaming path without a swarm: a failure after the stream has started ends it with an
error event and `[DONE]` (never a second HTTP response inside the first), and the error middleware keeps
OpenAI's error objects for everything else. A real aiohttp server on 127.0.0.1, a real HTTP client."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from client.api.gateway import Gateway
from client.api.served import ServedModel
from client.api.responses import ResponseBodies
from client.api.stream import Runs
from client.config import ApiConfig
from client.generation import Delta
from swarm import http
from swarm.errors import NoRoute

pytestmark = pytest.mark.unit


def gateway(**config) -> Gateway:
    return Gateway(ApiConfig(**config), [ServedModel("m", None, None, None, 128, [2])])


async def failing_events(error: BaseException):
    yield [Delta(0, "Hel")]
    yield [Delta(0, "lo")]
    raise error


def serve_stream(gw: Gateway, error: BaseException):
    async def handler(request: web.Request) -> web.StreamResponse:
        gen = SimpleNamespace(first_token_s=0.01, prompt_tokens=3, completion_tokens=2, waiting=None, unchecked=[],
                              run=lambda: failing_events(error))
        return await gw._respond(request, Runs([gen]), ResponseBodies("chat.completion", "m", 1), stream=True,
                                 include_usage=True)

    app = gw.app()
    app.router.add_get("/stream", handler)
    return app


async def read_stream(error: BaseException) -> tuple[int, str, list[str]]:
    gw = gateway()
    server = await http.start(serve_stream(gw, error), "127.0.0.1", 0, gw.config.limits)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/stream", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                body = (await resp.read()).decode()
                events = [ln.removeprefix("data: ") for ln in body.splitlines() if ln.startswith("data: ")]
                return resp.status, resp.headers["Content-Type"], events
    finally:
        await server.close()
        await gw.close()


@pytest.mark.parametrize("error, code", [(RuntimeError("a bug"), "internal"), (NoRoute("blocks [3:6) are gone"),
                                                                                "no_route")])
def test_a_failure_mid_stream_ends_it_with_an_error_event(error, code):
    status, content_type, events = asyncio.run(read_stream(error))
    assert status == 200 and content_type == "text/event-stream"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    assert text == "Hello"
    assert chunks[-1]["error"]["code"] == code
    assert not any("HTTP/1.1" in e for e in events)


def test_errors_outside_a_stream_are_openai_objects_with_cors_when_asked():
    async def run():
        gw = gateway(allow_origin="https://chat.example")
        app = gw.app()

        async def boom(_request):
            raise RuntimeError("a bug")

        app.router.add_get("/boom", boom)
        server = await http.start(app, "127.0.0.1", 0, gw.config.limits)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/boom") as resp:
                    boom_reply = resp.status, await resp.json(), resp.headers.get("Access-Control-Allow-Origin")
                async with session.get(f"{server.url}/v1/completions") as resp:
                    wrong_method = resp.status, await resp.json(), resp.headers.get("Allow")
                async with session.options(f"{server.url}/v1/chat/completions", headers={
                        "Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "authorization, content-type"}) as resp:
                    preflight = resp.status, dict(resp.headers)
        finally:
            await server.close()
            await gw.close()
        return boom_reply, wrong_method, preflight

    boom_reply, wrong_method, preflight = asyncio.run(run())
    assert boom_reply[0] == 500 and boom_reply[1]["error"]["code"] == "internal"
    assert boom_reply[2] == "https://chat.example"
    assert wrong_method[0] == 405 and wrong_method[1]["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong_method[2]
    assert preflight[0] == 204 and preflight[1]["Access-Control-Allow-Origin"] == "https://chat.example"
    assert "POST" in preflight[1]["Access-Control-Allow-Methods"]
    assert preflight[1]["Access-Control-Allow-Headers"] == "authorization, content-type"


def test_without_an_allowed_origin_there_is_no_cors():
    async def run():
        gw = gateway()
        server = await http.start(gw.app(), "127.0.0.1", 0, gw.config.limits)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.options(f"{server.url}/v1/chat/completions") as resp:
                    return resp.status, resp.headers.get("Access-Control-Allow-Origin")
        finally:
            await server.close()
            await gw.close()

    assert asyncio.run(run()) == (405, None)
