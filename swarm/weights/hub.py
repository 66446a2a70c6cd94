"""A model on the hub, fetched file by file into the user's hub cache.

Invariants:
- Access goes through `huggingface_hub` and its environment, read when a model is resolved (not when
  this module is imported): `HF_ENDPOINT`, `HF_TOKEN`, `HF_HOME`/`HF_HUB_CACHE` and its cache layout,
  `HF_HUB_OFFLINE`. A model already in a user's hub cache is used as it is, offline too.
- A revision is resolved to one commit once; every file comes from that commit, so a branch moving
  while a peer downloads cannot mix two versions.
- Only files asked for are fetched. Every weight file whose hash the hub reports (LFS files: the sha256
  of the content) is checked after download; a file that does not match is deleted from the cache and
  refused, so nothing partly wrong is ever loaded.
- What the hub said about a commit (its files, sizes and hashes, the tensors' shapes in each shard) is
  kept in a small manifest beside the project's other caches, so an offline peer knows the same.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import CheckpointError
from swarm.weights import download
from swarm.weights.ref import ModelRef

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files that hold weights in some format: a client fetches everything else (config, tokenizer, chat
# template, generation config), a peer only its shards.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".ot",
                   ".npz", ".pkl", ".tflite", ".mlmodel", ".nemo")
MANIFEST_VERSION = 1
PROGRESS_EVERY_S = 5.0
PROBE_BYTES = 4 * 2**20  # what `HubModel.probe_rate` times
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelUnavailable(CheckpointError):
    """A hub model could not be resolved or fetched; the message says what to do."""

    code = "model_unavailable"


@dataclass(frozen=True)
class Hub:
    """The hub as this process's environment names it."""

    endpoint: str
    cache_dir: Path
    token: str | None
    offline: bool
    manifests: Path

    @classmethod
    def from_env(cls, cache_home: str | None = None) -> Hub:
        env = os.environ
        home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
        cache = Path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
        if cache_home is None:
            from swarm.cli import cache_home as default_home
            cache_home = default_home()
        offline = any(env.get(name, "").strip().lower() in ("1", "true", "yes", "on")
                      for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
        return cls(endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
                   cache_dir=cache.expanduser(), token=env.get("HF_TOKEN") or None, offline=offline,
                   manifests=Path(cache_home) / "hub")

    def api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int | None
    sha256: str | None  # the content's sha256 where the hub reports one (LFS files)


@dataclass
class HubModel:
    """One hub repo at one commit: its file list, and its files fetched into the hub cache on demand."""

    hub: Hub
    repo: str
    revision: str  # as asked for ("main" when none was)
    commit: str
    files: dict[str, RepoFile]
    shapes: dict[str, dict[str, tuple[str, list[int]]]] = field(default_factory=dict)  # shard -> tensor -> (dtype, shape)
    fetched: list[str] = field(default_factory=list)  # names this process fetched (not found in the cache)
    offline: bool = False  # resolved from the cache because the hub was unreachable
    stop: threading.Event | None = None  # set when the process stops: no further file is fetched
    fetch_hook: Callable[[RepoFile, Path], bool] | None = None  # tries other sources (peers) before the hub
    on_fetched: Callable[[RepoFile, Path], None] | None = None  # told of every file fetched, from anywhere
    rate: float | None = None  # bytes/s the hub sent at last measure (`probe_rate`); None: not measured
    probed: bool = False  # `probe_rate` ran (a failed probe is not tried again)

    @property
    def folder(self) -> Path:
        """This repo's folder in the hub cache (blobs/, refs/, snapshots/)."""
        return self.hub.cache_dir / ("models--" + self.repo.replace("/", "--"))

    @property
    def snapshot(self) -> Path:
        return self.folder / "snapshots" / self.commit

    def remember_revision(self) -> None:
        """Write refs/REVISION -> commit as the hub client does, so an offline run finds this commit."""
        if self.revision == self.commit:
            return
        ref = self.folder / "refs" / self.revision
        try:
            ref.parent.mkdir(parents=True, exist_ok=True)
            if not ref.is_file() or ref.read_text().strip() != self.commit:
                tmp = ref.with_name(f".{ref.name}.tmp{os.getpid()}")
                tmp.write_text(self.commit)
                tmp.replace(ref)  # a reader sees the old commit or the new one, never an empty file
        except OSError as exc:
            logger.warning("could not note %s's revision %s in %s: %s", self.repo, self.revision, ref, exc)

    def place(self, name: str, verified: Path) -> Path:
        """Move `verified` (a file whose content hash was checked against this commit's listing, e.g. from
        a peer) into the hub cache exactly where the hub client would have put it."""
        info = self.files[name]
        blob = self.folder / "blobs" / info.sha256
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(verified, blob)
        link = self.snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))
        except OSError:  # no symlinks here (as the hub client does then): the file itself
            shutil.copyfile(blob, link)
        return link

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:8]}"

    def stopping_check(self) -> None:
        """Between files: a process that is stopping fetches nothing more."""
        if self.stop is not None and self.stop.is_set():
            raise ModelUnavailable(f"{self}: stopped before all files were fetched")

    @property
    def weight_files(self) -> list[str]:
        """The safetensors files the checkpoint loads from: the index's shards, or the single file."""
        if INDEX in self.files:
            return sorted({file for file in json.loads(self.path(INDEX).read_text())["weight_map"].values()})
        return [SINGLE] if SINGLE in self.files else []

    def path(self, name: str) -> Path:
        """Local path of file `name`, fetched first if it is not in the cache."""
        self.fetch([name])
        return self.snapshot / name

    def present(self, name: str) -> bool:
        return (self.snapshot / name).is_file()

    def fetch(self, names: Iterable[str]) -> list[Path]:
        """Files `names` of this commit, from the cache or fetched (other sources first, then the hub)."""
        out = []
        for name in names:
            target = self.snapshot / name
            if not target.is_file():
                self._fetch_one(name)
            out.append(target)
        return out

    def _fetch_one(self, name: str) -> None:
        info = self.files.get(name)
        if info is None:
            raise ModelUnavailable(f"{self}: the repository has no file {name!r}")
        if self.hub.offline:
            raise ModelUnavailable(f"{self}: {name} is not in the hub cache ({self.hub.cache_dir}) and HF_HUB_OFFLINE "
                                   "is set; run once online, or unset HF_HUB_OFFLINE")
        self.stopping_check()
        self._check_room(info)
        if info.sha256 and info.size:
            with download.lock(self.folder / "blobs" / f"{info.sha256}.lock"):
                if not (self.snapshot / name).is_file():  # another process may have placed it meanwhile
                    self._fetch_weights(info)
            self._told(info)
            return
        from huggingface_hub import hf_hub_download

        logger.info("fetching %s of %s from %s (%s)", name, self, self.hub.endpoint, _size(info.size))
        try:
            hf_hub_download(self.repo, name, revision=self.commit, cache_dir=self.hub.cache_dir,
                            endpoint=self.hub.endpoint, token=self.hub.token, tqdm_class=logged_progress())
        except Exception as exc:  # noqa: BLE001 - the hub client's own errors and the disk's, each turned into what to do
            raise _unavailable(exc, self.repo, self.revision, self.hub, name) from exc
        self.fetched.append(name)
        self._told(info)

    def _fetch_weights(self, info: RepoFile) -> None:
        """A weight file (its sha256 listed): from peers first (the fetch hook), else from the hub with a
        resumable download; placed in the cache only once its bytes match."""
        name = info.name
        if self.fetch_hook is not None and self.fetch_hook(info, self.snapshot / name):
            self.fetched.append(name)
            return
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        logger.info("fetching %s of %s from %s (%s)", name, self, self.hub.endpoint, _size(info.size))
        partial = self.folder / "blobs" / f"{info.sha256}.incomplete-swarm"
        url = hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.hub.endpoint)
        try:
            outcome = download.fetch(url, build_hf_headers(token=self.hub.token), partial, info.size, info.sha256,
                                     f"{name} of {self}", self.stop)
        except Exception as exc:  # noqa: BLE001 - the network's and the hub's errors, each turned into what to do
            raise _unavailable(exc, self.repo, self.revision, self.hub, name) from exc
        self.stopping_check()
        if outcome == "short":
            raise ModelUnavailable(f"{self}: the hub stopped sending {name} early; run again to resume it")
        if outcome == "wrong":
            raise ModelUnavailable(f"{self}: {name} as downloaded does not match the sha256 the hub lists "
                                   f"({info.sha256[:16]}...); it was deleted, try again")
        self.place(name, partial)
        self.fetched.append(name)
        for leftover in self.folder.glob(f"blobs/{info.sha256}.from-peers*"):
            leftover.unlink(missing_ok=True)  # a download from peers that did not finish

    def _told(self, info: RepoFile) -> None:
        if self.on_fetched is not None:
            self.on_fetched(info, self.snapshot / info.name)

    def _check_room(self, info: RepoFile) -> None:
        if not info.size:
            return
        place = self.hub.cache_dir
        place.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(place).free
        if free < info.size:
            raise ModelUnavailable(f"{self}: {info.name} needs {_size(info.size)} but {place} has {_size(free)} free; "
                                   "free some space or point HF_HOME (or HF_HUB_CACHE) at a larger disk")

    def load_shapes(self) -> dict[str, dict[str, tuple[str, list[int]]]]:
        """Every shard's tensors (dtype, shape), read from the safetensors headers without fetching the
        shards (range requests), once per commit."""
        if self.shapes:
            return self.shapes
        missing = [f for f in self.weight_files if not self.present(f)]
        shapes: dict[str, dict[str, tuple[str, list[int]]]] = {}
        for name in self.weight_files:
            if name not in missing:
                shapes[name] = read_header(self.snapshot / name)
        if missing:
            if self.hub.offline:
                raise ModelUnavailable(f"{self}: the tensor shapes of {missing[0]} are unknown offline")
            for name in missing:
                try:
                    shapes[name] = self._remote_header(name)
                except CheckpointError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the hub client's errors, turned into what to do
                    raise _unavailable(exc, self.repo, self.revision, self.hub, name) from exc
        self.shapes = shapes
        self._save_manifest()
        return shapes

    def probe_rate(self, name: str, nbytes: int = PROBE_BYTES) -> float | None:
        """Bytes/s the hub sends, timed on the first `nbytes` of `name` (a range request), kept in `rate`; None
        offline or when the hub cannot be asked (then nothing is compared with it)."""
        if self.probed or self.hub.offline or self.offline:
            return self.rate
        self.probed = True
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.hub.endpoint)
        try:
            self.rate = download.measure_rate(url, build_hf_headers(token=self.hub.token), nbytes)
        except Exception as exc:  # noqa: BLE001 - the hub's speed is a hint: without it nothing is compared
            logger.info("%s: the hub's speed could not be measured (%s)", self, type(exc).__name__)
            return None
        logger.info("%s: the hub sends %.1f MiB/s", self, self.rate / 2**20)
        return self.rate

    def _remote_header(self, name: str) -> dict[str, tuple[str, list[int]]]:
        """A shard's header read on the hub with two range requests: its length, then the header itself."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.hub.endpoint)
        headers = build_hf_headers(token=self.hub.token)

        def read(start: int, end: int) -> bytes:
            response = get_session().get(url, headers={**headers, "Range": f"bytes={start}-{end}"},
                                         follow_redirects=True, timeout=30)
            hf_raise_for_status(response)
            if response.status_code != 206:
                raise ModelUnavailable(f"{self}: the hub at {self.hub.endpoint} ignores range requests "
                                       f"(answered {response.status_code} for a header of {name})")
            return response.content[:end - start + 1]

        size = int.from_bytes(read(0, 7), "little")
        if not 0 < size <= 100 * 2**20:
            raise ModelUnavailable(f"{self}: {name} is not a safetensors file (header of {size} bytes)")
        header = json.loads(read(8, 8 + size - 1))
        return {k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"}

    def _manifest_path(self) -> Path:
        return self.hub.manifests / self.repo.replace("/", "--") / f"{self.commit}.json"

    def _save_manifest(self) -> None:
        data = {"version": MANIFEST_VERSION, "repo": self.repo, "commit": self.commit,
                "files": {f.name: [f.size, f.sha256] for f in self.files.values()},
                "shapes": self.shapes}
        path = self._manifest_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
        except OSError as exc:  # a read-only cache home: only offline use loses
            logger.warning("could not keep the manifest of %s in %s: %s", self, path, exc)


def resolve(ref: ModelRef, hub: Hub | None = None) -> HubModel:
    """`ref` (a hub repo) resolved to one commit with its file list: asked of the hub, or offline read from
    the cache and the manifest kept when it was last resolved online."""
    hub = hub or Hub.from_env()
    revision = ref.revision or "main"
    if hub.offline:
        model = _resolve_offline(ref.repo, revision, hub)
    else:
        try:
            info = hub.api().model_info(ref.repo, revision=revision, files_metadata=True)
        except Exception as exc:  # noqa: BLE001 - the hub client's errors, each turned into what to do
            if not _unreachable(exc):
                raise _unavailable(exc, ref.repo, revision, hub) from exc
            try:  # the hub cannot be reached: a model in the cache is used as it is
                model = _resolve_offline(ref.repo, revision, hub)
            except ModelUnavailable:
                raise _unavailable(exc, ref.repo, revision, hub) from exc
            logger.warning("the hub at %s cannot be reached (%s); using %s from the cache", hub.endpoint,
                           type(exc).__name__, model)
            model.offline = True
            return _checked(model)
        files = {s.rfilename: RepoFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings}
        model = HubModel(hub, ref.repo, revision, info.sha, files)
        model._save_manifest()
        model.remember_revision()
    return _checked(model)


def _checked(model: HubModel) -> HubModel:
    if "config.json" not in model.files:
        raise ModelUnavailable(f"{model} has no config.json: not a transformers model repository")
    if INDEX not in model.files and SINGLE not in model.files:
        raise ModelUnavailable(f"{model} has neither {SINGLE} nor {INDEX}; only safetensors checkpoints can be "
                               "served")
    missing = sorted(set(model.weight_files) - set(model.files))
    if missing:
        raise ModelUnavailable(f"{model}: its {INDEX} names shards the repository lacks: {', '.join(missing[:3])}")
    return model


def _resolve_offline(repo: str, revision: str, hub: Hub) -> HubModel:
    folder = hub.cache_dir / ("models--" + repo.replace("/", "--"))
    commit = revision if _COMMIT.fullmatch(revision) else None
    ref_file = folder / "refs" / revision
    if commit is None and ref_file.is_file():
        commit = ref_file.read_text().strip()
        commit = commit if _COMMIT.fullmatch(commit) else None
    if commit is None or not (folder / "snapshots" / commit).is_dir():
        raise ModelUnavailable(f"{repo}@{revision} is not in the hub cache ({hub.cache_dir}) and HF_HUB_OFFLINE is "
                               "set: run once online, or unset HF_HUB_OFFLINE")
    manifest = hub.manifests / repo.replace("/", "--") / f"{commit}.json"
    try:
        data = json.loads(manifest.read_text())
        files = {name: RepoFile(name, size, sha) for name, (size, sha) in data["files"].items()}
        shapes = {k: {t: (d, list(s)) for t, (d, s) in v.items()} for k, v in data.get("shapes", {}).items()}
    except (OSError, ValueError, KeyError, TypeError):  # cached by another program: what the snapshot holds
        snapshot = folder / "snapshots" / commit
        files = {str(p.relative_to(snapshot)): RepoFile(str(p.relative_to(snapshot)), p.stat().st_size,
                                                        _cached_sha256(p))
                 for p in snapshot.rglob("*") if p.is_file()}
        shapes = {}
    return HubModel(hub, repo, revision, commit, files, shapes)


def _unreachable(exc: Exception) -> bool:
    """Whether `exc` says the hub could not be reached at all (not that it answered no)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.HfHubHTTPError):
        return False
    name = type(exc).__name__
    return isinstance(exc, (OSError, errors.OfflineModeIsEnabled)) or "Connect" in name or "Timeout" in name


