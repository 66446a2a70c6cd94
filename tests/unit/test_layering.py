"""The layering rules of the design, read off every import in the source (lazy ones included).

Packages: `swarm` is the bottom layer; peer, client and bootstrap import `swarm` but never each other;
importing `bootstrap` (or the `swarm` command itself) loads no torch.

Wings (docs/architecture.md):
- `swarm.net` (the network) and `swarm.model` (the model) never import each other; every `swarm.net`
  module imports without torch.
- `swarm.weights` (weight files shared between peers) stands on the ground and `swarm.net` only: no
  `swarm.model`, no `swarm.local`, and `swarm.net` does not import it; every module of it imports
  without torch.
- The ground (`swarm`'s own top-level modules: errors, span, config, cli, ...) imports no wing.
- `bootstrap` imports no `swarm.model`.
- `client.inference` imports no `client.api`, `client.light` or generation front end.
- Only `client.light` imports `libp2p`, or `multiaddr` (both come with the light client's extra only: the
  demo's install has neither; the daemon's side uses hivemind's own copy of multiaddr).
- No two project modules import each other in a circle.
"""

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
SWARM_WINGS = ("swarm.net", "swarm.model", "swarm.local", "swarm.weights")
# the client's generation front ends: what turns tokens into text for a user, above the inference wing
FRONT_ENDS = ("client.model", "client.generation", "client.checked", "client.sampling", "client.drafts",
              "client.grammar", "client.cli", "client.demo", "client.commands", "client.connection")


def imported_modules(path: Path) -> set[str]:
    """Every module imported anywhere in the file, lazy imports included: `import a.b` gives `a.b`;
    `from a import b` gives `a` and `a.b` (which is a module, or a name in `a`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return found


def imported_top_levels(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def project_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports (a name imported from a module counts as that module)."""
    out = set()
    for name in imported_modules(path):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def violations(rule, modules: dict[str, Path] | None = None) -> list[str]:
    """`rule(importer, imported)` -> a message for each import it forbids."""
    modules = modules or sources()
    found = []
    for name, path in modules.items():
        for target in sorted(project_imports(path, modules) | {m for m in imported_modules(path) if m.split(".")[0]
                                                               not in PACKAGES}):
            message = rule(name, target)
            if message:
                found.append(f"{path.relative_to(REPO)} imports {target}: {message}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_lower_layers(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no sources found for {package}"
    broken = []
    for src in files:
        for name in imported_top_levels(src) & set(PACKAGES):
            if name != package and name not in ALLOWED[package]:
                broken.append(f"{src.relative_to(REPO)} imports {name}")
    assert not broken, "layering broken:\n" + "\n".join(broken)


def wing_rule(importer: str, target: str) -> str | None:
    if within(importer, "swarm.net") and within(target, "swarm.model"):
        return "the network wing never imports the model wing"
    if within(importer, "swarm.model") and within(target, "swarm.net"):
        return "the model wing never imports the network wing"
    if within(importer, "swarm.weights") and (within(target, "swarm.model") or within(target, "swarm.local")):
        return "the weights wing stands on the ground and the network only"
    if within(importer, "swarm.net") and within(target, "swarm.weights"):
        return "the network wing never imports the weights wing"
    if within(importer, "swarm") and not any(within(importer, w) for w in SWARM_WINGS) and \
            any(within(target, w) for w in SWARM_WINGS):
        return "the ground of `swarm` imports no wing"
    if within(importer, "bootstrap") and within(target, "swarm.model"):
        return "the bootstrap stays light: no model code"
    if within(importer, "client.inference") and (within(target, "client.api") or within(target, "client.light")
                                                 or any(within(target, f) for f in FRONT_ENDS)):
        return "the inference wing imports no API, light transport or generation front end"
    if within(target, "libp2p") and not within(importer, "client.light"):
        return "only `client.light` imports py-libp2p"
    if within(target, "multiaddr") and not within(importer, "client.light"):
        return "only `client.light` imports the multiaddr package (the light client's extra)"
    return None


def test_wings_import_only_what_their_rules_allow():
    broken = violations(wing_rule)
    assert not broken, "wing rules broken:\n" + "\n".join(broken)


@pytest.mark.parametrize("importer, target", [
    ("swarm.net.wire", "swarm.model.blocks"), ("swarm.model.head", "swarm.net"), ("swarm.span", "swarm.local.launch"),
    ("bootstrap.node", "swarm.model.checkpoint"), ("client.inference.session", "client.api.gateway"),
    ("client.inference.routing", "client.light.node"), ("client.inference.hops", "client.generation"),
    ("client.connection", "libp2p.peer.id"), ("swarm.weights.share", "swarm.model.checkpoint"),
    ("swarm.weights.share", "swarm.local.launch"), ("swarm.net.transport", "swarm.weights.share"),
    ("swarm.errors", "swarm.weights"), ("swarm.net.reach", "multiaddr"),
])
def test_the_wing_rules_refuse(importer, target):
    assert wing_rule(importer, target)


def test_the_wing_rules_allow_the_layout():
    for importer, target in [("swarm.local.launch", "swarm.net.identity"), ("swarm.model.precision", "swarm.formats"),
                             ("client.model", "client.inference.session"), ("client.light.host", "libp2p.crypto"),
                             ("peer.server", "swarm.model.blocks"), ("client.api.gateway", "client.generation"),
                             ("swarm.weights.share", "swarm.net.transport"), ("swarm.weights.share", "swarm.errors"),
                             ("peer.server", "swarm.weights.share")]:
        assert wing_rule(importer, target) is None, (importer, target)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle():
    modules = sources()
    graph = {name: project_imports(path, modules) - {name} for name, path in modules.items()}
    found = cycles(graph)
    assert not found, "import circles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": {"g"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_checker_sees_lazy_and_dotted_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from client.x import y\n    import peer.z\n    importlib.import_module('bootstrap.q')\n")
    assert imported_top_levels(src) == {"client", "peer", "bootstrap"}
    assert imported_modules(src) == {"client.x", "client.x.y", "peer.z", "bootstrap.q"}


@pytest.mark.parametrize("statement", [
    "import bootstrap.node, bootstrap.commands",
    "from swarm.cli import build_parser; build_parser()",
    "import swarm.net.transport; swarm.net.transport._hm()",
])
def test_no_torch_at_import(statement):
    code = f"{statement}\nimport sys\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], f"{statement!r} imported torch or transformers"


def test_every_network_and_weights_module_imports_without_torch():
    net = sorted(name for name in sources() if within(name, "swarm.net") or within(name, "swarm.weights"))
    assert len(net) >= 10 and "swarm.weights.share" in net, net
    code = ("import importlib, sys\n"
            f"for name in {net!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules and 'transformers' not in sys.modules, name\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
