"""One model, one set of weights: the digest that names exactly which weights a peer serves.

The digest covers the config (its content's sha256) and every weight file the checkpoint loads (name and
content sha256). The same files give the same digest whether they came from the hub (whose LFS hashes
are content hashes, so no shard needs downloading to know it) or sit in a local directory (hashed
once; the hashes are cached by path, size and modification time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from swarm.files import write_json
from swarm.errors import CheckpointError
from swarm.weights.hub import INDEX, SINGLE, HubModel, sha256_of

logger = logging.getLogger(__name__)

DIGEST_CHARS = 32  # 128 bits: names a set of weights; not a defence against a lying peer (outputs are checked)
_DOMAIN = b"swarm-weights-v1\0"


def digest_of(config_sha256: str, weights: dict[str, str]) -> str:
    h = hashlib.sha256(_DOMAIN)
    h.update(f"config.json:{config_sha256}\n".encode())
    for name in sorted(weights):
        h.update(f"{name}:{weights[name]}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]


def weight_files_of(directory: Path) -> list[str]:
    index = directory / INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__})") from exc
    if (directory / SINGLE).is_file():
        return [SINGLE]
    raise CheckpointError(f"{directory} has neither {SINGLE} nor {INDEX}; only safetensors checkpoints are "
                          "supported (convert .bin files with save_pretrained)")


class HashCache:
    """Content hashes of local files, kept by (real path, size, mtime) in one JSON file."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, str] = {}
        if path is not None:
            try:
                self.entries = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                self.entries = {}
        self.dirty = False

    def sha256(self, file: Path) -> str:
        st = file.stat()
        key = f"{os.path.realpath(file)}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.entries:
            if st.st_size > 2**28:
                logger.info("hashing %s (%.1f GiB, once)", file.name, st.st_size / 2**30)
            self.entries[key] = sha256_of(file)
            self.dirty = True
        return self.entries[key]

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            write_json(self.path, self.entries)
        except OSError as exc:
            logger.warning("could not keep file hashes in %s: %s", self.path, exc)


SIDECAR = ".swarm-file-hashes.json"


def hash_cache_for(directory: Path, cache_home: str | Path | None) -> HashCache:
    """The directory's own hash file where it can be written (every process that opens it, whatever its
    cache home, hashes nothing again), else `file-hashes.json` in the cache home."""
    import os

    if os.access(directory, os.W_OK):
        return HashCache(directory / SIDECAR)
    return HashCache(Path(cache_home) / "file-hashes.json" if cache_home else None)


def local_hashes(directory: Path, cache_home: str | Path | None) -> tuple[str, dict[str, str]]:
    """(config sha256, {weight file: sha256}) of a local checkpoint directory."""
    cache = hash_cache_for(directory, cache_home)
    config = directory / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a transformers checkpoint directory")
    files = {name: cache.sha256(directory / name) for name in weight_files_of(directory)
             if (directory / name).is_file() or _missing(directory, name)}
    cache.save()
    return sha256_of(config), files


def _missing(directory: Path, name: str) -> bool:
    raise CheckpointError(f"{directory}: its {INDEX} names {name}, which is not there (is the checkpoint complete?)")


def local_digest(directory: Path, cache_home: str | Path | None) -> str:
    return digest_of(*local_hashes(directory, cache_home))


def hub_digest(model: HubModel) -> str:
    """The digest of a hub model from the hashes the hub reports; a weight file it gives no hash for is
    fetched and hashed."""
    weights = {}
    for name in model.weight_files:
        sha = model.files[name].sha256
        weights[name] = sha if sha else sha256_of(model.path(name))
    return digest_of(sha256_of(model.path("config.json")), weights)
