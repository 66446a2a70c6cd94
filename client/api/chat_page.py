"""The chat page of `swarm api` (GET /): a web page that chats with the served model through the API.

The page is one file, `client/api/static/chat.html` (package data), with its CSS and JavaScript inline: no
build step, no other asset, nothing fetched from anywhere but the gateway that served it. It reads the
model id from `GET /v1/models` and streams answers from `POST /v1/chat/completions` (see the comment
at the top of the file for what it does and what tests rely on).

Invariants:
- the Content-Security-Policy sent with the page allows its own inline script and style elements only,
  by hash, and network requests to its own origin only, so neither an injected element nor a change
  to the page that loads something from elsewhere can run or fetch;
- the page is read and hashed once per process, and served with `Cache-Control: no-store` so that a
  gateway upgraded in place never runs a stale page against a newer API.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import web

from swarm import http

PAGE = "static/chat.html"


@functools.cache
def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy."""
    body = resources.files("client.api").joinpath(PAGE).read_bytes()
    return body, http.content_policy(body)


async def serve(_request: web.Request) -> web.Response:
    body, policy = page()
    return web.Response(body=body, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store", "Content-Security-Policy": policy})
