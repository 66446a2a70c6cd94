"""Fixtures of the model tests: the real demo checkpoint, prepared once and reused across runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The prepared demo checkpoint: $SWARM_TEST_DEMO_DIR, else <repo>/.cache/demo-model.

    Repo-local by default (`.cache/` is gitignored) so CI caches and later runs skip the conversion.
    """
    from swarm.demo_model import prepare_demo_model

    directory = Path(os.environ.get("SWARM_TEST_DEMO_DIR") or REPO_ROOT / ".cache" / "demo-model")
    return prepare_demo_model(directory)
