"""The built wheel works on its own: built from this tree, installed with its dependencies into a fresh
virtual environment (torch pinned as the Makefile pins it), run from outside the source tree. The package
data (the health page, the API's chat page) is in it and nothing is read from the source tree.

Slow by nature (a virtual environment and its dependencies, from pip's cache after the first run)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # as the Makefile installs it: a CPU build lies on these machines' disks


def run(*cmd: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def has_modern_setuptools() -> bool:
    """Whether this interpreter can build the wheel itself (setuptools 77+, as pyproject.toml requires)."""
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= 77
    except (ImportError, ValueError, LookupError):
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # without build isolation when this interpreter has what the build needs: no download of setuptools
    isolation = ["--no-build-isolation"] if has_modern_setuptools() else []
    log = run(sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", *isolation,
              "-w", str(out), str(REPO), cwd=out)
    assert "Warning" not in log and "!!" not in log, log  # setuptools' deprecations and banners
    (built,) = out.glob("swarm_inference-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel and its dependencies; its bin directory."""
    root = tmp_path_factory.mktemp("venv")
    venv.create(root, with_pip=True)
    bin_dir = root / "bin"
    run(str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH, str(wheel),
        cwd=root, timeout=900)
    return bin_dir


def clean_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "SWARM_HOME": str(home)}


def test_the_wheel_holds_the_packages_and_their_data(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"bootstrap/health_page.html", "client/api/static/chat.html", "swarm/cli.py", "peer/server.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_the_installed_command_runs_from_outside_the_source_tree(installed, tmp_path):
    env = clean_env(tmp_path / "home")
    assert "demo-model" in run(str(installed / "swarm"), "--help", cwd=tmp_path, env=env)
    assert "--dir" in run(str(installed / "swarm"), "demo-model", "--help", cwd=tmp_path, env=env)
    where = run(str(installed / "python"), "-c", "\n".join([
        "import bootstrap.monitor, client.api.chat_page, swarm",
        "assert bootstrap.monitor._page().startswith(b'<!') and client.api.chat_page.page()[0]",
        "print(swarm.__file__)",
    ]), cwd=tmp_path, env=env)
    assert str(installed.parent) in where and str(REPO) not in where, where
