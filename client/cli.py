"""What `swarm generate`, `swarm chat` and `swarm status` do (registered in `client.commands`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from client.config import ClientConfig
from swarm.config import from_args
from swarm.errors import BadRequest, ConfigError, NoRoute


def model_path(args: argparse.Namespace) -> Path | str:
    """--model as given, else the prepared demo model's directory."""
    if args.model is not None:
        return args.model
    from swarm.local.demo_model import default_demo_dir, prepare_demo_model

    return prepare_demo_model(default_demo_dir(args.cache_home))


def client_weights(args: argparse.Namespace):
    """--model opened for a client: a directory, or a hub model whose config, tokenizer and head shards
    are fetched (`swarm.weights.models`)."""
    from swarm.weights.models import open_weights

    return open_weights(model_path(args), getattr(args, "revision", None), role="client",
                        model_id=getattr(args, "model_id", None))


def prompt_after_peers(args: argparse.Namespace) -> None:
    """`swarm generate --initial-peers ADDR "prompt"`: the peers' list (one or more values) took the prompt
    too; a multiaddr starts with "/", a prompt that follows them is given back. No prompt: a ConfigError."""
    peers = list(args.initial_peers)
    if args.prompt is None and peers and not peers[-1].startswith("/"):
        args.prompt, args.initial_peers = peers[-1], peers[:-1]
    if args.prompt is None:
        raise ConfigError("give the text to continue (PROMPT)")


def generation_kwargs(args: argparse.Namespace, tokenizer) -> dict:
    """transformers `generate` arguments from the command line: greedy unless a temperature is given."""
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be positive")
    from client.generation import stop_token_ids

    kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    stop = stop_token_ids(tokenizer)
    if stop:
        kwargs["eos_token_id"] = stop
    speculate = getattr(args, "speculative_tokens", 0) or 0
    if speculate < 0:
        raise ConfigError("--speculative-tokens must be 0 or more")
    if args.temperature is None or args.temperature == 0:
        return {**kwargs, "do_sample": False, **({"prompt_lookup_num_tokens": speculate} if speculate else {})}
    if not args.temperature > 0:
        raise ConfigError("--temperature must be positive")
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    sampling = dict(do_sample=True, temperature=args.temperature)
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    return {**kwargs, **sampling}


def open_model(args: argparse.Namespace, path, tag: str):
    from client.model import DistributedModelForCausalLM

    config = from_args(ClientConfig, args)
    model = DistributedModelForCausalLM.from_pretrained(path, config=config)
    # on a line of its own: the answer streams to stdout, maybe in the middle of a line
    model.on_wait = lambda message: print(f"\n[{tag}] {message}", file=sys.stderr, flush=True)
    return model


