"""The package layering of docs/architecture.md, checked on the source (no imports run):

* `dataservice.data` imports nothing of the service (client, worker, dispatcher,
  transfer, cluster, cli), at module level or inside functions;
* `dataservice.sharding` imports nothing of `dataservice.data` (the rewrites that need
  the graph are `data/static_sharding.py`'s);
* `cluster.py` and `cli.py` do not import each other (`_serverproc` is their contract);
* code outside `data/` reaches a pipeline only through public names: it neither imports
  a `_`-name from a `data` module nor reads or sets, on anything but `self`/`cls`, a
  `_`-attribute that a `data/` class defines (use `dataservice.data.graph`);
* more generally, no subpackage (nor the root's modules) touches another one's private
  names: no import of its `_`-names or private modules, no `_`-attribute read or set
  (also through getattr/setattr with a literal name) on anything but `self`/`cls` that
  only other subpackages define. The root's private modules (`_core`, `_waits`,
  `_proc`, `_serverproc`) are for every subpackage;
* `dataservice.transfer` knows no worker, client or dispatcher: it imports nothing of
  them, and reads or sets no `_`-attribute of anything but `self`/`cls` (getattr and
  friends with a literal `_`-name included), whoever defines it: a transfer server
  gets what it needs of the worker through `transfer.base.TransferHost`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dataservice

PACKAGE = Path(dataservice.__file__).parent
DATA = PACKAGE / "data"
TRANSFER = PACKAGE / "transfer"
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
    modules = ("dataset.py", "ops.py", "sources.py", "batching_ops.py", "mixing_ops.py")
    for module in (*modules, "cache_ops.py", "error_ops.py"):
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


# ----------------------------------------------------- private names across subpackages
# A unit is one subpackage of dataservice (client, data, dispatcher, ...), or the
# package root's own modules ("<root>").
ROOT_UNIT = "<root>"

# Known crossings, each "path:name" (path relative to python/dataservice): none. (The
# last, transfer/shm.py's reads of the worker's _uid and _config, went with issue 12's
# TransferHost.)
ALLOWED_CROSSINGS: set[str] = set()


def _unit(path: Path, package: Path) -> str:
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else ROOT_UNIT


def _unit_of_module(module: str, package: Path) -> str | None:
    """The unit of `dataservice.<...>` module `module`; None outside the package."""
    parts = module.split(".")
    if parts[0] != "dataservice":
        return None
    if len(parts) > 1 and (package / parts[1]).is_dir():
        return parts[1]
    return ROOT_UNIT


def _absolute(path: Path, node: ast.ImportFrom, package: Path) -> str:
    if not node.level:
        return node.module or ""
    parts = ["dataservice", *path.relative_to(package).parts[:-1]]
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _defined_private_names(tree: ast.Module) -> set[str]:
    """`_`-names a module defines: module-level functions, classes and variables,
    class-body methods and attributes (wherever the class is), and attributes
    set on `self`/`cls`. A function's local variables are not names it defines."""
    names: set[str] = set()

    def add(target: ast.AST, in_function: bool) -> None:
        if isinstance(target, ast.Name) and not in_function and _is_private(target.id):
            names.add(target.id)
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id in ("self", "cls")
            and _is_private(target.attr)
        ):
            names.add(target.attr)
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                add(element, in_function)

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not in_function and _is_private(child.name):
                    names.add(child.name)
                visit(child, isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))
                continue
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    add(target, in_function)
            elif isinstance(child, ast.AnnAssign | ast.AugAssign):
                add(child.target, in_function)
            visit(child, in_function)

    visit(tree, False)
    return names


