"""Frozen configuration dataclasses become command-line options, one option per field.

A field's metadata gives its help text (`help`), and optionally a parser for its text form (`parse`)
and a `flag` name. Tuple fields take one or more values. Defaults come from the dataclass, so the
CLI and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable


def option(default: Any = dataclasses.MISSING, *, help: str, parse: Callable[[str], Any] | None = None,
           required: bool = False, metavar: str | None = None, **kw: Any) -> Any:
    """A dataclass field carrying its command-line help (and the placeholder of its value, `metavar`)."""
    meta = {"help": help, "parse": parse, "required": required, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults")
    return dataclasses.field(default=default, metadata=meta, **kw)


def check_positive(config: Any, names: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    """`ConfigError` naming every option in `names` whose value is not positive (plus `extra` ones)."""
    from swarm.errors import ConfigError

    bad = [f"--{n.replace('_', '-')}" for n in names if not getattr(config, n) > 0] + list(extra)
    if bad:
        raise ConfigError(f"{', '.join(bad)} must be positive")


def check_port(port: int | None, flag: str) -> None:
    """`ConfigError` unless `port` is None or a TCP port number (0: any free port)."""
    from swarm.errors import ConfigError

    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"{flag} {port} is not a TCP port")


def check_dtype(dtype: str) -> None:
    from swarm.errors import ConfigError

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16, not {dtype!r}")


def add_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """An option per field of `cls` with help text, but those named in `skip` (a command that parses them its
    own way)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if f.default is not dataclasses.MISSING and f.default is not None and f.default != ():
            kw["help"] += f" (default: {f.default})"
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **kw)
            continue
        if origin is tuple:
            kw["nargs"] = "+" if meta["required"] else "*"
            kw["type"] = meta["parse"] or args[0]
        else:
            base = [a for a in args if a is not type(None)][0] if origin in (typing.Union, types.UnionType) else hint
            kw["type"] = meta["parse"] or base
        kw["metavar"] = meta.get("metavar") or (f.name.upper().split("_")[-1] if not meta["required"]
                                                else f.name.upper())
        parser.add_argument(flag, required=meta["required"], default=None if meta["required"] else f.default, **kw)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    for f in dataclasses.fields(cls):
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)
