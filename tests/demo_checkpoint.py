"""The demo checkpoint of the tests: $SWARM_TEST_DEMO_DIR, else <repo>/.cache/demo-model (repo-local and
gitignored, so CI caches and later runs skip the conversion).

A run that reaches the modules that use it, and finds it missing, converts it in a background process
from the session's start: the conversion (a minute on two cores) overlaps the collection and the tests
that run before the first one that needs it (those modules run last in their folder, see `conftest.py`).
The fixture waits for that process, then calls `prepare_demo_model`, which returns at once for a complete
checkpoint and otherwise builds it in the test process, raising its error there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USERS = (REPO / "tests" / "integration", REPO / "tests" / "models")  # folders with modules that use it
WAIT_S = 900.0  # the conversion's own pip install may take up to this long (see swarm.local.demo_model)


def directory() -> Path:
    return Path(os.environ.get("SWARM_TEST_DEMO_DIR") or REPO / ".cache" / "demo-model")


def reached(args: list[str]) -> bool:
    """Whether a run of these paths collects whole folders that hold modules using the demo checkpoint (a
    run of single files converts it when a test first needs it)."""
    for arg in args:
        path = Path(arg.split("::")[0]).resolve()
        if path.is_dir() and any(path == u or path in u.parents or u in path.parents for u in USERS):
            return True
    return False


class Conversion:
    """At most one background `swarm demo-model --dir DIR`, stopped (waited for) by `finish`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None

    def start(self, target: Path) -> None:
        from swarm.local.demo_model import is_prepared

        if self.proc is not None or is_prepared(target):
            return
        fd, name = tempfile.mkstemp(prefix="swarm-demo-model-", suffix=".log")
        self.log = Path(name)
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "swarm.cli", "demo-model", "--dir", str(target)],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def finish(self) -> str:
        """Wait for the background conversion, if any (killed past `WAIT_S`); returns its output."""
        if self.proc is None:
            return ""
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        self.log.unlink(missing_ok=True)
        return text