def _on_self(value: ast.AST) -> bool:
    """`self`, `cls` or `super()`: the class's own (inherited) interface."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def _private_attribute_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, name, source) of each `_`-attribute read or set on anything but
    `self`/`cls`/`super()`, getattr/setattr/hasattr/delattr with a literal name
    included."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not _on_self(node.value):
                uses.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not _on_self(node.args[0])
        ):
            uses.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return uses


def _crossings(package: Path) -> list[tuple[str, str]]:
    """("path:name", where and what) of each use, in the `dataservice` package at
    `package`, of a private name of another unit: an import of its `_`-name or of a
    private module of another subpackage, or a `_`-attribute (not on self/cls) that
    only other units define. Names no unit defines (`os._exit`, a namedtuple's
    `_fields`) are not the package's."""
    sources = sorted(
        p for p in package.rglob("*.py*") if "_pb2" not in p.name and p.suffix in (".py", ".pyi")
    )
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sources}
    defined: dict[str, set[str]] = {}
    for path, tree in trees.items():
        defined.setdefault(_unit(path, package), set()).update(_defined_private_names(tree))
    found = []
    for path, tree in trees.items():
        if path.suffix != ".py":
            continue
        unit, where = _unit(path, package), path.relative_to(package).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(path, node, package)
                names = [(module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [tuple(a.name.rsplit(".", 1)) for a in node.names if "." in a.name]
            else:
                continue
            for module, name in names:
                owner = _unit_of_module(module, package)
                if owner is None or owner == unit:
                    continue
                # A private module of the root (`_core`, `_waits`) is for every unit.
                path_parts = module.split(".")[1:] if owner != ROOT_UNIT else []
                root_module = module == "dataservice" and any(package.glob(f"{name}.*"))
                hidden = [p for p in [*path_parts, name] if _is_private(p)]
                if not hidden or root_module:
                    continue
                what = f"{where}:{node.lineno} imports {module}.{name}"
                found.append((f"{where}:{hidden[-1]}", what))
        for line, name, shown in _private_attribute_uses(tree):
            if name in defined[unit]:
                continue  # a name of its own unit too: not a crossing
            owners = sorted(u for u, names in defined.items() if name in names)
            if owners:
                what = f"{where}:{line} {shown} (a private name of {', '.join(owners)})"
                found.append((f"{where}:{name}", what))
    return found


def test_no_subpackage_touches_another_subpackages_private_names():
    """Each subpackage (and the root's modules) uses another one only through
    its public names; the root's private modules (`_core`, `_waits`, `_proc`,
    `_serverproc`) are the package's shared internals, which any subpackage may
    import (their public names)."""
    found = [what for key, what in _crossings(PACKAGE) if key not in ALLOWED_CROSSINGS]
    assert found == [], "give it a public name in its owner's interface: " + "; ".join(found)


def test_the_crossing_check_finds_each_kind_of_crossing(tmp_path):
    """The check above can fail: each kind of crossing in a small package is
    found, and what is allowed is not."""
    files = {
        "__init__.py": "",
        "_waits.py": "def env_ms(): ...\n_HIDDEN = 1\n",
        "worker/__init__.py": "",
        "worker/_impl.py": "",
        "worker/server.py": (
            "class _Task: ...\n"
            "class Worker:\n"
            "    _kind = 'w'\n"
            "    def __init__(self):\n"
            "        self._uid = 1\n"
            "        self._mu = None\n"
            "        _local = 2\n"
        ),
        "client/__init__.py": "",
        "client/reader.py": "class R:\n    def __init__(self):\n        self._mu = None\n",
        "transfer/__init__.py": "",
        "transfer/shm.py": (
            "from dataservice import _waits\n"  # allowed: a private module of the root
            "from dataservice._waits import env_ms, _HIDDEN\n"  # _HIDDEN: not allowed
            "from dataservice.worker.server import Worker, _Task\n"
            "import dataservice.worker._impl\n"
            "from ..worker import _impl\n"
            "def serve(worker, other):\n"
            "    worker._uid\n"
            "    getattr(worker, '_kind')\n"
            "    setattr(other, '_uid', 2)\n"
            "    worker.__class__\n"  # dunder: not private
            "    other._local\n"  # a local variable elsewhere: not a defined name
            "    os._exit\n"  # defined by no unit
            "class Server:\n"
            "    def __init__(self):\n"
            "        self._mu = None\n"
            "    def run(self):\n"
            "        self._uid\n"  # on self: its own interface
            "        super()._kind\n"
        ),
        "client/api.py": "def f(reader):\n    reader._mu\n",  # client defines _mu too
    }
    package = tmp_path / "dataservice"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    found = sorted(key for key, _ in _crossings(package))
    assert found == sorted(
        [
            "transfer/shm.py:_HIDDEN",
            "transfer/shm.py:_Task",
            "transfer/shm.py:_impl",
            "transfer/shm.py:_impl",
            "transfer/shm.py:_uid",
            "transfer/shm.py:_kind",
            "transfer/shm.py:_uid",
        ]
    )


def test_transfer_imports_nothing_of_the_worker_client_or_dispatcher():
    found = []
    for path in _sources(TRANSFER):
        for line, module, _ in _imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
            parts = module.split(".")
            if parts[0] == "dataservice" and len(parts) > 1:
                if parts[1] in ("worker", "client", "dispatcher", "cluster", "cli"):
                    found.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert found == []


# A namedtuple's `_fields` is its public API (the underscore only keeps it apart from
# field names): the codec tells namedtuples from tuples by it.
_TRANSFER_ALLOWED = {"_fields"}


def test_transfer_reads_no_private_field_of_another_object():
    """Stricter than the crossing check: within transfer/ too, an object's `_`-fields
    are its own (the worker's, before the TransferHost, were read by name)."""
    found = []
    for path in _sources(TRANSFER):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found.extend(
            f"{path.relative_to(PACKAGE)}:{line} {shown}"
            for line, name, shown in _private_attribute_uses(tree)
            if name not in _TRANSFER_ALLOWED
        )
    assert found == [], "use transfer.base.TransferHost instead: " + "; ".join(found)


def test_the_transfer_private_field_check_finds_what_it_looks_for():
    source = (
        "def f(server, worker, self):\n"
        "    self._ok = 1\n"
        "    a = server.worker.task_runner(4)\n"
        "    b = getattr(server.worker, '_uid', '')\n"
        "    c = worker._config.shm_ring_bytes\n"
        "    d = getattr(worker, 'address')\n"
        "    e = hasattr(d, '_fields')\n"
    )
    found = [
        (name, shown)
        for _, name, shown in _private_attribute_uses(ast.parse(source))
        if name not in _TRANSFER_ALLOWED
    ]
    assert sorted(found) == [
        ("_config", "worker._config"),
        ("_uid", "getattr(server.worker, '_uid', '')"),
    ]