class TimedStreamer:
    """A transformers streamer writing text as it comes and timing every token."""

    def __init__(self, tokenizer, out=sys.stdout, skip_prompt: bool = True):
        from transformers import TextStreamer

        self.times: list[float] = []
        self._prompt_pending = skip_prompt  # the first call carries the prompt
        self._text = TextStreamer(tokenizer, skip_prompt=skip_prompt, skip_special_tokens=True)
        self._text.on_finalized_text = self._write
        self.out, self.text = out, ""

    def _write(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()
        self.text += text

    def put(self, value) -> None:
        if self._prompt_pending:
            self._prompt_pending = False
        else:
            self.times.append(time.perf_counter())
        self._text.put(value)

    def end(self) -> None:
        self._text.end()

    def stats(self, started: float) -> dict:
        tokens = len(self.times)
        decode = self.times[-1] - self.times[0] if tokens > 1 else 0.0
        return {"tokens": tokens, "ttft_s": self.times[0] - started if tokens else None,
                "tokens_per_s": (tokens - 1) / decode if decode > 0 else 0.0}


def describe_route(hops) -> str:
    return " -> ".join(["head", *(str(h) for h in hops), "head"])


def stream_answer(model, tokenizer, prompt: str, args: argparse.Namespace, chat: bool, out=sys.stdout) -> dict:
    """Generate a continuation of `prompt` (wrapped in the chat template if `chat`), streamed to `out`; returns
    the token count, time to first token and decode speed. It runs as `swarm api` runs a request
    (`client.generation`): prompt-lookup drafts checked in one step (`--speculative-tokens`, adapted to what
    the model accepts), greedy or sampled with the same tokens as without drafts."""
    from concurrent.futures import ThreadPoolExecutor

    from client.generation import Generation, stop_token_ids
    from client.sampling import Sampling

    text = prompt
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    ids = tokenizer(text)["input_ids"]
    sampling = Sampling(max_tokens=args.max_new_tokens, **sampling_options(args))
    times: list[float] = []
    with ThreadPoolExecutor(1, thread_name_prefix="swarm-head") as pool:
        gen = Generation(model.connection.client, model.head, tokenizer, pool, ids, sampling,
                         stop_token_ids(tokenizer, model.generation_config))

        async def run() -> None:
            try:
                async for deltas in gen.run():
                    for delta in deltas:
                        out.write(delta.text)
                        out.flush()
                    made = gen.completion_tokens - len(times)
                    times.extend([time.perf_counter()] * made)  # tokens released together arrive together
            finally:
                if gen.closing is not None:
                    await gen.closing

        started = time.perf_counter()
        # every step is bounded by its deadlines, failovers and waits for blocks included
        connection = model.connection
        connection.run(run(), connection.longest_wait + sampling.max_tokens * connection.config.step_timeout)
    tokens = len(times)
    decode = times[-1] - times[0] if tokens > 1 else 0.0
    return {"tokens": tokens, "ttft_s": times[0] - started if tokens else None,
            "tokens_per_s": (tokens - 1) / decode if decode > 0 else 0.0, "drafted": gen.drafted,
            "accepted": gen.accepted, "unchecked": [str(hop) for hop in gen.unchecked]}


def unchecked_note(stats: dict) -> str | None:
    """What a command says of the blocks no other peer could check (`client.checked`), if any."""
    from client.checked import unchecked_message

    return unchecked_message(stats["unchecked"]) if stats["unchecked"] else None


def sampling_options(args: argparse.Namespace) -> dict:
    """`client.sampling.Sampling` fields from the command line: greedy unless a temperature is given."""
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be positive")
    if args.speculative_tokens < 0:
        raise ConfigError("--speculative-tokens must be 0 or more")
    options = dict(temperature=0.0, seed=args.seed, speculate=args.speculative_tokens)
    if args.temperature is not None and args.temperature != 0:
        if not args.temperature > 0:
            raise ConfigError("--temperature must be positive")
        options["temperature"] = args.temperature
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1]")
        options["top_p"] = args.top_p
    if args.top_k is not None:
        if args.top_k < 0:
            raise ConfigError("--top-k must be 0 or more")
        options["top_k"] = args.top_k
    return options


def run_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    prompt_after_peers(args)
    weights = client_weights(args)
    tokenizer = AutoTokenizer.from_pretrained(weights.directory)
    with open_model(args, weights, "generate") as model:
        route = model.route()
        predicted = model.connection.client.route_cost_ms(route)
        print(f"[generate] route: {describe_route(route)}; predicted {predicted:.1f} ms per decode step through the "
              "swarm", file=sys.stderr)
        stats = stream_answer(model, tokenizer, args.prompt, args, chat=args.chat)
    print(file=sys.stderr)
    drafts = f", {stats['accepted']} of {stats['drafted']} drafted tokens kept" if stats["drafted"] else ""
    # per token; with drafted tokens kept, a decode step gives more than one, so it is below the step's time
    per_token = f" ({1e3 / stats['tokens_per_s']:.1f} ms per token)" if stats["tokens_per_s"] > 0 else ""
    print(f"[generate] {stats['tokens']} tokens, decode {stats['tokens_per_s']:.1f} tokens/s{per_token}{drafts}",
          file=sys.stderr)
    if note := unchecked_note(stats):
        print(f"[generate] {note}", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    weights = client_weights(args)
    tokenizer = AutoTokenizer.from_pretrained(weights.directory)
    if not tokenizer.chat_template:
        raise ConfigError(f"{weights.ref} has no chat template: use `swarm generate` instead")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with open_model(args, weights, "chat") as model, model.inference_session(max_length=args.max_length) as session:
        print(f"[chat] route: {describe_route(model.route())}; an empty line ends the chat", file=sys.stderr)
        for _turn in range(10_000):
            try:
                line = input("> ").strip()
            except EOFError:
                break
            if not line:
                break
            messages.append({"role": "user", "content": line})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            if ids.shape[1] + args.max_new_tokens > args.max_length:
                print(f"[chat] the conversation is at {ids.shape[1]} tokens of {args.max_length}: ending it",
                      file=sys.stderr)
                break
            streamer = TimedStreamer(tokenizer)
            try:
                out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), streamer=streamer,
                                     **generation_kwargs(args, tokenizer))
            except BadRequest as e:
                print(f"[chat] {e}", file=sys.stderr)
                break
            print()
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        failovers = len(session.failovers)
    if failovers:
        print(f"[chat] {failovers} failovers during the chat", file=sys.stderr)
    return 0


