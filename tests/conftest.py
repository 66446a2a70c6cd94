"""Shared fixtures. Tests are tiered by what they need: unit (nothing), models (torch), integration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for tests' own helper modules (tiny_models, ...)

import demo_checkpoint  # noqa: E402
import lifetimes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_conversion = demo_checkpoint.Conversion()


def pytest_sessionstart(session):
    if demo_checkpoint.reached(session.config.args):
        _conversion.start(demo_checkpoint.directory())


def pytest_sessionfinish(session):
    _conversion.finish()  # no test needed it after all (deselected): never left running


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Within each folder, modules run grouped by the shared swarms they use (in their order within a
    group): none, the tiny one, both, the demo one. The demo checkpoint's conversion, if it runs, overlaps
    the first groups, and each swarm is up for as few modules as can be (see `lifetimes`). trylast: the
    selection and order the run will have are what `lifetimes` needs."""
    folder_first: dict[Path, int] = {}
    uses: dict[Path, set[str]] = {}
    for i, item in enumerate(items):
        folder_first.setdefault(item.path.parent, i)
        uses.setdefault(item.path, set()).update({"swarm", "demo_model_dir"}.intersection(item.fixturenames))
    group = {frozenset(): 0, frozenset({"swarm"}): 1, frozenset({"swarm", "demo_model_dir"}): 2,
             frozenset({"demo_model_dir"}): 3}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (folder_first[it.path.parent], group[frozenset(uses[it.path])], order[id(it)]))
    lifetimes.collected(items)


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
    """The prepared demo checkpoint (see `demo_checkpoint`): converted in the background since the session
    started, or here."""
    from swarm.local.demo_model import prepare_demo_model

    sys.stderr.write(_conversion.finish())  # its progress lines, shown with this test's output
    return prepare_demo_model(demo_checkpoint.directory())
