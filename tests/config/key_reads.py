"""Which config keys lathe's code reads: a static scan of ``src/lathe`` (outside ``config/``) for the test
``test_key_coverage.py``.

A read is an attribute access ``<expr>.<leaf>`` (or ``getattr(<expr>, "<leaf>")``, or ``vars(<expr>)`` for
every leaf of a group) whose ``<expr>`` resolves to a config *group*, so a generic leaf name (``enable``,
``path``, ``name``, ``format``) counts only on the group it belongs to. Expressions resolve through:

* ``cfg`` / ``config`` (a name, or an attribute such as ``t.cfg``): the root;
* attribute chains along the schema: ``cfg.actor_rollout_ref.rollout`` is the rollout group;
* local aliases: ``arr = cfg.actor_rollout_ref``, ``a, b = x.actor, x.ref``, ``for owner in (a, b)``,
  ``src = a if validation else b``;
* ``self.<attr>`` assigned anywhere in the class (``self.cfg = actor_cfg``);
* parameters named ``<group>_cfg`` (``rollout_cfg``, ``optim_cfg`` -> every group of that name) or listed in
  ``PARAMETER_GROUPS``.

What the scan cannot see (keys read through a loop variable, ``getattr(cfg, name)``) is listed by hand in the
test, with where it happens.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from lathe.config import LatheConfig
from lathe.config.coerce import hints_of
from lathe.config.tree import dataclass_type

SRC = Path(__file__).resolve().parents[2] / "src" / "lathe"
ROOT_NAMES = {"cfg", "config"}
SYNONYMS = {"algo": "algorithm", "rc": "rollout_correction", "fn": "custom_reward_function"}
PARAMETER_GROUPS = {                             # parameters holding a group under another name
    "overlong": {"reward_model.overlong_buffer"},
    "fsdp_cfg": {f"{g}.fsdp_config" for g in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")},
    "log_prob_cfg": {"actor_rollout_ref.rollout", "actor_rollout_ref.ref"},
    "arr": {"actor_rollout_ref"},                # the workers' parts take the actor_rollout_ref group
}


def schema_paths() -> tuple[set[str], dict[str, type]]:
    """(every leaf key, every group path -> its dataclass; the root is '')."""
    leaves: set[str] = set()
    groups: dict[str, type] = {"": LatheConfig}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in hints_of(cls).items():
            sub = dataclass_type(tp)
            if sub is None:
                leaves.add(prefix + name)
            else:
                groups[prefix + name] = sub
                walk(sub, prefix + name + ".")

    walk(LatheConfig, "")
    return leaves, groups


def _join(group: str, name: str) -> str:
    return f"{group}.{name}" if group else name


class _Scope:
    """Names bound to config groups inside one function (or a module), plus the class's ``self.<attr>``s."""

    def __init__(self, scan: Scan, names: dict[str, set[str]], self_attrs: dict[str, set[str]]):
        self.scan, self.names, self.self_attrs = scan, names, self_attrs

    def groups(self, node: ast.AST) -> set[str]:
        """The config groups ``node`` may denote (empty: not a config group)."""
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            return {""} if node.id in ROOT_NAMES else set()
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.self_attrs:
                return self.self_attrs[node.attr]
            if node.attr in ROOT_NAMES:
                return {""}
            return {p for g in self.groups(node.value) if (p := _join(g, node.attr)) in self.scan.group_paths}
        if isinstance(node, ast.IfExp):
            return self.groups(node.body) | self.groups(node.orelse)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.groups(v) for v in node.values))
        if isinstance(node, (ast.Tuple, ast.List)):
            return set().union(*(self.groups(e) for e in node.elts)) if node.elts else set()
        return set()

    def bind(self, target: ast.AST, value: ast.AST, into: dict[str, set[str]]) -> None:
        """Record ``target = value`` (names, ``self.x``, and element-wise tuples)."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v, into)
            return
        found = self.groups(value)
        if not found:
            return
        if isinstance(target, ast.Name):
            into[target.id] = found
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            self.self_attrs.setdefault(target.attr, set()).update(found)


# `lathe sft`'s modules: they read its own config (config/schema_sft.py), whose keys tests/loop/test_sft.py covers.
SFT_MODULES = {"loop/sft.py", "data/sft.py", "train/sft.py"}


class Scan:
    """``reads``: every leaf key some code outside ``config/`` reads, with one place that reads it."""

    def __init__(self, root: Path | None = SRC):
        """Scans every module under ``root`` except ``root/config`` and SFT_MODULES (None: nothing yet, see
        ``scan_source``)."""
        self.leaves, groups = schema_paths()
        self.group_paths = set(groups)
        self.reads: dict[str, str] = {}
        for path in sorted(root.rglob("*.py")) if root is not None else []:
            if path.relative_to(root).parts[0] != "config" and str(path.relative_to(root)) not in SFT_MODULES:
                self.scan_source(path.read_text(), str(path.relative_to(root)))

    def parameter_groups(self, name: str) -> set[str]:
        if name in PARAMETER_GROUPS:
            return PARAMETER_GROUPS[name]
        if name.endswith("_cfg"):
            stem = SYNONYMS.get(name[:-4], name[:-4])
            return {p for p in self.group_paths if p.rsplit(".", 1)[-1] == stem}
        return set()

    def scan_source(self, text: str, where: str) -> None:
        tree = ast.parse(text)
        module = _Scope(self, {}, {})
        self._walk(tree.body, module, where)

    def _walk(self, body: list[ast.stmt], scope: _Scope, where: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                attrs: dict[str, set[str]] = {}
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                for _ in range(2):                                  # twice: self.x may be read before it is set
                    for fn in methods:
                        self._function(fn, _Scope(self, dict(scope.names), attrs), where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(node, _Scope(self, dict(scope.names), scope.self_attrs), where)
            else:
                self._statement(node, scope, where)

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, scope: _Scope, where: str) -> None:
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for arg in args:
            found = self.parameter_groups(arg.arg) or ({""} if arg.arg in ROOT_NAMES else set())
            if found:
                scope.names[arg.arg] = found
        for node in fn.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self._walk([node], scope, where)
            else:
                self._statement(node, scope, where)

    def _statement(self, stmt: ast.stmt, scope: _Scope, where: str) -> None:
        for node in ast.walk(stmt):                                 # bindings first, then reads
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    scope.bind(target, node.value, scope.names)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                found = scope.groups(node.iter)
                if found:
                    scope.names[node.target.id] = found
        for node in ast.walk(stmt):
            self._read(node, scope, where)

    def _read(self, node: ast.AST, scope: _Scope, where: str) -> None:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self._mark(scope.groups(node.value), [node.attr], where, node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            groups = scope.groups(node.args[0])
            if node.func.id in ("getattr", "hasattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    self._mark(groups, [name.value], where, node)
            elif node.func.id == "vars" and len(node.args) == 1:
                for g in groups:
                    cls = _group_class(g)
                    self._mark({g}, [f.name for f in dataclasses.fields(cls)], where, node)

    def _mark(self, groups: set[str], names: list[str], where: str, node: ast.AST) -> None:
        for g in groups:
            for name in names:
                key = _join(g, name)
                if key in self.leaves:
                    self.reads.setdefault(key, f"{where}:{node.lineno}")


def _group_class(path: str) -> type:
    return schema_paths()[1][path]
