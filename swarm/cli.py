"""The `swarm` command: one parser, subcommands contributed through entry points.

Each package registers its subcommands under the `swarm.commands` entry-point group (see
pyproject.toml), so this module, in the bottom layer, never imports `peer`, `client` or `bootstrap`.
A registration function receives the subparsers object and adds one parser whose `run` default is
called with the parsed arguments. Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from importlib.metadata import entry_points

from swarm.errors import SwarmError

ENTRY_POINT_GROUP = "swarm.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="Run a language model too big for one machine across a swarm of peers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def cache_home() -> str:
    """Where prepared models and identities live: $SWARM_HOME, else the XDG cache directory."""
    if os.environ.get("SWARM_HOME"):
        return os.environ["SWARM_HOME"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "swarm")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        # Our own log lines say what loads and how long it took; transformers' per-tensor progress bars
        # ("Loading weights") only add noise. Set before anything imports it; children inherit it.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(
        # a command may ask for a quieter default (`swarm demo` shows only its own lines): its `log_level`
        level=logging.DEBUG if args.verbose else getattr(args, "log_level", logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for chatty in ("httpx", "httpx2", "httpcore"):  # one line per HTTP request of the hub client
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    args.cache_home = cache_home()
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SwarmError as e:  # boundary: typed errors become a one-line message, not a traceback
        print(f"swarm {args.command}: {e}", file=sys.stderr)
        return 1
    finally:
        # The command is done and has released what it owns; what is left is the heap torch and transformers
        # built at import, which the interpreter's collections at exit would traverse for 1-3 s on a busy
        # machine (measured: 1.9 s for the client's imports). See `swarm.signals`.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
