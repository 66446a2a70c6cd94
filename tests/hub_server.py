"""A model hub on 127.0.0.1 for tests and benchmarks: the hub's file API served from local folders.

`HubServer` answers what huggingface_hub and transformers ask a hub for, unpatched: files under
`/{repo}/resolve/{revision}/{path}` (HEAD and GET, byte ranges, the hub's ETag / X-Linked-Etag / X-Repo-Commit
headers), `/api/models/{repo}[/revision/{rev}]` (model info, with file metadata on `?blobs=true`),
`/api/models/{repo}/tree/{rev}[/{path}]` (the listing `snapshot_download` uses) and `/api/models/{repo}/refs`,
and the hub's typed errors (`X-Error-Code`: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo).

In a test process, pass `endpoint=server.url` to huggingface_hub's functions (`HfApi(endpoint=...)`):
huggingface_hub reads `HF_ENDPOINT` once, at import, so only a fresh process (transformers' `from_pretrained`,
a peer) can be pointed at the server through the environment: `server.client_env(hf_home)`.

Every request is logged (`server.log`: which files a client fetched, which ranges, how many body bytes);
`rate` caps the body bytes per second of all connections together (a home download, for benchmarks);
`fail_after` cuts the next download of a file short (an interrupted download).

Repos are local folders (a checkpoint saved by transformers): `build_sharded_repo` builds a tiny one with a
byte-level tokenizer, `reshard` splits a real one (the demo model) into shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from hub_content import (CHUNK, Commit, HubFile, HubRepo, hub_file, iso, model_info, parse_range, refs, repos_under,
                         tree)
from hub_repos import build_sharded_repo, reshard, write_byte_tokenizer  # noqa: F401 - the helpers, from one place


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the server answered. `range` is the request's Range header as sent; `bytes_sent` counts
    body bytes only; `kind` is "resolve", "info", "tree", "refs" or "other"; `commit` is the commit the
    revision resolved to; `interrupted` marks a body cut short by `fail_after`."""

    method: str
    repo: str | None
    revision: str | None
    filename: str | None
    range: str | None
    bytes_sent: int
    status: int
    kind: str = "other"
    commit: str | None = None
    path: str = ""
    interrupted: bool = False


class _Fault:
    def __init__(self, repo: str | None, filename: str, nbytes: int, times: int) -> None:
        self.repo, self.filename, self.nbytes, self.times = repo, filename, nbytes, times


