"""Headless Chromium (Debian's `chromium` package) for tests and the docs screenshot: load a page, let
its scripts run, and return the resulting DOM, or save a PNG.

No browser is ever downloaded: a missing Chromium is an error naming the apt command, never a skip.
The flags keep Chromium off the network except for the page itself (these machines are offline).
Each call runs one Chromium with a fresh profile; on a timeout its whole process group, which it
started in a session of its own, is killed.
"""

from __future__ import annotations

import html.parser
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
         "--disable-dev-shm-usage")  # /dev/shm is small in containers: a full one crashes the renderer


def chromium() -> str:
    path = next((p for p in ("/usr/bin/chromium", shutil.which("chromium")) if p and os.access(p, os.X_OK)), None)
    if path is None:
        raise RuntimeError("Chromium is missing: the health page's browser test needs it. Install it with "
                           "`sudo apt-get install -y chromium` (.ci/run and `make test` as root do this).")
    return path


def _run(url: str, args: tuple[str, ...], budget_ms: int, timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}",
                                 f"--virtual-time-budget={budget_ms}", *args, url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the Chromium started just above, nothing else
            proc.communicate()
            raise TimeoutError(f"Chromium did not finish loading {url} within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"Chromium exited with {proc.returncode} loading {url}:\n{err[-2000:]}")
    return out


def dump_dom(url: str, budget_ms: int = 3000, timeout: float = 60) -> str:
    """The page's DOM as HTML after its scripts ran for `budget_ms` of virtual time."""
    return _run(url, ("--dump-dom",), budget_ms, timeout)


def screenshot(url: str, path: Path, size: tuple[int, int] = (1400, 900), budget_ms: int = 3000,
               timeout: float = 60) -> Path:
    """A PNG of the page's first `size` pixels (width, height), after its scripts ran."""
    _run(url, (f"--screenshot={Path(path).resolve()}", f"--window-size={size[0]},{size[1]}"), budget_ms, timeout)
    if not Path(path).exists():
        raise RuntimeError(f"Chromium wrote no screenshot of {url}")
    return Path(path)


@dataclass(frozen=True)
class Element:
    tag: str
    attrs: dict[str, str]

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _Collector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[Element] = []

    def handle_starttag(self, tag, attrs):
        self.found.append(Element(tag, {k: v or "" for k, v in attrs}))


def elements(dom: str) -> list[Element]:
    """Every element of `dom` with its attributes, in document order."""
    parser = _Collector()
    parser.feed(dom)
    return parser.found
