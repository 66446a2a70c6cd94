"""What the test hub (`hub_server`) serves: a repo's commits and files, hashed as the hub hashes them, and the
hub's JSON answers about them (model info, tree listings, refs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path

# Files the hub stores with Git LFS: a repo's default .gitattributes patterns, files over 10 MB (the hub
# refuses larger regular files) and binary files (a NUL byte in the first 8000 bytes, as git decides).
LFS_SUFFIXES = (
    ".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib", ".mlmodel", ".model",
    ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb", ".pickle", ".pkl", ".pt", ".pth", ".rar",
    ".safetensors", ".tar", ".tflite", ".tgz", ".wasm", ".xz", ".zip", ".zst",
)
LFS_MIN_SIZE = 10 * 1000 * 1000
IN_MEMORY_MAX = 10 * 1000 * 1000  # larger files are read from their folder when served (and must not change)
CHUNK = 64 * 1024
_BINARY_PROBE = 8000  # bytes git looks at for a NUL


@dataclasses.dataclass(frozen=True)
class HubFile:
    """A file of one commit. Small files are kept in memory (a snapshot of the folder at `add_repo`); larger
    ones are read from `source` when served, checked against the size and mtime they had then."""

    path: str
    size: int
    oid: str  # the git blob sha1: of the content, or of the LFS pointer for an LFS file (as on the hub)
    sha256: str
    lfs: bool
    data: bytes | None
    source: Path
    mtime_ns: int

    @property
    def etag(self) -> str:
        """What the client keys its cache on: the sha256 of an LFS file, else the git blob sha1."""
        return self.sha256 if self.lfs else self.oid

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, self.size)

    def check(self) -> None:
        """Raise if a file served from its folder changed since it was added."""
        if self.data is None:
            st = self.source.stat()
            if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
                raise RuntimeError(f"{self.source} changed since it was added to the hub")

    def read(self, start: int, stop: int) -> Iterator[bytes]:
        """The bytes [start, stop) in chunks."""
        if self.data is not None:
            for at in range(start, stop, CHUNK):
                yield self.data[at:min(at + CHUNK, stop)]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            at = start
            while at < stop:
                chunk = f.read(min(CHUNK, stop - at))
                if not chunk:
                    raise RuntimeError(f"{self.source} is shorter than when it was added")
                at += len(chunk)
                yield chunk


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    files: Mapping[str, HubFile]
    date: str  # ISO 8601, as the hub writes it

    @property
    def dirs(self) -> set[str]:
        """Every folder that holds a file, at any depth."""
        return {"/".join(p.split("/")[:i]) for p in self.files for i in range(1, p.count("/") + 1)}


@dataclasses.dataclass
class HubRepo:
    repo_id: str
    gated: bool = False
    commits: dict[str, Commit] = dataclasses.field(default_factory=dict)  # oldest first
    refs: dict[str, str] = dataclasses.field(default_factory=dict)  # revision name -> commit sha
    created: str = ""

    def resolve(self, revision: str) -> Commit | None:
        if revision in self.refs:
            return self.commits[self.refs[revision]]
        if revision in self.commits:
            return self.commits[revision]
        if re.fullmatch(r"[0-9a-f]{7,39}", revision):  # an abbreviated commit sha, as git accepts
            found = [c for sha, c in self.commits.items() if sha.startswith(revision)]
            if len(found) == 1:
                return found[0]
        return None


# -- the hub's JSON --

def iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def model_info(repo: HubRepo, commit: Commit, *, blobs: bool, expand: list[str] | None) -> dict:
    siblings = []
    for f in commit.files.values():
        sibling: dict = {"rfilename": f.path}
        if blobs:
            sibling.update(size=f.size, blobId=f.oid)
            if f.lfs:
                sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
        siblings.append(sibling)
    config = _json_file(commit, "config.json") or {}
    tokenizer_config = _json_file(commit, "tokenizer_config.json") or {}
    params = _safetensors_parameters(commit)
    tags = ["transformers"] + (["safetensors"] if params else []) + (
        [config["model_type"]] if "model_type" in config else []) + ["text-generation"]
    info = {
        "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
        "sha": commit.sha,
        "lastModified": commit.date,
        "createdAt": repo.created,
        "private": False,
        "disabled": False,
        "gated": "auto" if repo.gated else False,
        "downloads": 0,
        "likes": 0,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags,
        "config": {
            **{k: config[k] for k in ("architectures", "model_type") if k in config},
            "tokenizer_config": {k: v for k, v in tokenizer_config.items()
                                 if k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")},
        },
        "transformersInfo": {"auto_model": "AutoModelForCausalLM", "pipeline_tag": "text-generation",
                             "processor": "AutoTokenizer"},
        "siblings": siblings,
        "spaces": [],
        "usedStorage": sum(f.size for f in commit.files.values()),
    }
    if params:
        info["safetensors"] = {"parameters": params, "total": sum(params.values())}
    if expand:
        info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
    return info


def tree(commit: Commit, path: str, *, recursive: bool, expand: bool) -> list[dict] | None:
    """The hub's tree listing of `path` (the root if empty): folders first, then files; None if no folder."""
    dirs = commit.dirs
    if path and path not in dirs:
        return None
    prefix = f"{path}/" if path else ""

    def inside(p: str) -> bool:
        return p.startswith(prefix) and (recursive or "/" not in p[len(prefix):])

    last_commit = {"id": commit.sha, "title": "Upload folder", "date": commit.date}
    entries = []
    for d in sorted(p for p in dirs if inside(p)):
        oid = hashlib.sha1(f"tree {commit.sha} {d}".encode()).hexdigest()
        entries.append({"type": "directory", "oid": oid, "size": 0, "path": d,
                        **({"lastCommit": last_commit} if expand else {})})
    for f in commit.files.values():
        if inside(f.path):
            entry: dict = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
            if expand:
                entry["lastCommit"] = last_commit
            entries.append(entry)
    return entries