class _Pacer:
    """A token bucket shared by every connection, with no burst: each chunk waits for its slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0

    def wait(self, nbytes: int, rate: float | None) -> None:
        if not rate:
            return
        with self._lock:
            start = max(time.monotonic(), self._next)
            self._next = start + nbytes / rate
            until = self._next
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _HubError(Exception):
    """An error answer: status, X-Error-Code (None: none), X-Error-Message, more headers."""

    def __init__(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, dict(headers or {})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # idle keep-alive connections are closed by `stop`, never waited for
    request_queue_size = 128  # many clients at once (a swarm's peers) connect without a refusal
    hub: HubServer


class HubServer:
    """A threaded HTTP server on 127.0.0.1 speaking the hub's file API (see the module's docstring).

    `repos`: a mapping of repo ids to folders, or one folder whose subfolders are repos (`root/org/name`, or
    `root/name` for a folder holding files itself). `token`: the one token that opens gated repos. `rate`:
    bytes per second for all response bodies together (None: unlimited), settable while running.
    """

    def __init__(self, repos: Mapping[str, str | Path] | str | Path | None = None, *, token: str | None = None,
                 rate: float | None = None, host: str = "127.0.0.1") -> None:
        self.token = token
        self.rate = rate
        self.host = host
        self.tree_page_size = 1000  # entries per page of a tree listing, as on the hub
        self._repos: dict[str, HubRepo] = {}
        self._state = threading.RLock()
        self._log: list[Request] = []
        self._log_lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._pacer = _Pacer()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        if isinstance(repos, (str, Path)):
            repos = repos_under(Path(repos))
        for repo_id, directory in (repos or {}).items():
            self.add_repo(repo_id, directory)

    # -- lifecycle --

    def start(self) -> HubServer:
        if self._httpd is not None:
            return self
        httpd = _Server((self.host, 0), _Handler)
        httpd.hub = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"hub-server:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._state:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the hub server is not running")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """The endpoint: `endpoint=` of huggingface_hub's functions, `HF_ENDPOINT` of a fresh process."""
        return f"http://{self.host}:{self.port}"

    def client_env(self, hf_home: str | Path, *, token: str | None = None,
                   base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for a process that downloads from this server: `base` (os.environ) without the
        hub's variables (HF_*, a token, offline mode, caches), with HF_ENDPOINT, HF_HOME (its cache: nothing
        reaches ~/.cache) and, if given, HF_TOKEN."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(("HF_", "HUGGING_FACE_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE",
                                    "TRANSFORMERS_CACHE"))}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(hf_home))
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    # -- repos --

    def add_repo(self, repo_id: str, directory: str | Path, *, revision_names: Iterable[str] = ("main",),
                 gated: bool | None = None) -> str:
        """Add the files under `directory` as a commit of `repo_id` (created if new) and point each of
        `revision_names` at it; returns the commit's sha (stable: a hash of the repo id and the files). Adding
        again with other files makes a newer commit (`main` moves, the older stays reachable by its sha).
        `gated`: whether downloads need `token` (None keeps the repo's setting; a new repo is open)."""
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id):
            raise ValueError(f"not a repo id: {repo_id!r}")
        directory = Path(directory)
        files = {}
        for path in sorted(directory.rglob("*")):
            rel = path.relative_to(directory)
            if path.is_file() and not any(part.startswith(".") and part != ".gitattributes" for part in rel.parts):
                f = hub_file(path, rel.as_posix())
                files[f.path] = f
        if not files:
            raise ValueError(f"{directory} holds no files")
        digest = hashlib.sha1(repo_id.encode())
        for name, f in files.items():
            digest.update(f"\n{name}\0{f.oid}".encode())
        sha = digest.hexdigest()
        now = iso(datetime.now(timezone.utc))
        with self._state:
            repo = self._repos.get(repo_id)
            if repo is None:
                repo = HubRepo(repo_id, created=now)
            if gated is not None:
                repo.gated = gated
            if sha not in repo.commits:
                repo.commits[sha] = Commit(sha, files, now)
            for name in revision_names:
                repo.refs[name] = sha
            self._repos[repo_id] = repo
        return sha

    def commits(self, repo_id: str) -> list[str]:
        """The repo's commit shas, oldest first."""
        with self._state:
            return list(self._repos[repo_id].commits)

    def set_gated(self, repo_id: str, gated: bool) -> None:
        with self._state:
            self._repos[repo_id].gated = gated

    def _lookup(self, repo_id: str) -> HubRepo | None:
        with self._state:
            return self._repos.get(repo_id)

    # -- faults --

    def fail_after(self, filename: str, nbytes: int, *, repo: str | None = None, times: int = 1) -> None:
        """The next `times` GETs of `filename` (of any repo, or of `repo`) send `nbytes` of their body, then
        close the connection (the client sees a response shorter than its Content-Length)."""
        with self._state:
            self._faults.append(_Fault(repo, filename, nbytes, times))

    def _take_fault(self, repo: str, filename: str) -> int | None:
        with self._state:
            for fault in self._faults:
                if fault.filename == filename and fault.repo in (None, repo):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault.nbytes
        return None

    # -- the log --

    @property
    def log(self) -> list[Request]:
        """Every request answered since the start or `clear_log`, in the order they were answered. An entry
        is logged before the last byte of its response is sent, so it is there once a client has it."""
        with self._log_lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._log_lock:
            self._log.clear()

    def bytes_sent(self, repo: str | None = None, filename: str | None = None) -> int:
        """Body bytes sent (files and API answers), for one repo and/or one file if given."""
        return sum(r.bytes_sent for r in self.log
                   if (repo is None or r.repo == repo) and (filename is None or r.filename == filename))

    def fetched(self, repo: str | None = None) -> dict[str, int]:
        """File name -> body bytes sent by GETs of that file (of `repo` if given), in order of first fetch."""
        out: dict[str, int] = {}
        for r in self.log:
            if r.kind == "resolve" and r.method == "GET" and r.status < 300 and (repo is None or r.repo == repo):
                out[r.filename] = out.get(r.filename, 0) + r.bytes_sent
        return out

    def _record(self, entry: Request) -> int:
        with self._log_lock:
            self._log.append(entry)
            return len(self._log) - 1

    def _amend(self, index: int, entry: Request, **changes) -> None:
        with self._log_lock:
            if index < len(self._log) and self._log[index] is entry:
                self._log[index] = dataclasses.replace(entry, **changes)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's pooled client expects
    server_version = "swarm-test-hub"
    timeout = 60  # idle keep-alive connections end after this

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined] - our _Server

    def setup(self) -> None:
        super().setup()
        with self.hub._state:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._state:
            self.hub._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: the hub keeps its own log
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    # -- routing --

    def _handle(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        self._answered = False
        self._entry = dict(method=self.command, repo=None, revision=None, filename=None,
                           range=self.headers.get("Range"), kind="other", commit=None, path=self.path)
        try:
            if parts[:2] == ["api", "models"]:
                self._api(parts[2:], query)
            elif parts[:2] == ["api", "agent-harnesses"]:  # huggingface_hub's agent registry: none known here
                self._send_json({"standardEnvVars": [], "harnesses": {}})
            else:
                self._resolve(parts)
        except _HubError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a file changed under the server, a bug: a 500 if nothing was sent yet
            traceback.print_exc()
            self.close_connection = True
            if not self._answered:
                self._send_error(_HubError(500, None, f"{type(e).__name__}: {e}"))

    def _split_repo(self, parts: list[str], keywords: tuple[str, ...]) -> tuple[str, list[str]] | None:
        """(repo id, the rest) where a keyword follows one or two leading segments; a known repo first."""
        options = [(i, "/".join(parts[:i])) for i in (2, 1) if len(parts) > i and parts[i] in keywords]
        if not options:
            return None
        i, repo_id = min(options, key=lambda o: self.hub._lookup(o[1]) is None)
        return repo_id, parts[i:]

    def _resolve(self, parts: list[str]) -> None:
        split = self._split_repo(parts, ("resolve",))
        if split is None or len(split[1]) < 3:
            raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
        repo_id, rest = split
        revision, filename = rest[1], "/".join(rest[2:])
        self._entry.update(kind="resolve", repo=repo_id, revision=revision, filename=filename)
        repo = self._repo(repo_id)
        self._check_access(repo)
        commit = self._commit(repo, revision)
        f = commit.files.get(filename)
        if f is not None:
            f.check()
        if f is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit.sha})
        self._send_file(repo_id, commit, f)

    def _api(self, parts: list[str], query: dict[str, list[str]]) -> None:
        split = self._split_repo(parts, ("revision", "tree", "refs"))
        if split is None:
            if not 1 <= len(parts) <= 2:
                raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
            repo_id, rest = "/".join(parts), ["revision", None]
        else:
            repo_id, rest = split
        kind = {"refs": "refs", "revision": "info", "tree": "tree"}[rest[0]]
        revision = rest[1] if len(rest) > 1 else None
        self._entry.update(repo=repo_id, kind=kind, revision=revision)
        repo = self._repo(repo_id)
        if kind == "refs":
            return self._send_json(refs(repo, with_prs=_flag(query, "include_prs")))
        if len(rest) < 2:
            raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
        commit = self._commit(repo, revision) if revision is not None else self._head(repo)
        if rest[0] == "revision":
            if len(rest) != 2:
                raise _HubError(404, None, "Sorry, we can't find the page you are looking for.")
            return self._send_json(model_info(repo, commit, blobs=_flag(query, "blobs"),
                                               expand=query.get("expand") or query.get("expand[]")))
        path = "/".join(rest[2:]).strip("/")
        self._entry.update(filename=path or None)
        entries = tree(commit, path, recursive=_flag(query, "recursive"), expand=_flag(query, "expand"))
        if entries is None:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"",
                            {"X-Repo-Commit": commit.sha})
        cursor = int(query.get("cursor", ["0"])[0])
        page = entries[cursor:cursor + self.hub.tree_page_size]
        headers = {}
        if cursor + self.hub.tree_page_size < len(entries):
            rest_query = {k: v[-1] for k, v in query.items() if k != "cursor"}
            rest_query["cursor"] = str(cursor + self.hub.tree_page_size)
            link = f"{self.hub.url}{urlsplit(self.path).path}?" + "&".join(f"{k}={quote(v)}"
                                                                            for k, v in rest_query.items())
            headers["Link"] = f'<{link}>; rel="next"'
        self._send_json(page, headers=headers)

    # -- repos, revisions, access --

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _repo(self, repo_id: str) -> HubRepo:
        repo = self.hub._lookup(repo_id)
        if repo is None:
            # As the hub: an anonymous request learns nothing about private or missing repos (401).
            if self._bearer() is None:
                raise _HubError(401, "RepoNotFound", "Invalid username or password.")
            raise _HubError(404, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: HubRepo, revision: str) -> Commit:
        with self.hub._state:
            commit = repo.resolve(revision)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        self._entry.update(commit=commit.sha)
        return commit

    def _head(self, repo: HubRepo) -> Commit:
        """The default branch's commit: main's, else the newest."""
        with self.hub._state:
            commit = repo.commits[repo.refs["main"]] if "main" in repo.refs else list(repo.commits.values())[-1]
        self._entry.update(commit=commit.sha)
        return commit

    def _check_access(self, repo: HubRepo) -> None:
        if not repo.gated:
            return
        token = self._bearer()
        if token is None:
            raise _HubError(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted. You must have access "
                                              "to it and be authenticated to access it. Please log in.")
        if token != self.hub.token:
            raise _HubError(403, "GatedRepo", f"Access to model {repo.repo_id} is restricted and you are not in "
                                              "the authorized list. Visit the model's page to ask for access.")

    # -- responses --

    def _common_headers(self) -> None:
        self._answered = True
        request_id = self.headers.get("X-Amzn-Trace-Id") or self.headers.get("X-Request-Id")
        if request_id:
            self.send_header("X-Request-Id", request_id)

    def _send_file(self, repo_id: str, commit: Commit, f: HubFile) -> None:
        start, stop = 0, f.size
        status = 200
        header = self.headers.get("Range")
        if header is not None:
            span = parse_range(header, f.size)
            if span == "unsatisfiable":
                raise _HubError(416, None, "Range Not Satisfiable",
                                {"X-Repo-Commit": commit.sha, "Content-Range": f"bytes */{f.size}"})
            if span is not None:
                (start, stop), status = span, 206
        self.send_response(status)
        self._common_headers()
        self.send_header("Content-Type", "application/octet-stream" if f.lfs else "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{f.oid}"')
        self.send_header("X-Repo-Commit", commit.sha)
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
        name = f.path.rsplit("/", 1)[-1]
        self.send_header("Content-Disposition", f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{f.size}")
        if self.command == "HEAD":
            self._finish_headers(status)
            return
        cut = self.hub._take_fault(repo_id, f.path)
        self._send_body(f.read(start, stop), stop - start, status, cut=cut)

    def _send_json(self, data, *, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self._common_headers()
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.command == "HEAD":
            self._finish_headers(200)
            return
        self._send_body(_chunks(body), len(body), 200)

    def _send_error(self, e: _HubError) -> None:
        body = json.dumps({"error": e.message}).encode()
        self.send_response(e.status)
        self._common_headers()
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if e.code:
            self.send_header("X-Error-Code", e.code)
        self.send_header("X-Error-Message", e.message)
        for k, v in e.headers.items():
            self.send_header(k, v)
        if self.command == "HEAD":
            self._finish_headers(e.status)
            return
        self._send_body(_chunks(body), len(body), e.status)

    def _finish_headers(self, status: int) -> None:
        self.hub._record(Request(**self._entry, bytes_sent=0, status=status))
        self.end_headers()

    def _send_body(self, chunks: Iterator[bytes], total: int, status: int, *, cut: int | None = None) -> None:
        """Write the body, paced by the rate; log it before its last byte leaves. `cut`: stop after that many
        bytes and close the connection."""
        self.end_headers()
        limit = total if cut is None else min(cut, total)
        sent, entry, index = 0, None, None
        rate = self.hub.rate
        size = CHUNK if not rate else max(4096, min(CHUNK, int(rate / 20)))
        for chunk in _rechunk(chunks, size):
            chunk = chunk[:limit - sent]
            if not chunk:
                break
            self.hub._pacer.wait(len(chunk), self.hub.rate)
            if sent + len(chunk) >= limit:  # the last write: log first, so a client never sees an unlogged reply
                entry = Request(**self._entry, bytes_sent=limit, status=status, interrupted=limit < total)
                index = self.hub._record(entry)
            try:
                self.wfile.write(chunk)
            except OSError:
                if entry is not None:
                    self.hub._amend(index, entry, bytes_sent=sent, interrupted=True)
                else:
                    self.hub._record(Request(**self._entry, bytes_sent=sent, status=status, interrupted=True))
                raise
            sent += len(chunk)
        if entry is None:  # an empty body
            self.hub._record(Request(**self._entry, bytes_sent=sent, status=status, interrupted=sent < total))
        if limit < total:
            self.close_connection = True
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[-1].lower() in ("1", "true", "yes")


def _chunks(data: bytes) -> Iterator[bytes]:
    for at in range(0, len(data), CHUNK):
        yield data[at:at + CHUNK]


def _rechunk(chunks: Iterator[bytes], size: int) -> Iterator[bytes]:
    for chunk in chunks:
        for at in range(0, len(chunk), size):
            yield chunk[at:at + size]
