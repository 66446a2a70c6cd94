"""Shared fixtures. Tests are tiered by what they need: unit (nothing), models (torch), integration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for tests' own helper modules (tiny_models, ...)

REPO = Path(__file__).resolve().parent.parent


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
