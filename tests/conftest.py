"""Shared fixtures. Tests are tiered by what they need: unit (nothing), models (torch), integration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for tests' own helper modules (tiny_models, ...)

import lifetimes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    lifetimes.collected(items)  # trylast: the order and selection the run will have


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        lifetimes.finished(item.nodeid)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family)` -> directory of a tiny random checkpoint, built once per session."""
    from tiny_models import build_tiny_checkpoint

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_checkpoint(family, tmp_path_factory.mktemp(f"ckpt-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The prepared demo checkpoint: $SWARM_TEST_DEMO_DIR, else <repo>/.cache/demo-model.

    Repo-local by default (`.cache/` is gitignored) so CI caches and later runs skip the conversion.
    """
    from swarm.local.demo_model import prepare_demo_model

    directory = Path(os.environ.get("SWARM_TEST_DEMO_DIR") or REPO / ".cache" / "demo-model")
    return prepare_demo_model(directory)
