"""The house rules of docs/architecture.md: imports flow down the layers, and no module imports itself in a circle.

    cli -> loop -> cluster -> workers -> {train, rollout, reward} -> engine -> models
    (config, algo, generation, batch, data, device, ... are used from above)

The import graph is read from the source (every `import` / `from ... import`, including those inside functions),
so a lazy import cannot hide an arrow. Each rule is also checked against a planted violation, so a broken checker
cannot pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# package -> the lathe packages it must never import (a package never restricts itself)
FORBIDDEN = {
    "models": {"engine", "rollout", "train", "workers", "cluster", "loop", "cli"},
    "engine": {"rollout", "train", "workers", "cluster", "loop", "cli"},
    "rollout": {"train", "workers", "cluster", "loop", "cli"},
    "train": {"workers", "cluster", "loop", "cli"},
    "workers": {"cluster", "loop", "cli"},
    "cluster": {"loop", "cli"},
    "loop": {"cli"},
}
LEAVES = {"config", "algo", "reward", "generation", "batch", "seeding"}   # import nothing of lathe but themselves
NO_CIRCLES = {"engine", "loop", "cluster", "config", "data", "workers", "generation", "rollout", "train"}


def modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in (src / "lathe").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def import_graph(src: Path) -> dict[str, set[str]]:
    """module -> the lathe modules it imports (a `from pkg import name` of a submodule counts as that module)."""
    mods, graph = modules(src), {}
    for name, (path, package) in mods.items():
        base = name.split(".") if package else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                subs = [f"{module}.{a.name}" for a in node.names]
                # `from pkg import sub`: the package itself only when some name is not a submodule
                names = subs + ([module] if any(sub not in mods for sub in subs) else [])
            else:
                continue
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target.startswith("lathe") and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]]) -> list[str]:
    """'a.b -> c.d (rule)' for every import a layer rule forbids."""
    found = []
    for source, targets in sorted(graph.items()):
        here = package(source)
        for target in sorted(targets):
            there = package(target)
            if there == here or not there:
                continue
            if there in FORBIDDEN.get(here, ()):
                found.append(f"{source} -> {target} ({here}/ must not import {there}/)")
            elif here in LEAVES:
                found.append(f"{source} -> {target} ({here}/ is a leaf)")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between packages, and between modules of one package in NO_CIRCLES (strongly connected
    components of more than one node)."""
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        packages.setdefault(package(source), set()).update(package(t) for t in targets if package(t) != package(source))
    inside = {s: {t for t in ts if package(t) == package(s)} for s, ts in graph.items() if package(s) in NO_CIRCLES}
    return _components(packages) + _components(inside)


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_flow_down_the_layers():
    assert violations(import_graph(SRC)) == []


def test_no_import_circles():
    assert circles(import_graph(SRC)) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"lathe/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_planted_upward_import_is_found(tmp_path):
    src = _tree(tmp_path, {"lathe/engine/__init__.py": "", "lathe/engine/step.py": "def f():\n    import lathe.rollout.base\n",
                           "lathe/rollout/__init__.py": "", "lathe/rollout/base.py": "",
                           "lathe/config/__init__.py": "from lathe.device import x\n", "lathe/device.py": ""})
    assert violations(import_graph(src)) == [
        "lathe.config -> lathe.device (config/ is a leaf)",
        "lathe.engine.step -> lathe.rollout.base (engine/ must not import rollout/)"]


def test_a_planted_circle_is_found(tmp_path):
    src = _tree(tmp_path, {"lathe/loop/__init__.py": "", "lathe/loop/a.py": "from lathe.loop.b import g\n",
                           "lathe/loop/b.py": "from lathe.loop import a\n",
                           "lathe/data/__init__.py": "", "lathe/data/x.py": "from lathe.models import y\n",
                           "lathe/models/__init__.py": "", "lathe/models/y.py": "from ..data import x\n"})
    assert circles(import_graph(src)) == [["data", "models"], ["lathe.loop.a", "lathe.loop.b"]]
