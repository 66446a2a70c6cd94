"""`swarm api`: an OpenAI-compatible HTTP API whose models run in the swarm. This module is the server:
routes, admission (generation slots and queue), connection guards, metrics and the process.

Several models: the gateway serves each `ServedModel` (`client.api.served`: its own client, head, tokenizer
and context length) under its model id, and routes every request by its `model` field; a model it does not
serve is a 404 `model_not_found`. The tokenizer endpoints take `model` as optional: it may be left out while
one model is served. The generation slots and queue, the thread pools, the connection guards and the one
DHT node are shared by every model: they bound what this process does, whatever the model.

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions` (one or more prompts),
`POST /v1/chat/completions` (the model's chat template), `POST /v1/embeddings`, vLLM's tokenizer endpoints
(`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`), `GET /metrics` (Prometheus) and a chat page
at `GET /` (`client.api.chat_page`). Its parts:
`client.api.requests` parses requests into typed values once (and `Sampling` at one boundary),
`client.api.responses` shapes the answers, `client.api.stream` runs a request's generations and streams
them, `client.api.embeddings` and `client.api.tokenizer` serve their endpoints. One process, one event
loop: the HTTP server, a client-mode DHT node (`client.connection.joined`, as every client joins) and every
generation (`client.generation`) share it; the head runs in a small thread pool.

A generation whose blocks lost their last peer waits for them (`ClientConfig.wait_for_blocks`); a
stream that has started meanwhile gets an SSE comment (`: waiting for blocks ...`) every
`KEEPALIVE_S`, so that clients and proxies keep the connection open. A request not streamed just waits.

Errors are OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`):
400 invalid parameters, 404 unknown model or path, 405 wrong method, 408 a body that does not arrive in
time, 413 an oversize body, 503 with `Retry-After` when some blocks have no live peer or every
generation slot and queue place is taken, 500 for a bug (logged). A failure after a stream has started
is sent as a final `data: {"error": ...}` event.

Limits: `max_generations` requests run at once (a request's prompts together) and `max_queue` more wait for
a slot; the connection guards of `swarm.http` (header deadline, connection cap with eviction, body deadline
and size). A client that disconnects cancels its request's task, which closes its peer sessions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from client.api import chat_page, embeddings as api_embeddings, tokenizer as api_tokenizer, tools as api_tools

from client.api.errors import model_not_found
from client.api.requests import ApiError, Common, invalid, parse_chat, parse_completion
from client.api.metrics import ApiMetrics
from client.api.responses import ResponseBodies, unchecked_headers
from client.api.keys import ApiKeys
from client.api.reuse import Reuse
from client.api.served import ServedModel, load, served_models
from client.api.stream import ClientGone, Runs, Writer, api_error
from client.config import ApiConfig, ClientConfig
from client.generation import Generation
from client.head_queue import HeadQueue
from client.sampling import Sampling
from client.connection import joined_node, require_peers
from client.inference.stalls import StallMemory
from client.inference.swarm_client import SwarmClient
from swarm import http, metrics
from swarm.errors import ConfigError, SwarmError

logger = logging.getLogger(__name__)

STREAMING = web.RequestKey("streaming", bool)  # set once a response's head is sent: errors go into the stream
USER = web.RequestKey("user", str)  # the API key's user ("" without keys: `client.api.keys`)
KEEPALIVE_S = 5.0  # seconds between SSE comments while a started stream waits for blocks


class Gateway:
    """The HTTP application over some models of the swarm (see the module docstring)."""

    def __init__(self, config: ApiConfig, models: list[ServedModel]):
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.config = config
        self.served = {m.model_id: m for m in models}  # in the order given, as /v1/models lists them
        self.created = int(time.time())
        self.limits = config.limits
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="api-head")
        # per model, the head's logits of every generation that is ready, in one call (`client.head_queue`)
        self.heads = {m.model_id: HeadQueue(m.head, self.executor) for m in models}
        # one thread: a huge prompt delays other prompts' tokenizing, never the running generations
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-tokenize")
        self.closing: set[asyncio.Task] = set()  # generations' peer sessions being closed
        self.slots = asyncio.Semaphore(config.max_generations)
        self.waiting = 0
        self.running = 0
        self.server: http.HttpServer | None = None
        self.keepalive_s = KEEPALIVE_S
        self.metrics = ApiMetrics(self)
        # sessions kept for prompts that begin the same way, per model; not for recurrent layers, whose state
        # cannot return to where two prompts part
        self.reuse = {m.model_id: Reuse(m.client, 0 if m.recurrent else config.reuse_tokens, config.reuse_seconds,
                                        self.metrics, m.model_id) for m in models}
        self.keys = ApiKeys.of(config)  # the users, by API key (`client.api.keys`)

    def app(self) -> web.Application:
        app = http.make_app(self.limits)
        app.middlewares.append(self._errors)
        app.router.add_get("/", chat_page.serve)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        metrics.add_route(app, self.metrics.registry)
        return app

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        await asyncio.gather(*(reuse.close() for reuse in self.reuse.values()))
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
            if request.path != "/" and request.path != "/metrics":  # the page itself, and the operator's figures
                request[USER] = self.keys.user(request.headers.get("Authorization"))
            response = await handler(request)
        except Exception:
            if request.get(STREAMING):  # the response has started: nothing else can be sent on it, and its
                self.metrics.requests.labels(endpoint, "200").inc()  # status went out with its head
                raise
            response = self._error_response(request)
        if not response.prepared:
            response.headers.update(self._cors())
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        if self.keys.on and USER in request:
            self.metrics.user_requests.labels(request[USER], str(response.status)).inc()
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

    def _pick(self, model: Any, required: bool = True) -> ServedModel:
        """The served model a request names (`model`; when not `required`, None names the only one served)."""
        if model is None and not required and len(self.served) == 1:
            return next(iter(self.served.values()))
        if not isinstance(model, str) or not model:
            several = "" if len(self.served) == 1 else \
                f" (this server serves several: {', '.join(repr(m) for m in self.served)})"
            raise invalid("model", f"'model' is required: a string naming the model{several}")
        if model not in self.served:
            raise model_not_found(model, list(self.served))
        return self.served[model]

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], ServedModel]:
        """The request's JSON object, and the served model it names."""
        body = await self._json(request)
        return body, self._pick(body.get("model"))

    async def _json(self, request: web.Request) -> dict[str, Any]:
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
        return body

    async def _tokenize(self, served: ServedModel, chars: int, param: str, fn: Callable) -> list[int]:
        served.check_chars(chars, param)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)

    # ---- endpoints ----

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [m.card(self.created) for m in self.served.values()]})

    async def model(self, request: web.Request) -> web.Response:
        return web.json_response(self._pick(request.match_info["model"]).card(self.created))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, served = await self._body(request)
        req = parse_completion(body, self.config, served.vocab_size)
        tokenizer = served.tokenizer
        prompts = []
        for i, prompt in enumerate(req.prompts):
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = await self._tokenize(served, len(prompt), param, lambda p=prompt: tokenizer(p).input_ids)
                if not ids:
                    raise invalid(param, "the prompt is empty")
            else:
                ids = list(prompt)
            prompts.append((ids, served.max_tokens(req.common, ids, 16, param)))  # OpenAI's default for completions
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else tokenizer.decode(list(p)) for p in req.prompts]
        bodies = ResponseBodies("text_completion", served.model_id, req.common.sampling.n, tokenizer,
                                logprobs=req.logprobs, echo=echo)
        shape = await self._grammar(served, req.common.structure, None)
        samplings = [req.common.settled(max_tokens, logprobs=req.logprobs, grammar=shape,
                                        prompt_logprobs=req.echo and req.logprobs is not None,
                                        speculate=self.config.speculative_tokens)
                     for _, max_tokens in prompts]
        return await self._generate(request, served, bodies, [ids for ids, _ in prompts], samplings, req.common)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, served = await self._body(request)
        req = parse_chat(body, self.config)
        served.check_chat_template()
        tools = [] if req.tools is None else list(req.tools.tools)
        if tools:
            api_tools.check_template(served.tokenizer, served.model_id)
        chars = sum(len(m["content"]) for m in req.messages) + len(json.dumps(tools))
        ids = await self._tokenize(served, chars, "messages", lambda: served.chat_ids(req.messages, tools=tools))
        max_tokens = served.max_tokens(req.common, ids, self.config.max_tokens, "messages")
        bodies = ResponseBodies("chat.completion", served.model_id, req.common.sampling.n, served.tokenizer,
                                logprobs=req.logprobs, tools=req.tools)
        shape = await self._grammar(served, req.common.structure, req.tools)
        sampling = req.common.settled(max_tokens, logprobs=req.logprobs, grammar=shape,
                                      speculate=self.config.speculative_tokens)
        return await self._generate(request, served, bodies, [ids], [sampling], req.common)

    async def _grammar(self, served: ServedModel, structure: tuple[str, Any] | None,
                       tools: api_tools.Tools | None) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, api_tools.output_grammar, structure, tools, served.tokenizer, served.vocab_size,
            served.end_tokens)

    async def embeddings(self, request: web.Request) -> web.Response:
        body, served = await self._body(request)
        req = api_embeddings.parse_embeddings(body, served.vocab_size)
        ids = []
        for i, item in enumerate(req.inputs):
            param = "input" if len(req.inputs) == 1 else f"input[{i}]"
            tokens = list(item) if not isinstance(item, str) else await self._tokenize(
                served, len(item), param, lambda t=item: served.tokenizer(t).input_ids)
            if not 0 < len(tokens) <= served.context_length:
                raise ApiError(400, f"this model's maximum context length is {served.context_length} tokens; the "
                               f"{param} has {len(tokens)}", param=param, code="context_length_exceeded")
            ids.append(tokens)
        await self._slot()
        self.running += 1
        try:
            vectors = await api_embeddings.embed_all(served.client, served.head, self.executor, ids)
        except SwarmError as e:
            raise api_error(e, self.config.retry_after) from None
        finally:
            self.running -= 1
            self.slots.release()
        self.metrics.tokens.labels("prompt", served.model_id).inc(sum(map(len, ids)))
        return web.json_response(api_embeddings.answer(served.model_id, vectors, req.base64, sum(map(len, ids))))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        served = self._pick(body.get("model"), required=False)
        kind, what, flag, strs = api_tokenizer.tokenize_request(body)
        if kind == "messages":
            served.check_chat_template()
            ids = await self._tokenize(served, sum(len(m["content"]) for m in what), "messages",
                                       lambda: served.chat_ids(what, add_generation_prompt=flag))
        else:
            ids = await self._tokenize(served, len(what), "prompt",
                                       lambda: served.tokenizer(what, add_special_tokens=flag).input_ids)
        return web.json_response(api_tokenizer.tokenize_answer(served.tokenizer, ids, served.context_length, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        served = self._pick(body.get("model"), required=False)
        return web.json_response(api_tokenizer.detokenize(body, served.tokenizer, served.vocab_size))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        served = self._pick(request.query.get("model"), required=False)
        return web.json_response(api_tokenizer.tokenizer_info(served.tokenizer, served.context_length))

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

    async def _generate(self, request: web.Request, served: ServedModel, bodies: ResponseBodies,
                        prompts: list[list[int]], samplings: list[Sampling], common: Common) -> web.StreamResponse:
        endpoint = "/v1/chat/completions" if bodies.chat else "/v1/completions"
        model, user = served.model_id, request.get(USER, "")
        self.keys.admit(user)
        try:
            await self._slot()
        except BaseException:
            self.keys.release(user)
            raise
        self.running += 1
        started = time.perf_counter()
        gens = [self._generation(served, ids, sampling, user) for ids, sampling in zip(prompts, samplings)]
        runs = Runs(gens)
        try:
            try:
                return await self._respond(request, runs, bodies, common.stream, common.include_usage)
            finally:
                self.running -= 1
                self.slots.release()
                self.keys.release(user)
                await runs.close()
                for gen in gens:
                    if gen.closing is not None:
                        self.closing.add(gen.closing)
                        gen.closing.add_done_callback(self.closing.discard)
        except (asyncio.CancelledError, ClientGone) as e:
            self.metrics.cancelled.inc()
            logger.info("%s: client went away after %d tokens (%s); generation cancelled", endpoint,
                        sum(g.completion_tokens for g in gens), e if isinstance(e, ClientGone) else "disconnected")
            raise
        finally:
            self.metrics.seconds.labels(endpoint, model).observe(time.perf_counter() - started)
            self.metrics.tokens.labels("prompt", model).inc(sum(g.prompt_tokens for g in gens))
            self.metrics.tokens.labels("completion", model).inc(sum(g.completion_tokens for g in gens))
            accepted = sum(g.accepted for g in gens)
            self.metrics.drafts.labels("accepted").inc(accepted)
            self.metrics.drafts.labels("rejected").inc(sum(g.drafted for g in gens) - accepted)
            for g in gens:
                if g.reuse:
                    self.metrics.reuse_hits.labels(g.reuse, model).inc()
                    self.metrics.reuse_saved.labels(model).inc(g.cached)
                elif g.session is not None:
                    self.metrics.reuse_misses.labels(model).inc()
            failovers = [f for g in gens for f in g.failovers]
            for f in failovers:
                self.metrics.failovers.labels(f.reason, model).inc()
            logger.info("%s %s: %d prompt + %d completion tokens in %.2f s (first token %.2f s)%s", endpoint, model,
                        sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens),
                        time.perf_counter() - started, max(g.first_token_s or 0.0 for g in gens),
                        f", {len(failovers)} failovers" if failovers else "")

    def _generation(self, served: ServedModel, prompt: list[int], sampling: Sampling, user: str) -> Generation:
        """A generation whose session comes from the model's prompt reuse among `user`'s sessions
        (`client.api.reuse`: where a kept or running one holds the most of its prompt), or is a new one for the
        requests it leaves out."""
        reuse = self.reuse[served.model_id]
        reusable = reuse.on and sampling.n == 1 and not sampling.prompt_logprobs and sampling.max_tokens > 0
        return Generation(served.client, served.head, served.tokenizer, self.executor, prompt, sampling,
                          served.end_tokens, sessions=reuse.of(user) if reusable else None,
                          heads=self.heads[served.model_id])

    def _timed(self, last: list[float], model: str) -> None:
        now = time.perf_counter()
        self.metrics.token_seconds.labels(model).observe(now - last[0])
        last[0] = now

    async def _respond(self, request: web.Request, runs: Runs, out: ResponseBodies, stream: bool,
                       include_usage: bool) -> web.StreamResponse:
        try:  # every prompt runs before any header is sent, so its errors keep their status
            first = await runs.first()
            self.metrics.ttft.labels(out.model).observe(max(g.first_token_s or 0.0 for g in runs.gens))
            if not stream:
                await runs.drain()
                return web.json_response(out.whole(runs.gens), headers=unchecked_headers(runs.gens))
        except SwarmError as e:
            raise api_error(e, self.config.retry_after) from None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", **self._cors(),
                                               **unchecked_headers(runs.gens)})
        await response.prepare(request)
        request[STREAMING] = True
        writer = Writer(request, response, self.config.write_timeout)
        last = [time.perf_counter()]
        try:
            for chunk in out.opening(runs.gens) + [c for p, deltas in first for c in out.chunks(p, deltas)]:
                await writer.send(chunk)
            for _ in range(10_000_000):  # bounded; each round waits for a step or a keepalive
                made = await runs.next(self.keepalive_s)
                if made is None:
                    break
                if not made:
                    if runs.waiting:  # a generation waits for blocks: keep the connection open
                        await writer.send_raw(f": {runs.waiting}\n\n".encode())
                    continue
                self._timed(last, out.model)
                for p, deltas in made:
                    for chunk in out.chunks(p, deltas):
                        await writer.send(chunk)
            if include_usage:
                await writer.send(out.usage_chunk(runs.gens))
        except SwarmError as e:  # the stream has started: the error goes in it
            await writer.send(api_error(e, self.config.retry_after).body())
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception:  # boundary: a bug ends this stream with an error event; the server keeps serving
            logger.exception("%s failed during its stream", request.path)
            await writer.send(ApiError(500, "internal error", type="server_error", code="internal").body())
        await writer.send_raw(b"data: [DONE]\n\n")
        await writer.end()
        return response


