"""Subcommands of the client. Light at import: the work is imported when a command runs."""

from __future__ import annotations

import argparse


def register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="prepare the demo model and generate text through three chained spans",
        description="Prepare the offline demo model (once), split it into spans, and stream a "
        "generated answer through them, reporting tokens per second.",
    )
    p.add_argument("prompt", nargs="?", default="Give three tips for staying healthy.",
                   help="what to ask the model")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the prepared demo model)")
    p.add_argument("--spans", type=int, default=3, help="how many spans to split the blocks into")
    p.add_argument("--max-new-tokens", type=int, default=96, help="how many tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from client.local_demo import run_demo

    return run_demo(args)
