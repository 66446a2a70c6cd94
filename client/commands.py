"""Subcommands of the client: generate, chat, status, demo, api. Light at import: the work (torch,
transformers, the network) is imported when a command runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

DEFAULT_PROMPT = "Give three tips for staying healthy."


def _client_options(p: argparse.ArgumentParser) -> None:
    from client.config import ClientConfig
    from swarm.config import add_options

    p.add_argument("--model", default=None, help="the model: a hub repo id (org/name or org/name@revision) or a "
                   "checkpoint directory; its config, tokenizer and head are read locally, its blocks run in the "
                   "swarm (default: the prepared demo model)")
    add_options(p, ClientConfig)


def _generation_options(p: argparse.ArgumentParser, max_new_tokens: int, speculate: int, speculate_help: str) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="how many tokens to generate at most")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep this probability mass")
    p.add_argument("--top-k", type=int, default=None, help="sample among this many most likely tokens")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--speculative-tokens", type=int, default=speculate, metavar="K", help=speculate_help)


def register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text through a swarm, streamed to stdout",
                       description="Continue PROMPT with a model whose blocks run in the swarm; text streams "
                       "to stdout as it is generated, the route and speed go to stderr.")
    # optional to the parser only: after `--initial-peers ADDR` the prompt is taken as one more peer, and
    # `prompt_after_peers` gives it back (the command refuses a missing prompt)
    p.add_argument("prompt", nargs="?", help="the text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _client_options(p)
    _generation_options(p, 64, 16, "draft up to K tokens per step by prompt lookup, checked in one step through the "
                        "swarm: fewer round trips when the answer copies from the prompt, the same tokens; the "
                        "number adapts to what the model accepts (default: 16; 0: off)")
    p.set_defaults(run=lambda args: _load("run_generate")(args))


def register_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="an interactive chat with a model served by a swarm",
                       description="Chat with the model's chat template; one inference session keeps the "
                       "conversation's cache on the peers. An empty line or Ctrl-D ends the chat.")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-length", type=int, default=2048, help="tokens the whole conversation may use")
    _client_options(p)
    _generation_options(p, 256, 0, "greedy only: draft up to K tokens per step with transformers' prompt lookup "
                        "(prompt_lookup_num_tokens), the same tokens; its draft length does not adapt, so it is off "
                        "by default (0)")
    p.set_defaults(run=lambda args: _load("run_chat")(args))


def register_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="who serves which blocks of a model, how fast, and what is uncovered; "
                       "without a model, every model of the swarm",
                       description="Read the swarm's announcements for one model, ping every online peer, "
                       "and print peers, their blocks, state, throughput, cache left and latency. Without --model "
                       "and --model-id: every model announced in the swarm, its blocks covered and peers online.")
    _client_options(p)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="the model's number of blocks, when no checkpoint is at hand (then give --model-id)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=lambda args: _load("run_status")(args))


# the fastest format that meets the quality targets on the demo model (docs/benchmarks.md, "Precision")
DEMO_DTYPE, DEMO_QUANT = "auto", "int8"


def register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="start a local swarm (bootstrap + peers) on the demo model and generate text through it",
        description="Prepare the offline demo model (once), start a bootstrap node and peers as separate "
        "processes on 127.0.0.1, stream a generated answer through them, report the route and tokens "
        "per second, then stop every process.",
    )
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="what to ask the model")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the prepared demo model)")
    p.add_argument("--peers", type=int, default=3, help="how many peers to start (the blocks are split among them)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--dtype", default=DEMO_DTYPE, choices=["auto", "float32", "bfloat16", "float16"],
                   help=f"the peers' dtype (default: {DEMO_DTYPE}; see docs/operations.md)")
    p.add_argument("--quant", default=DEMO_QUANT, choices=["none", "int8", "nf4"],
                   help=f"the peers' weight format (default: {DEMO_QUANT})")
    # SUPPRESS: `swarm -v demo` keeps its -v; `swarm demo -v` says the same. Without it the demo logs errors
    # only: a reroute around a slow peer is the swarm at work, not news in the middle of the answer.
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log every message, debug ones too (default: only the swarm coming up, the route, the answer "
                   "and its speed)")
    _generation_options(p, 96, 16, "draft up to K tokens per step by prompt lookup (default: 16; 0: off)")
    p.set_defaults(run=lambda args: _load("run_demo", "client.demo")(args), log_level=logging.ERROR)


def _load(name: str, module: str = "client.cli"):
    import importlib

    return getattr(importlib.import_module(module), name)


def register_api(sub: argparse._SubParsersAction) -> None:
    from client.config import ApiConfig, ClientConfig
    from swarm.config import add_options

    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API backed by the swarm",
                       description="Serve /v1/models, /v1/completions and /v1/chat/completions (streaming too) "
                       "for one or more models whose blocks run in the swarm (a request's `model` picks one), and "
                       "Prometheus metrics at /metrics. Point any OpenAI client at http://HOST:PORT/v1.")
    p.add_argument("--model", action="append", default=None, help="a model to serve, a hub repo id (org/name) or a "
                   "checkpoint directory: its "
                   "config, tokenizer and head are read locally, its blocks run in the swarm; repeat it to serve "
                   "several models (default: the prepared demo model)")
    p.add_argument("--model-id", dest="model_ids", action="append", default=None, metavar="ID",
                   help="the model's name in the swarm (default: the name its peers give it: its marker's, else one "
                   "made of its weights' digest); with several --model, none or one per --model, in the same order")
    p.add_argument("--all-models", action="store_true", help="serve every model the swarm announces under a hub "
                   "repo id (org/name), each fetched from the hub as a client fetches it; with --model, those too")
    add_options(p, ClientConfig, skip=("model_id",))
    add_options(p, ApiConfig)
    p.set_defaults(run=lambda args: _load("run_api", "client.api.gateway")(args))
