"""Headless Chromium (Debian's `chromium` package) for tests and the docs screenshot: load a page, let
its scripts run, and return the resulting DOM, or save a PNG.

No browser is ever downloaded: a missing Chromium is an error naming the apt command, never a skip.
The flags keep Chromium off the network except for the page itself (these machines are offline).
Each call runs one Chromium with a fresh profile; on a timeout its whole process group, which it
started in a session of its own, is killed.

`dump_dom` waits in virtual time, which Chromium lets run on as soon as a fetch's body is read as a
stream (so a page that streams would be dumped before its stream ends); `dom_when` waits in real
time for a condition instead, driving Chromium over its DevTools pipe.
"""

from __future__ import annotations

import html.parser
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
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


class _Refused(RuntimeError):
    """Chromium answered a DevTools call with an error."""


class _DevTools:
    """Chromium's DevTools protocol over `--remote-debugging-pipe`: JSON messages, each ended by a NUL byte."""

    def __init__(self, to_browser: int, from_browser: int, deadline: float):
        self.to_browser, self.from_browser, self.deadline = to_browser, from_browser, deadline
        self.buffer = b""
        self.last_id = 0

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self.to_browser, data):]
        while True:  # events and other replies before ours are dropped
            reply = self._read()
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise _Refused(f"Chromium refused {method}: {reply['error']}")
                return reply["result"]

    def _read(self) -> dict:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            if select.select([self.from_browser], [], [], left)[0]:
                chunk = os.read(self.from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)


def dom_when(url: str, condition: str, timeout: float = 120, interval: float = 0.1) -> str:
    """The page's DOM as HTML once the JavaScript expression `condition` is true, checked every `interval`
    seconds of real time; a `TimeoutError` showing the page's last DOM after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    commands, replies = os.pipe(), os.pipe()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile, open(Path(profile) / "stderr", "w+b") as err:
        # the DevTools pipe is fds 3 (commands) and 4 (replies) of Chromium: bash moves ours there (dash cannot)
        move = f'exec "$@" 3<&{commands[0]} 4>&{replies[1]}'
        proc = subprocess.Popen(["bash", "-c", move, "bash", chromium(), *FLAGS, f"--user-data-dir={profile}",
                                 "--remote-debugging-pipe", "about:blank"], stdout=subprocess.DEVNULL, stderr=err,
                                pass_fds=(commands[0], replies[1]), start_new_session=True)
        os.close(commands[0])
        os.close(replies[1])
        try:
            tools = _DevTools(commands[1], replies[0], deadline)
            target = tools.call("Target.createTarget", url=url)["targetId"]
            session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            probe = (f"(() => {{ let done = false; try {{ done = !!({condition}); }} catch (e) {{}} return [done, "
                     "document.documentElement ? document.documentElement.outerHTML : '']; })()")
            dom = ""
            while True:
                try:
                    result = tools.call("Runtime.evaluate", session, expression=probe, returnByValue=True)
                except _Refused:  # no context to evaluate in while the page is being replaced: not yet
                    result = {"exceptionDetails": True}
                if "exceptionDetails" not in result:
                    done, dom = result["result"]["value"]
                    if done:
                        return dom
                if time.monotonic() + interval > deadline:
                    raise TimeoutError(f"the condition {condition!r} did not hold on {url} within {timeout:.0f} s; "
                                       f"the page's last DOM ends:\n{dom[-3000:]}")
                time.sleep(interval)
        except RuntimeError as e:
            err.seek(0)
            raise RuntimeError(f"{e}\nChromium's stderr ends:\n{err.read().decode(errors='replace')[-2000:]}") from None
        finally:
            os.close(commands[1])  # Chromium exits when its DevTools pipe closes; if not within 5 s, it is killed
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the group of the Chromium started just above, nothing else
                proc.wait()
            os.close(replies[0])


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
