"""The layering rules of the design: `swarm` is the bottom layer; peer, client and bootstrap import
`swarm` but never each other; importing `bootstrap` (or the `swarm` command itself) loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("swarm", "peer", "client", "bootstrap")
ALLOWED = {"swarm": set(), "peer": {"swarm"}, "client": {"swarm"}, "bootstrap": {"swarm"}}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value).split(".")[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_lower_layers(package):
    sources = sorted((REPO / package).rglob("*.py"))
    assert sources, f"no sources found for {package}"
    violations = []
    for src in sources:
        for name in imported_top_levels(src) & set(PACKAGES):
            if name != package and name not in ALLOWED[package]:
                violations.append(f"{src.relative_to(REPO)} imports {name}")
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_the_checker_sees_lazy_and_dotted_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from client.x import y\n    import peer.z\n    importlib.import_module('bootstrap.q')\n")
    assert imported_top_levels(src) == {"client", "peer", "bootstrap"}


@pytest.mark.parametrize("statement", [
    "import bootstrap.node, bootstrap.commands",
    "from swarm.cli import build_parser; build_parser()",
    "import swarm.net.transport, swarm.net.records, swarm.net.wire, swarm.net.discovery; swarm.net.transport._hm()",
])
def test_no_torch_at_import(statement):
    code = f"{statement}\nimport sys\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], f"{statement!r} imported torch or transformers"
