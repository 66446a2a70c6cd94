"""`swarm api`: an OpenAI-compatible HTTP API whose model runs in the swarm.

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`
(the model's chat template), with `stream: true` as server-sent events in OpenAI's chunk format, and
`GET /metrics` (Prometheus). One process, one event loop: the HTTP server, a client-mode DHT node and
every generation (`client.generation`) share it; the head runs in a small thread pool.

A generation whose blocks lost their last peer waits for them (`ClientConfig.wait_for_blocks`); a
stream that has started meanwhile gets an SSE comment (`: waiting for blocks ...`) every
`KEEPALIVE_S`, so that clients and proxies keep the connection open. A request not streamed just waits.

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`):
400 invalid parameters, 404 unknown model or path, 405 wrong method, 408 a body that does not arrive in
time, 413 an oversize body, 503 with `Retry-After` when some blocks have no live peer or every
generation slot and queue place is taken, 500 for a bug (logged). A failure after a stream has started
is sent as a final `data: {"error": ...}` event.

Limits: `max_generations` run at once and `max_queue` more wait for a slot; the connection guards of
`swarm.http` (header deadline, connection cap with eviction, body deadline and size). A client that
disconnects cancels its request's task, which closes its peer sessions (`Generation.run`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from client import chat_page
from client.api_requests import (CHARS_PER_TOKEN, ApiError, checked_text, invalid, parse_common,
                                 parse_messages)
from client.api_responses import ResponseBodies
from client.config import ApiConfig, ClientConfig
from client.generation import Generation, Sampling, stop_token_ids
from client.swarm_client import SwarmClient
from swarm import http, metrics
from swarm.errors import ConfigError, NoRoute, SwarmError

logger = logging.getLogger(__name__)

STREAMING = web.RequestKey("streaming", bool)  # set once a response's head is sent: errors go into the stream
KEEPALIVE_S = 5.0  # seconds between SSE comments while a started stream waits for blocks


class Gateway:
    """The HTTP application over one model of the swarm (see the module docstring)."""

    def __init__(self, config: ApiConfig, client: SwarmClient, head, tokenizer, model_id: str, context_length: int,
                 end_tokens: list[int]):
        self.config, self.client, self.head, self.tokenizer = config, client, head, tokenizer
        self.model_id, self.context_length, self.end_tokens = model_id, context_length, end_tokens
        self.created = int(time.time())
        self.limits = config.limits
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="api-head")
        # one thread: a huge prompt delays other prompts' tokenizing, never the running generations
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-tokenize")
        self.closing: set[asyncio.Task] = set()  # generations' peer sessions being closed
        self.slots = asyncio.Semaphore(config.max_generations)
        self.waiting = 0
        self.running = 0
        self.server: http.HttpServer | None = None
        self.keepalive_s = KEEPALIVE_S
        self.registry = CollectorRegistry()
        self._metrics()

    def _metrics(self) -> None:
        r = self.registry
        self.m_requests = Counter("swarm_api_requests", "HTTP requests answered, by endpoint and status",
                                  ["endpoint", "status"], registry=r)
        self.m_tokens = Counter("swarm_api_tokens", "tokens processed, prompt and completion", ["kind"], registry=r)
        self.m_seconds = Histogram("swarm_api_request_seconds", "time to answer a generation request, whole",
                                   ["endpoint"], buckets=metrics.LATENCY_BUCKETS, registry=r)
        self.m_ttft = Histogram("swarm_api_time_to_first_token_seconds", "from a generation's start to its first "
                                "token (prompt through every block, then sampling)", buckets=metrics.LATENCY_BUCKETS,
                                registry=r)
        self.m_token_seconds = Histogram("swarm_api_token_seconds", "time between consecutive tokens of a "
                                         "generation", buckets=metrics.LATENCY_BUCKETS, registry=r)
        self.m_failovers = Counter("swarm_api_failovers", "peers replaced during generations", ["reason"], registry=r)
        self.m_cancelled = Counter("swarm_api_cancelled", "generations cancelled because the client went away",
                                   registry=r)

        def state():
            guard = self.server.guard if self.server else None
            yield "swarm_api_generations_running", "generations running now", self.running, {}
            yield "swarm_api_generations_waiting", "requests waiting for a generation slot", self.waiting, {}
            if guard is not None:
                yield "swarm_api_connections_open", "HTTP connections open now", guard.open_connections(), {}
                for what, value in (("evicted", guard.evicted), ("refused", guard.refused),
                                    ("timed_out", guard.timed_out)):
                    yield ("swarm_api_connections_dropped", "connections closed by the guards since start "
                           "(cumulative)", value, {"reason": what})

        r.register(metrics.StateCollector(state))

    def app(self) -> web.Application:
        app = http.make_app(self.limits)
        app.middlewares.append(self._errors)
        app.router.add_get("/", chat_page.serve)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        metrics.add_route(app, self.registry)
        return app

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.closing:  # let the peers hear that our sessions ended before the node goes away
            await asyncio.wait(list(self.closing), timeout=3)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- plumbing ----

    def _cors(self) -> dict[str, str]:
        return {"Access-Control-Allow-Origin": self.config.allow_origin} if self.config.allow_origin else {}

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        if request.method == "OPTIONS" and self.config.allow_origin:  # a browser's preflight
            return web.Response(status=204, headers={
                **self._cors(), "Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "Authorization, Content-Type")})
        try:
            response = await handler(request)
        except Exception:
            if request.get(STREAMING):  # the response has started: nothing else can be sent on it
                raise
            response = self._error_response(request)
        if not response.prepared:
            response.headers.update(self._cors())
        self.m_requests.labels(endpoint, str(response.status)).inc()
        return response

    def _error_response(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI error object for the exception being handled."""
        try:
            raise
        except ApiError as e:
            response = e.response()
        except web.HTTPRequestEntityTooLarge:
            response = ApiError(413, f"request body exceeds {self.config.max_body_bytes} bytes", code="body_too_large"
                                ).response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status)
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
            response = ApiError(e.status, e.reason if e.status != 404 else f"no such path: {request.path}",
                                code=kind, headers=allow).response()
        except Exception:  # boundary: a bug in one request is answered as such; the server keeps serving
            logger.exception("%s %s failed", request.method, request.path)
            response = ApiError(500, "internal error", type="server_error", code="internal").response()
        return response

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await http.read_body(request, self.limits)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout:g} s",
                           code="body_timeout") from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model", "'model' is required: a string naming the model")
        if model != self.model_id:
            raise ApiError(404, f"the model '{model}' does not exist here; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")
        return body

    async def _tokenize(self, chars: int, param: str, fn: Callable) -> list[int]:
        if chars > self.context_length * CHARS_PER_TOKEN:
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; the "
                           f"{param} has {chars} characters", param=param, code="context_length_exceeded")
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)

    def _sized(self, sampling: Sampling, prompt: list[int], default_max: int, body: dict, param: str) -> Sampling:
        """`sampling` with max_tokens settled (`default_max` if not given), after checking the prompt
        against the context length."""
        room = self.context_length - len(prompt)
        if room < 1:
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; the "
                           f"{param} has {len(prompt)}", param=param, code="context_length_exceeded")
        max_tokens = sampling.max_tokens or min(default_max, room)
        if max_tokens > room:
            given = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise ApiError(400, f"this model's maximum context length is {self.context_length} tokens; you asked "
                           f"for {len(prompt) + max_tokens} ({len(prompt)} in the {param}, {max_tokens} in the "
                           "completion)", param=given, code="context_length_exceeded")
        return Sampling(**{**sampling.__dict__, "max_tokens": max_tokens})

    # ---- endpoints ----

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "swarm"}

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            raise ApiError(404, f"the model '{request.match_info['model']}' does not exist here", param="model",
                           code="model_not_found")
        return web.json_response(self._model_card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        sampling, stream, include_usage = parse_common(body, self.config)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            checked_text(prompt, "prompt")
            ids = await self._tokenize(len(prompt), "prompt", lambda: self.tokenizer(prompt).input_ids)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < self.head.vocab_size for t in prompt):
                raise invalid("prompt", f"token ids must lie in [0, {self.head.vocab_size})")
            ids = prompt
        else:
            raise invalid("prompt", "'prompt' must be a string, a list of token ids, or a list holding one of these")
        if not ids:
            raise invalid("prompt", "the prompt is empty")
        sampling = self._sized(sampling, ids, 16, body, "prompt")  # OpenAI's default max_tokens for completions
        return await self._generate(request, "text_completion", ids, sampling, stream, include_usage)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        sampling, stream, include_usage = parse_common(body, self.config)
        messages = parse_messages(body)
        if not self.tokenizer.chat_template:
            raise ApiError(400, f"the model '{self.model_id}' has no chat template: use /v1/completions",
                           code="no_chat_template")
        chars = sum(len(m["content"]) for m in messages)
        ids = await self._tokenize(chars, "messages", lambda: self._chat_ids(messages))
        sampling = self._sized(sampling, ids, self.config.max_tokens, body, "messages")
        return await self._generate(request, "chat.completion", ids, sampling, stream, include_usage)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from jinja2 import TemplateError

        try:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
        except (TemplateError, ValueError, TypeError) as e:  # templates refuse, e.g., a system role
            raise invalid("messages", f"the model's chat template refused these messages: {e}") from None

    # ---- generation ----

    async def _slot(self) -> None:
        if self.slots.locked() and self.waiting >= self.config.max_queue:
            raise ApiError(503, f"all {self.config.max_generations} generation slots and {self.config.max_queue} "
                           "queue places are taken; retry shortly", type="server_busy", code="server_busy",
                           headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1

    async def _generate(self, request: web.Request, kind: str, prompt: list[int], sampling: Sampling,
                        stream: bool, include_usage: bool) -> web.StreamResponse:
        endpoint = "/v1/chat/completions" if kind == "chat.completion" else "/v1/completions"
        await self._slot()
        self.running += 1
        started = time.perf_counter()
        gen = Generation(self.client, self.head, self.tokenizer, self.executor, prompt, sampling, self.end_tokens)
        events = gen.run()
        try:
            try:
                return await self._respond(request, gen, events, ResponseBodies(kind, self.model_id, sampling.n), stream,
                                           include_usage)
            finally:
                self.running -= 1
                self.slots.release()
                await events.aclose()  # ends the generation; its peer sessions close in `gen.closing`
                if gen.closing is not None:
                    self.closing.add(gen.closing)
                    gen.closing.add_done_callback(self.closing.discard)
        except (asyncio.CancelledError, _ClientGone) as e:
            self.m_cancelled.inc()
            logger.info("%s: client went away after %d tokens (%s); generation cancelled", endpoint,
                        gen.completion_tokens, e if isinstance(e, _ClientGone) else "disconnected")
            raise
        finally:
            self.m_seconds.labels(endpoint).observe(time.perf_counter() - started)
            self.m_tokens.labels("prompt").inc(gen.prompt_tokens)
            self.m_tokens.labels("completion").inc(gen.completion_tokens)
            for f in gen.failovers:
                self.m_failovers.labels(f.reason).inc()
            logger.info("%s: %d prompt + %d completion tokens in %.2f s (first token %.2f s)%s", endpoint,
                        gen.prompt_tokens, gen.completion_tokens, time.perf_counter() - started,
                        gen.first_token_s or 0.0, f", {len(gen.failovers)} failovers" if gen.failovers else "")

    def _timed(self, last: list[float]) -> None:
        now = time.perf_counter()
        self.m_token_seconds.observe(now - last[0])
        last[0] = now

    async def _respond(self, request: web.Request, gen: Generation, events, out: ResponseBodies, stream: bool,
                       include_usage: bool) -> web.StreamResponse:
        try:  # the prompt runs before any header is sent, so its errors keep their status
            first = await anext(events, [])
            self.m_ttft.observe(gen.first_token_s or 0.0)
            last = [time.perf_counter()]
            if not stream:
                async for _ in events:
                    self._timed(last)
                return web.json_response(out.whole(gen))
        except SwarmError as e:
            raise _api_error(e, self.config.retry_after) from None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", **self._cors()})
        await response.prepare(request)
        request[STREAMING] = True
        writer = _Writer(request, response, self.config.write_timeout)
        try:
            for chunk in out.opening() + out.chunks(first):
                await writer.send(chunk)
            while (deltas := await self._next(events, gen, writer)) is not None:
                self._timed(last)
                for chunk in out.chunks(deltas):
                    await writer.send(chunk)
            if include_usage:
                await writer.send(out.usage_chunk(gen))
        except SwarmError as e:  # the stream has started: the error goes in it
            await writer.send(_api_error(e, self.config.retry_after).body())
        except (_ClientGone, asyncio.CancelledError):
            raise
        except Exception:  # boundary: a bug ends this stream with an error event; the server keeps serving
            logger.exception("%s failed during its stream", request.path)
            await writer.send(ApiError(500, "internal error", type="server_error", code="internal").body())
        await writer.send_raw(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _next(self, events, gen: Generation, writer: _Writer) -> list | None:
        """The next deltas of a started stream (None at its end); while the generation waits for blocks to be
        served again, an SSE comment every `keepalive_s` keeps the connection open."""
        task = asyncio.ensure_future(anext(events, None))
        try:
            for _ in range(1_000_000):  # bounded; a wait for blocks ends within `wait_for_blocks` anyway
                done, _pending = await asyncio.wait({task}, timeout=self.keepalive_s)
                if done:
                    return task.result()
                if gen.waiting:
                    await writer.send_raw(f": {gen.waiting}\n\n".encode())
            raise RuntimeError("a generation step never ended")
        finally:
            if not task.done():  # the client went away or we were cancelled: the step goes too
                task.cancel()
                await asyncio.wait({task})


class _ClientGone(Exception):
    """The client of a stream stopped reading or went away."""


class _Writer:
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
            raise _ClientGone("it stopped reading" if isinstance(e, asyncio.TimeoutError) else "connection lost") \
                from None


def _api_error(err: SwarmError, retry_after: int) -> ApiError:
    if isinstance(err, NoRoute):
        return ApiError(503, str(err), type="service_unavailable", code="no_route",
                        headers={"Retry-After": str(retry_after)})
    if err.code == "bad_request":
        return ApiError(400, str(err), code="bad_request")
    return ApiError(502, f"the swarm failed: {err}", type="server_error", code=err.code)


# ---- the process ----

def context_length_of(model_config, configured: int | None) -> int:
    native = getattr(model_config, "max_position_embeddings", None) or 4096
    return configured if configured is not None else min(int(native), 4096)


async def serve(config: ApiConfig, client_config: ClientConfig, path: Path, stop: asyncio.Event,
                on_ready: Callable[[str], None] | None = None) -> None:
    """Run the gateway for the checkpoint at `path` until `stop` is set."""
    from transformers import AutoTokenizer, GenerationConfig

    from swarm.checkpoint import Checkpoint
    from swarm.head import ModelHead
    from swarm.identity import Identity
    from swarm.precision import Precision
    from swarm.records import default_model_id
    from swarm.transport import Node

    if not client_config.initial_peers:
        raise ConfigError("no initial peers: give the multiaddr of the swarm's bootstrap node or of any peer")
    loop = asyncio.get_running_loop()
    ckpt = await loop.run_in_executor(None, Checkpoint, path)
    model_id = client_config.model_id or default_model_id(path)
    where = Precision.of(client_config.device, client_config.dtype)
    head = await loop.run_in_executor(None, lambda: ModelHead(ckpt, dtype=where.dtype, device=where.device))
    tokenizer = await loop.run_in_executor(None, AutoTokenizer.from_pretrained, path)
    generation_config = GenerationConfig.from_pretrained(path) if (Path(path) / "generation_config.json").exists() \
        else None
    async with Node(Identity.generate(), initial_peers=client_config.initial_peers, client_mode=True) as node:
        client = SwarmClient(node, model_id, ckpt.num_blocks, client_config)
        gateway = Gateway(config, client, head, tokenizer, model_id, context_length_of(ckpt.config, config.context_length),
                          stop_token_ids(tokenizer, generation_config))
        try:
            gateway.server = await http.start(gateway.app(), config.host, config.port, gateway.limits, what="the API")
            url = f"{gateway.server.url}/v1"
            logger.info("api at %s serving model %s (%d blocks in the swarm; context %d tokens)", url, model_id,
                        ckpt.num_blocks, gateway.context_length)
            print(f"api at {url}", flush=True)
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
        finally:
            await gateway.close()


def run_api(args) -> int:
    from client.cli import model_path
    from swarm.config import from_args
    from swarm.signals import run_until_signal

    config = from_args(ApiConfig, args)
    client_config = from_args(ClientConfig, args)
    path = model_path(args)
    print(f"[api] loading the head of {path}", file=sys.stderr, flush=True)
    return run_until_signal(lambda stop: serve(config, client_config, path, stop))