def _cached_sha256(path: Path) -> str | None:
    """The sha256 the hub cache names a blob by (LFS files are stored under their content hash)."""
    name = Path(os.path.realpath(path)).name
    return name if re.fullmatch(r"[0-9a-f]{64}", name) else None


def _unavailable(exc: Exception, repo: str, revision: str, hub: Hub, name: str | None = None) -> ModelUnavailable:
    """The hub client's error as what happened and what to do."""
    from huggingface_hub import errors

    what = f"{repo}@{revision}" + (f": {name}" if name else "")
    if isinstance(exc, errors.GatedRepoError):
        hint = "the token in HF_TOKEN has no access" if hub.token else "no token is set"
        return ModelUnavailable(f"{what}: the model is gated and {hint}; accept its terms on the hub and set HF_TOKEN")
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelUnavailable(f"{repo}: revision {revision!r} not found (a branch, tag or commit of the repository)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelUnavailable(f"{repo}: repository not found at {hub.endpoint} (check the name; a private one "
                                "needs HF_TOKEN)")
    if isinstance(exc, errors.EntryNotFoundError):
        return ModelUnavailable(f"{what}: file not found in the repository")
    if isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        return ModelUnavailable(f"{what}: not in the hub cache ({hub.cache_dir}) and the hub is unreachable or "
                                "HF_HUB_OFFLINE is set; run once online")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return ModelUnavailable(f"{what}: the disk of {hub.cache_dir} is full; free some space or point HF_HOME "
                                "at a larger disk (the download resumes where it stopped)")
    if isinstance(exc, errors.HfHubHTTPError):
        return ModelUnavailable(f"{what}: the hub at {hub.endpoint} answered {str(exc).splitlines()[0][:200]}")
    return ModelUnavailable(f"{what}: could not reach the hub at {hub.endpoint} ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); downloads resume where they stopped when run again")


def logged_progress():
    """A progress bar for the hub client's downloads that writes log lines (bytes, rate, time left) every
    few seconds instead of drawing: peers run unattended, their output goes to logs."""
    from tqdm.std import tqdm

    class LoggedProgress(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.update(disable=False, mininterval=PROGRESS_EVERY_S, file=_Null())
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None) -> bool:
            d = self.format_dict
            total, rate = d.get("total"), d.get("rate")
            if not total or self.n >= total or not rate:
                return True
            logger.info("%s: %s of %s, %.1f MiB/s, %.0f s left", d.get("prefix") or self.desc or "download",
                        _size(self.n), _size(total), rate / 2**20, (total - self.n) / rate)
            return True

    return LoggedProgress


class _Null:
    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header (the first bytes only)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    return {k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def sha256_of(path: Path, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