def run_status(args: argparse.Namespace) -> int:
    """One model's peers (`--model`, or `--model-id` with `--num-blocks`), or, given neither, every model of
    the swarm: its blocks covered and its peers online."""
    from client.connection import JOIN_TIMEOUT, SwarmConnection, joined_node
    from client.inference.survey import survey
    from client.loop import LoopThread
    from swarm.model.checkpoint import Checkpoint
    from swarm.span import span_starts

    def peer_json(p) -> dict:
        return {"peer": p.peer, "start": p.span.start, "end": p.span.end, "state": p.state, "throughput": p.throughput,
                "cache_tokens_left": p.cache_tokens_left, "version": p.version,
                "latency_ms": None if p.latency_ms is None else round(p.latency_ms, 2),
                "sessions": p.sessions, "queued": p.queued, "since": p.since, "links": p.links, "device": p.device,
                "dtype": p.dtype, "quant": p.quant, "digest": p.digest, "reach": p.reach}

    config = from_args(ClientConfig, args)
    if args.model is None and not config.model_id and args.num_blocks is None:  # every model of the swarm
        async def every_model():
            async with joined_node(config) as node:
                return await survey(node, config)

        with LoopThread("swarm-status") as loop:
            models = loop.run(every_model(), timeout=JOIN_TIMEOUT + 60)
        if args.json:
            print(json.dumps({"models": [
                {"model": m.model, "num_blocks": m.num_blocks, "covered": m.covered, "uncovered": m.uncovered,
                 "online": m.online, "peers": [peer_json(p) for p in m.peers]} for m in models]}, indent=2))
            return 0
        if not models:
            print("no model is announced in the swarm")
            return 0
        print(f"{len(models)} model{'s' if len(models) > 1 else ''} in the swarm")
        print(f"{'MODEL':<40} {'BLOCKS COVERED':>14} {'PEERS ONLINE':>12}  UNCOVERED")
        for m in models:
            print(f"{m.model:<40} {f'{m.covered}/{m.num_blocks}':>14} {f'{m.online}/{len(m.peers)}':>12}  "
                  + (", ".join(map(str, m.uncovered)) if m.uncovered else "none"))
        return 0
    digest = starts = None
    if args.num_blocks is not None:
        if not config.model_id:
            raise ConfigError("--num-blocks needs --model-id")
        model_id, num_blocks = config.model_id, args.num_blocks
    else:
        weights = client_weights(args)
        model_id, digest = weights.name, weights.digest
        ckpt = Checkpoint(weights.directory, source=weights.source)
        num_blocks, starts = ckpt.num_blocks, span_starts(ckpt.config)
    connection = SwarmConnection(model_id, num_blocks, config, digest=digest, starts=starts)
    try:
        peers, uncovered = connection.run(connection.client.status(), timeout=60)
        try:
            route = [] if uncovered else connection.run(connection.client.route(), timeout=60)
        except NoRoute:  # every server of some block failed its ping just now
            route = []
        predicted = connection.client.route_cost_ms(route) if route else None
    finally:
        connection.close()
    if args.json:
        print(json.dumps({"model": model_id, "num_blocks": num_blocks, "uncovered": uncovered,
                          "peers": [peer_json(p) for p in peers],
                          "route": [{"peer": h.peer, "start": h.span.start, "end": h.span.end} for h in route],
                          "predicted_ms_per_token": None if predicted is None else round(predicted, 2)}, indent=2))
        return 0
    online = sum(p.state == "online" for p in peers)
    print(f"model {model_id}: {num_blocks} blocks, {len(peers)} peers announced, {online} online")
    versions = sorted({p.digest or "-" for p in peers})
    if len(versions) > 1 or digest is not None:
        mine = f"; this checkpoint's: {digest[:12]}" if digest else ""
        print(f"weights served: {', '.join(v[:12] for v in versions)}{mine} (peers with other weights are never "
              "in one route)")
    print(f"{'PEER':<54} {'BLOCKS':<10} {'STATE':<8} {'DEVICE':<6} {'WEIGHTS':<14} {'DIGEST':<12} {'REACH':<6} {'TOKENS/S':>9} "
          f"{'CACHE LEFT':>11} {'SESSIONS':>8} {'QUEUED':>6} {'LATENCY':>9}  VERSION")
    for p in peers:
        latency = "-" if p.latency_ms is None else f"{p.latency_ms:.1f} ms"
        sessions, queued = ("-" if v is None else str(v) for v in (p.sessions, p.queued))
        print(f"{p.peer:<54} {str(p.span):<10} {p.state:<8} {p.device:<6} {p.format:<14} {(p.digest or '-')[:12]:<12} "
              f"{p.reach or '-':<6} {p.throughput:>9.1f} "
              f"{p.cache_tokens_left:>11} {sessions:>8} {queued:>6} {latency:>9}  {p.version}")
    print("uncovered blocks: " + (", ".join(map(str, uncovered)) if uncovered else "none"))
    if route:
        print(f"route now: {describe_route(route)}; predicted {predicted:.1f} ms per token through the swarm")
    return 0
