"""A weight file from the hub, resumable across runs: bytes go to a partial file beside the hub cache's
blobs, a later run (after a crash, a kill or a lost connection) asks only for the rest with a range
request, and the file is placed in the cache only once its whole sha256 matches the hub's listing.

Why not the hub client's own download: it resumes within one call, but a download interrupted with the
process starts again from its first byte next time, and a volunteer's 5 GB shard over a home line must
not. Small files (configs, tokenizers) still go through the hub client.

Processes sharing a hub cache take `lock` on the file's blob first: one downloads, the others find it
placed when they get the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_S = 5.0
TIMEOUT_S = 60.0  # a silence this long ends the attempt (the partial file stays for the next)


class Progress:
    """A download's progress in the log: bytes, rate and time left, at most every `PROGRESS_EVERY_S`; called
    with (bytes done, total), counting from `start` (bytes a resumed download already had)."""

    def __init__(self, what: str, start: int = 0):
        self.what, self.start = what, start
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S or done >= total:
            return
        self.last = now
        rate = max(done - self.start, 0) / max(now - self.started, 1e-6)
        logger.info("%s: %.1f of %.1f MiB, %.1f MiB/s, %.0f s left", self.what, done / 2**20, total / 2**20,
                    rate / 2**20, (total - done) / max(rate, 1.0))


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` between processes (and between threads opening it apart)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure_rate(url: str, headers: dict[str, str], nbytes: int) -> float:
    """Bytes/s a server sends, timed on the first `nbytes` of `url` (a range request); raises what the request
    raised."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    started, got = time.perf_counter(), 0
    with get_session().stream("GET", url, follow_redirects=True, timeout=TIMEOUT_S,
                              headers={**headers, "Range": f"bytes=0-{nbytes - 1}"}) as response:
        hf_raise_for_status(response)
        for block in response.iter_bytes():
            got += len(block)
            if got >= nbytes:
                break
    return got / max(time.perf_counter() - started, 1e-6)


def fetch(url: str, headers: dict[str, str], partial: Path, size: int, sha256: str, what: str,
          stop: threading.Event | None = None) -> str:
    """Download `url` into `partial` (resuming it): "done" when it holds exactly the file `sha256` names,
    "short" when the server stopped early (the partial file stays, for the next run to resume), "wrong"
    when the bytes do not match (the partial file is removed). Network errors propagate (the partial
    file stays). `stop`: once set, the download ends after the block in hand ("short")."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    have = partial.stat().st_size if partial.is_file() else 0
    if have > size:
        partial.unlink()
        have = 0
    digest = hashlib.sha256()
    if have:
        with open(partial, "rb") as f:
            while block := f.read(8 * CHUNK_BYTES):
                digest.update(block)
        logger.info("%s: resuming at %.1f of %.1f MiB", what, have / 2**20, size / 2**20)
    if have < size:
        ask = {**headers, "Range": f"bytes={have}-"} if have else dict(headers)
        with get_session().stream("GET", url, headers=ask, follow_redirects=True, timeout=TIMEOUT_S) as response:
            hf_raise_for_status(response)
            if have and response.status_code != 206:  # the range was not honoured: from the start
                have, digest = 0, hashlib.sha256()
            with open(partial, "r+b" if have else "wb") as out:
                out.seek(have)
                progress, got = Progress(what, have), 0
                for block in response.iter_bytes():  # as it arrives: an interruption keeps every byte that came
                    block = block[:size - have - got]  # never more than the listed size
                    out.write(block)
                    digest.update(block)
                    got += len(block)
                    progress(have + got, size)
                    if have + got >= size or (stop is not None and stop.is_set()):
                        break
                out.flush()
                os.fsync(out.fileno())
    length = partial.stat().st_size
    if length < size:
        return "short"
    if length == size and digest.hexdigest() == sha256:
        return "done"
    partial.unlink(missing_ok=True)
    return "wrong"