# ---- the process ----

async def serve(config: ApiConfig, client_config: ClientConfig, models: list, stop: asyncio.Event,
                on_ready: Callable[[str], None] | None = None) -> None:
    """Run the gateway for `models` (`swarm.weights.models.Weights` each) until `stop` is set: each model's
    head and tokenizer load one after another, then one client node joins the swarm for all of them."""
    require_peers(client_config)  # before the heads load
    loaded = []
    for weights in models:
        loaded.append(await load(weights, config, client_config))
        logger.info("loaded %s (%d blocks in the swarm; context %d tokens)", weights.name, loaded[-1].num_blocks,
                    loaded[-1].context_length)
    async with joined_node(client_config) as node:
        served = [dataclasses.replace(m, client=SwarmClient(node, m.model_id, m.num_blocks, client_config, m.digest,
                                                         floor=m.floor, referee=m.referee,
                                                         stalls=StallMemory.of(client_config), starts=m.starts))
                  for m in loaded]
        gateway = Gateway(config, served)
        try:
            gateway.server = await http.start(gateway.app(), config.host, config.port, gateway.limits, what="the API")
            url = f"{gateway.server.url}/v1"
            logger.info("api at %s serving %s", url, ", ".join(m.model_id for m in served))
            print(f"api at {url}", flush=True)
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
        finally:
            await gateway.close()
            logger.info("api closed: %s", ", ".join(m.model_id for m in served))


async def announced_models(client_config: ClientConfig) -> list[str]:
    """The models the swarm's directory lists that can be fetched by name (hub repo ids), by id."""
    from swarm.net import discovery, view
    from swarm.weights.ref import is_repo_id

    async with joined_node(client_config) as node:
        listed = view.models(await discovery.directory(node))
    named = [m for m in listed if is_repo_id(m)]
    skipped = sorted(set(listed) - set(named))
    if skipped:
        logger.info("--all-models: not serving %s (local names, not hub repo ids: give them with --model DIR)",
                    ", ".join(skipped))
    return named


def run_api(args) -> int:
    from swarm.config import from_args
    from swarm.signals import run_until_signal

    config = from_args(ApiConfig, args)
    client_config = from_args(ClientConfig, args)
    values = args.model
    if getattr(args, "all_models", False):
        values = (values or []) + [m for m in asyncio.run(announced_models(client_config)) if m not in (values or [])]
        if not values:
            raise ConfigError("--all-models: the swarm announces no model under a hub repo id (org/name)")
    models = served_models(values, args.model_ids, args.cache_home, client_config.revision)
    return run_until_signal(lambda stop: serve(config, client_config, models, stop))
