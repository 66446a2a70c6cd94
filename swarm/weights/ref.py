"""What a user writes as `--model`: a hub repo id (`org/name`, `org/name@revision`) or a local directory.

A value that names an existing directory is that directory, whatever it looks like; anything else must
be a repo id, or it is refused with what was expected. Nothing here touches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import CheckpointError

# The hub's own rule for repo ids: an owner and a name of letters, digits, '-', '_' and '.', no '--' or
# '..', neither part starting or ending with '-' or '.'; 96 characters in all at most.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"{_PART}/{_PART}")
MAX_REPO_ID = 96
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")


@dataclass(frozen=True)
class ModelRef:
    """One model as named by a user: `path` for a local directory, else `repo` at `revision` (None: main)."""

    path: Path | None = None
    repo: str | None = None
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return str(self.path)
        return self.repo + (f"@{self.revision}" if self.revision else "")


def is_repo_id(value: str) -> bool:
    return (len(value) <= MAX_REPO_ID and REPO_ID.fullmatch(value) is not None
            and "--" not in value and ".." not in value)


def parse_model(value: str | Path, revision: str | None = None) -> ModelRef:
    """`value` as a directory if one exists there, else as `org/name[@revision]` (`revision` given apart
    must not contradict one written after '@')."""
    if isinstance(value, Path) or Path(str(value)).expanduser().is_dir():
        path = Path(value).expanduser()
        if revision:
            raise CheckpointError(f"--revision {revision} applies to a hub model, but {path} is a local directory")
        return ModelRef(path=path)
    text = str(value).strip()
    repo, at, written = text.partition("@")
    if at and not written:
        raise CheckpointError(f"model {text!r}: nothing after '@' (write org/name@revision)")
    if written and revision and written != revision:
        raise CheckpointError(f"{text!r} names revision {written!r} but --revision says {revision!r}")
    revision = written or revision or None
    if not is_repo_id(repo):
        if text.startswith((".", "/", "~")) or "/" not in repo:
            raise CheckpointError(f"model {text!r}: no such directory, and not a hub repo id like 'org/name'")
        raise CheckpointError(f"model {text!r} is not a hub repo id: expected 'org/name' (letters, digits, "
                              f"'-', '_', '.'; at most {MAX_REPO_ID} characters) or a local directory")
    if revision is not None and not _REVISION.fullmatch(revision):
        raise CheckpointError(f"revision {revision!r} of {repo} is not a branch, tag or commit name")
    return ModelRef(repo=repo, revision=revision)
