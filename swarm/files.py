"""Small state files the processes keep (hashes, block costs, known and stalled peers): written whole, atomically."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any, **dump: Any) -> None:
    """`data` as JSON at `path`, through a temporary file beside it renamed into place, so that a reader (another
    process starting now) never sees half a file. Raises `OSError`, the temporary file removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, **dump)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
