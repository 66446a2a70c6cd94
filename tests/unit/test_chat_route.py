"""The chat page as the gateway serves it, without a swarm or a browser: GET / answers the page with its
Content-Security-Policy, CORS and metrics as on every route, other paths and methods keep OpenAI's
error objects, and the page itself is self-contained and renders text as text (checked on its source;
tests/integration/test_chat_page.py runs it in Chromium)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re

import aiohttp
import pytest

from client.api import chat_page
from client.api.gateway import Gateway
from client.api.served import ServedModel
from client.config import ApiConfig
from swarm import http

pytestmark = pytest.mark.unit


def test_get_root_serves_the_page_and_other_paths_keep_openai_errors():
    async def run():
        gw = Gateway(ApiConfig(allow_origin="https://chat.example"), [ServedModel("m", None, None, None, 128, [2])])
        server = await http.start(gw.app(), "127.0.0.1", 0, gw.config.limits)
        replies = {}
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/") as resp:
                    replies["page"] = resp.status, resp.content_type, dict(resp.headers), await resp.read()
                async with session.post(f"{server.url}/", json={}) as resp:
                    replies["post"] = resp.status, await resp.json()
                async with session.get(f"{server.url}/index.html") as resp:
                    replies["other"] = resp.status, await resp.json()
                async with session.get(f"{server.url}/metrics") as resp:
                    replies["metrics"] = await resp.text()
        finally:
            await server.close()
            await gw.close()
        return replies

    replies = asyncio.run(run())
    status, content_type, headers, body = replies["page"]
    assert (status, content_type) == (200, "text/html")
    assert body == chat_page.page()[0]
    assert headers["Content-Security-Policy"] == chat_page.page()[1]
    assert headers["Cache-Control"] == "no-store"
    assert headers["Access-Control-Allow-Origin"] == "https://chat.example"
    assert replies["post"][0] == 405 and replies["post"][1]["error"]["code"] == "method_not_allowed"
    assert replies["other"][0] == 404 and replies["other"][1]["error"]["code"] == "not_found"
    assert 'swarm_api_requests_total{endpoint="/",status="200"} 1.0' in replies["metrics"]


def test_the_page_is_self_contained_and_its_policy_names_its_only_script_and_style():
    body, policy = chat_page.page()
    text = body.decode()
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]", text, re.I)  # no other host, absolute or scheme-relative
    markup = re.sub(r"<script>.*?</script>", "", text, flags=re.S)
    assert not re.search(r"\b(src|srcset|action)\s*=", markup)  # nothing loaded or submitted elsewhere
    assert re.findall(r"\bhref\s*=\s*\"([^\"]*)\"", markup) == ["?"]  # the link to this chat, filled in by the page
    assert not re.search(r"<(link|iframe|img|object|embed|base)\b", markup)
    assert not re.search(r"\son[a-z]+\s*=|\sstyle\s*=", markup)  # the policy blocks handlers and style attributes
    for tag in ("script", "style"):  # exactly one, without attributes, so its hash in the policy is all it needs
        assert len(re.findall(rf"<{tag}\b", text)) == 1 and f"<{tag}>" in text
        inline = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S).group(1).encode()
        digest = base64.b64encode(hashlib.sha256(inline).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}';" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    script = re.search(r"<script>(.*?)</script>", text, re.S).group(1)
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", script)
    assert re.findall(r"fetch\(\"([^\"]+)\"", script) == ["v1/chat/completions", "v1/models"]  # relative: own origin