def refs(repo: HubRepo, *, with_prs: bool) -> dict:
    branches = [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
                for name, sha in repo.refs.items() if not name.startswith("refs/")]
    out = {"branches": branches, "converts": [], "tags": []}
    if with_prs:
        out["pullRequests"] = [{"name": name, "ref": name, "targetCommit": sha}
                               for name, sha in repo.refs.items() if name.startswith("refs/pr/")]
    return out


def _json_file(commit: Commit, name: str) -> dict | None:
    f = commit.files.get(name)
    if f is None or f.size > IN_MEMORY_MAX:
        return None
    try:
        return json.loads(b"".join(f.read(0, f.size)))
    except ValueError:
        return None


def _safetensors_parameters(commit: Commit) -> dict[str, int]:
    """Parameters per dtype over the commit's safetensors files, read from their headers."""
    counts: dict[str, int] = {}
    for f in commit.files.values():
        if not f.path.endswith(".safetensors") or f.size < 8:
            continue
        try:
            (n,) = struct.unpack("<Q", b"".join(f.read(0, 8)))
            header = json.loads(b"".join(f.read(8, 8 + n)))
        except (ValueError, struct.error, RuntimeError):
            continue
        for name, t in header.items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                counts[t["dtype"]] = counts.get(t["dtype"], 0) + count
    return counts


# -- files --

def lfs_pointer(sha256: str, size: int) -> bytes:
    """The Git LFS pointer file the hub's git stores for an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_HASHES: dict[tuple[str, int, int], tuple[str, str, bool]] = {}  # (path, size, mtime) -> sha256, blob sha1, binary
_HASHES_LOCK = threading.Lock()


def hub_file(source: Path, path: str) -> HubFile:
    """`source` as the file `path` of a repo; hashes of large files are remembered by path, size and mtime."""
    st = source.stat()
    key = (str(source.resolve()), st.st_size, st.st_mtime_ns)
    data = source.read_bytes() if st.st_size <= IN_MEMORY_MAX else None
    with _HASHES_LOCK:
        known = _HASHES.get(key)
    if known is None or data is not None:
        sha256, blob = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % st.st_size)
        head = b""
        for chunk in ([data] if data is not None else _file_chunks(source)):
            head = head or chunk[:_BINARY_PROBE]
            sha256.update(chunk)
            blob.update(chunk)
        known = (sha256.hexdigest(), blob.hexdigest(), b"\0" in head)
        with _HASHES_LOCK:
            _HASHES[key] = known
    sha256_hex, blob_hex, binary = known
    lfs = path.endswith(LFS_SUFFIXES) or st.st_size > LFS_MIN_SIZE or binary
    oid = git_blob_sha1(lfs_pointer(sha256_hex, st.st_size)) if lfs else blob_hex
    return HubFile(path=path, size=st.st_size, oid=oid, sha256=sha256_hex, lfs=lfs, data=data, source=source,
                   mtime_ns=st.st_mtime_ns)


def _file_chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """[start, stop) of a single `bytes=` range; "unsatisfiable"; or None to ignore it (malformed or several
    ranges: the whole file is sent, as HTTP allows)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if m is None or m.group(1) == m.group(2) == "":
        return None
    first, last = m.group(1), m.group(2)
    if first == "":  # a suffix: the last N bytes
        n = int(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else "unsatisfiable"
    start = int(first)
    if last != "" and int(last) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, size if last == "" else min(int(last) + 1, size)


def repos_under(root: Path) -> dict[str, Path]:
    """Repos in a folder: `root/org/name/...` -> "org/name"; `root/name` holding files itself -> "name"."""
    repos = {}
    for first in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if any(p.is_file() for p in first.iterdir()):
            repos[first.name] = first
        else:
            for second in sorted(p for p in first.iterdir() if p.is_dir() and not p.name.startswith(".")):
                repos[f"{first.name}/{second.name}"] = second
    return repos


