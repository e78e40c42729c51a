"""The package layering of docs/architecture.md, checked on the source (no imports run):

* `dataservice.data` imports nothing of the service (client, worker, dispatcher,
  transfer, cluster, cli), at module level or inside functions;
* `dataservice.sharding` imports nothing of `dataservice.data` (the rewrites that need
  the graph are `data/static_sharding.py`'s);
* `cluster.py` and `cli.py` do not import each other (`_serverproc` is their contract);
* code outside `data/` reaches a pipeline only through public names: it neither imports
  a `_`-name from a `data` module nor reads or sets, on anything but `self`/`cls`, a
  `_`-attribute that a `data/` class defines (use `dataservice.data.graph`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import dataservice

PACKAGE = Path(dataservice.__file__).parent
DATA = PACKAGE / "data"
SERVICE = ("client", "worker", "dispatcher", "transfer", "cluster", "cli")


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "_pb2" not in p.name)


def _imported_modules(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute import, wherever it is."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_of_data_classes() -> set[str]:
    """The `_`-methods and `_`-class attributes of the pipeline node classes (the op
    surface of dataset.py's docstring, and each op's own helpers)."""
    names: set[str] = set()
    for module in ("dataset.py", "ops.py", "sources.py"):
        tree = ast.parse((DATA / module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and _is_private(item.name):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign | ast.Assign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(
                        t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id)
                    )
    return names


def test_data_imports_nothing_of_the_service():
    found = []
    for path in _sources(DATA):
        for line, module, _ in _imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
            parts = module.split(".")
            if parts[0] == "dataservice" and len(parts) > 1 and parts[1] in SERVICE:
                found.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert found == []


def test_sharding_policy_module_imports_nothing_of_data():
    tree = ast.parse((PACKAGE / "sharding.py").read_text(encoding="utf-8"))
    found = [m for _, m, _ in _imported_modules(tree) if m.startswith("dataservice.data")]
    assert found == []


def test_cluster_and_cli_do_not_import_each_other():
    """What the CLI prints and `LocalCluster` reads is `_serverproc`'s."""
    found = []
    for name, other in (("cluster.py", "dataservice.cli"), ("cli.py", "dataservice.cluster")):
        tree = ast.parse((PACKAGE / name).read_text(encoding="utf-8"))
        found += [f"{name}:{line}" for line, m, _ in _imported_modules(tree) if m == other]
        found += [
            f"{name}:{line}"
            for line, m, names in _imported_modules(tree)
            if m == "dataservice" and other.rsplit(".", 1)[1] in names
        ]
    assert found == []


def test_nothing_outside_data_touches_a_private_name_of_data():
    private = _private_names_of_data_classes()
    assert {"_make_iterator", "_split_providers", "_walk", "_op_name"} <= private  # sanity
    found = []
    for path in _sources(PACKAGE):
        if DATA in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(PACKAGE)
        for line, module, imported in _imported_modules(tree):
            if module.startswith("dataservice.data"):
                found.extend(
                    f"{where}:{line} imports {module}.{n}" for n in imported if _is_private(n)
                )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert found == [], "use dataservice.data.graph instead: " + "; ".join(found)
