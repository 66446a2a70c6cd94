"""The chat page of `swarm api` in headless Chromium, driven by its link parameters (no clicks), read
once its answers have ended (`browser.dom_when`: Chromium's virtual time does not wait for a stream).

Against the real demo swarm: `/?system=...&temperature=0&max_tokens=N&q=...` sends the question on
load, and the answer streamed into the page must be, character for character, the greedy answer the
official `openai` package gets from the same gateway for the same system prompt, question and max
tokens. Against a stand-in API served in this process (the page file itself, a scripted stream): the
SSE details a real swarm rarely shows on cue (comment lines while blocks are waited for, events cut at
arbitrary bytes, an error event mid-stream, an error status), multi-turn history, and text that looks
like markup staying text.
"""

from __future__ import annotations

import asyncio
import html.parser
import json
import re
import time
import urllib.request
from urllib.parse import urlencode

import openai
import pytest
from aiohttp import web

import browser
from client.api import chat_page
from swarm import http

pytestmark = pytest.mark.integration

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Messages(html.parser.HTMLParser):
    """The chat log of a dumped DOM: per `.msg`, its role, state, the text of its parts and any tags inside."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[dict] = []
        self.open: list[str | None] = []  # per open element: the field of the current message its text goes to

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        classes = set(a.get("class", "").split())
        field = self.open[-1] if self.open else None
        if "msg" in classes:
            self.found.append({"role": a.get("data-role"), "state": a.get("data-state"), "text": "", "error": "",
                               "note": "", "tags": []})
            field = "msg"
        elif field is not None:
            self.found[-1]["tags"].append(tag)
            field = next((c for c in ("text", "error", "note", "role") if c in classes), field)
        if tag not in VOID:
            self.open.append(field)

    def handle_endtag(self, tag):
        if tag not in VOID and self.open:
            self.open.pop()

    def handle_data(self, data):
        field = self.open[-1] if self.open else None
        if field in ("text", "error", "note"):
            self.found[-1][field] += data


def messages_of(dom: str) -> list[dict]:
    parser = _Messages()
    parser.feed(dom)
    return parser.found


def status_of(dom: str) -> str:
    return next(e.attrs.get("data-state", "") for e in browser.elements(dom) if e.attrs.get("id") == "status")


def settled(answers: int) -> str:
    """JavaScript: `answers` answers have ended (done, stopped or failed), or the page shows an error."""
    return ("document.querySelectorAll('.msg[data-role=assistant]:not([data-state=streaming])').length >= "
            f"{answers} || document.getElementById('status').dataset.state === 'error'")


# ---- the real swarm ----

@pytest.fixture(scope="module")
def api(demo_swarm, demo_model_dir):
    proc = demo_swarm.start_api("api-chat-page", demo_model_dir, "--max-tokens", "64")
    yield proc.extra["url"]
    demo_swarm.stop("api-chat-page")


def test_the_page_loads_nothing_from_elsewhere(api):
    base = api.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/", timeout=10) as reply:
        content_type, policy, page = reply.headers.get_content_type(), reply.headers["Content-Security-Policy"], \
            reply.read().decode()
    assert content_type == "text/html"
    assert not re.search(r"https?://", page)  # no URL of any other host: no font, script or CDN
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy  # and the browser enforces it


def test_a_real_answer_streams_into_the_page(api):
    base = api.removesuffix("/v1")
    oai = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = oai.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=MAX_TOKENS).choices[0].message.content
    assert expected.strip()
    link = f"{base}/?" + urlencode({"system": SYSTEM, "temperature": 0, "max_tokens": MAX_TOKENS, "q": QUESTION})
    started = time.monotonic()
    dom = browser.dom_when(link, settled(1), timeout=240)
    took = time.monotonic() - started
    found = messages_of(dom)
    assert [(m["role"], m["state"]) for m in found] == [("user", None), ("assistant", "done")], (found, took)
    assert found[0]["text"] == QUESTION
    assert found[1]["text"] == expected
    assert " tokens in " in found[1]["note"] and not found[1]["error"]
    assert status_of(dom) == "idle"
    # the page shows the answer done once its last event arrives; the request is counted as its handler returns
    counted = r'swarm_api_requests_total\{endpoint="/v1/chat/completions",status="200"\} [2-9]'
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        if re.search(counted, metrics) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert re.search(counted, metrics)


# ---- a stand-in API: the stream's details on cue ----

MODEL = "stand-in"
WAITING = ": waiting up to 30 s for blocks [15:30) of stand-in to be served again...\n\n"


def reply_text(messages: list[dict]) -> str:
    turn = sum(m["role"] == "user" for m in messages)
    return f"turn {turn}: <b>{messages[-1]['content']}</b> & \"so\" é🙂\n<script>x()</script>"


def stand_in(requests: list[dict], served: tuple[str, ...] = (MODEL,)) -> web.Application:
    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in served]})

    async def completions(request):
        body = await request.json()
        requests.append(body)
        messages = body["messages"]
        if messages[-1]["content"] == "busy":
            return web.json_response({"error": {"message": "all 8 generation slots are taken", "type": "server_busy",
                                                "param": None, "code": "server_busy"}}, status=503,
                                     headers={"Retry-After": "1"})
        text = reply_text(messages)
        events = [WAITING, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": text[i:i + 3]}}]} for i in range(0, len(text), 3)]
        if messages[-1]["content"] == "fail":
            events += [{"error": {"message": "the swarm failed: peer gone", "code": "internal"}}]
        else:
            events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                       {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}]
        raw = b"".join(e.encode() if isinstance(e, str) else b"data: " + json.dumps(e).encode() + b"\r\n\r\n"
                       for e in events) + b"data: [DONE]\n\n"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(0, len(raw), 5):  # cut anywhere: inside lines, line ends and UTF-8 characters
            await response.write(raw[i:i + 5])
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", chat_page.serve)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def load(query: dict | list, answers: int, served: tuple[str, ...] = (MODEL,)) -> tuple[str, list[dict]]:
    """The DOM of the page served by the stand-in API (serving the models `served`) at `/?query` once `answers`
    answers have ended (or an error shows), and the requests the page made."""
    async def run():
        requests: list[dict] = []
        server = await http.start(stand_in(requests, served), "127.0.0.1", 0)
        try:
            dom = await asyncio.get_running_loop().run_in_executor(
                None, lambda: browser.dom_when(f"{server.url}/?{urlencode(query)}", settled(answers), timeout=120))
        finally:
            await server.close()
        return dom, requests

    return asyncio.run(run())


def test_history_comments_cut_events_and_an_error_event():
    query = [("system", "Be brief."), ("temperature", "0"), ("max_tokens", "7"), ("stop", "END"), ("stop", "\n\n"),
             ("q", "one"), ("q", "<i>two</i>"), ("q", "fail"), ("q", "never sent")]
    dom, requests = load(query, 3)
    found = messages_of(dom)
    assert [(m["role"], m["state"]) for m in found] == [
        ("user", None), ("assistant", "done"), ("user", None), ("assistant", "done"), ("user", None),
        ("assistant", "error")]
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": "user", "content": "one"}, {"role": "assistant", "content": reply_text([system, {
        "role": "user", "content": "one"}])}, {"role": "user", "content": "<i>two</i>"}]
    turns += [{"role": "assistant", "content": reply_text([system, *turns])}, {"role": "user", "content": "fail"}]
    assert [r["messages"] for r in requests] == [[system, *turns[:1]], [system, *turns[:3]], [system, *turns]]
    for r in requests:
        assert (r["model"], r["stream"], r["temperature"], r["max_tokens"], r["stop"]) == (
            MODEL, True, 0, 7, ["END", "\n\n"])
    assert [m["text"] for m in found[1::2]] == [turns[1]["content"], turns[3]["content"], reply_text(
        [system, *turns])]
    assert found[5]["error"] == "the swarm failed: peer gone"
    assert found[1]["note"].startswith("9 tokens in ")
    assert all(m["tags"] == ["div", "div"] + (["div"] if m["role"] == "assistant" else []) for m in found)
    assert status_of(dom) == "error"


def test_an_error_status_is_shown_with_its_message():
    dom, requests = load({"q": "busy"}, 1)
    found = messages_of(dom)
    assert len(requests) == 1 and [(m["role"], m["state"]) for m in found] == [("user", None), ("assistant", "error")]
    assert found[1]["error"] == "all 8 generation slots are taken (retry in 1 s)"
    assert found[1]["text"] == ""


def test_the_model_is_picked_among_those_served():
    served = (MODEL, "second-model")
    dom, requests = load([("model", "second-model"), ("q", "one"), ("q", "two")], 2, served)
    assert [r["model"] for r in requests] == ["second-model", "second-model"]
    picker = next(e for e in browser.elements(dom) if e.attrs.get("id") == "model")
    assert picker.tag == "select" and "disabled" not in picker.attrs
    assert re.findall(r"<option[^>]*>([^<]*)</option>", dom) == list(served)
    _, requests = load({"q": "one"}, 1, served)  # none named: the first served
    assert [r["model"] for r in requests] == [MODEL]
    dom, _ = load({"q": "one"}, 1)  # one model: shown, nothing to pick
    picker = next(e for e in browser.elements(dom) if e.attrs.get("id") == "model")
    assert "disabled" in picker.attrs and re.findall(r"<option[^>]*>([^<]*)</option>", dom) == [MODEL]
