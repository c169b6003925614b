"""The import graph, read statically (ast) from the source: no import circles, between modules or between packages;
each package imports only the packages `LAYERS` allows it (docs/architecture.md shows the same table); ``vlmreg.sdk``
imports nothing of vlmreg's other packages (not even inside a function or under ``TYPE_CHECKING``); and the bundled
and example plugins import only vlmreg's public modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: What a plugin may import: the package's own names, the SDK, and (for its tests) the testing kit.
PUBLIC = ("vlmreg", "vlmreg.sdk", "vlmreg.testing")

#: The rooms of vlmreg, from the bottom up: each package (or top-level module) of ``vlmreg`` and the others it may
#: import, at module level, inside a function or under ``TYPE_CHECKING``. ``vlmreg`` is the package's own
#: ``__init__`` (the public facade). A new package needs a row here and in docs/architecture.md's table, which
#: tests/docs/test_architecture_doc.py holds to this one.
LAYERS: dict[str, frozenset[str]] = {
    "sdk": frozenset(),  # what a plugin touches: imports nothing of vlmreg's
    "durable": frozenset(),  # fsync helpers
    "gather": frozenset(),  # await many, cancel the rest on the first failure
    "http": frozenset({"sdk"}),  # the shared HTTP client and server base
    "resolution": frozenset({"sdk"}),
    "config": frozenset({"sdk"}),
    "rewards": frozenset({"sdk", "gather"}),
    "data": frozenset({"sdk", "config"}),
    "modeling": frozenset({"sdk", "resolution"}),
    "loading": frozenset({"sdk", "config", "data", "resolution", "modeling"}),
    "broadcast": frozenset({"sdk", "durable", "resolution", "loading"}),
    "inference": frozenset({"sdk", "http", "config", "data", "resolution", "loading", "broadcast"}),
    "serve": frozenset({"sdk", "http", "config", "data", "loading", "broadcast", "inference"}),
    "envs": frozenset({"sdk", "http", "gather", "data", "serve"}),  # serve: its API-key check, for `vlmreg env serve`
    "rollout": frozenset({"sdk", "data", "envs"}),
    "tasks": frozenset({"sdk", "data", "envs"}),  # data: a generated clip is a DecodedVideo
    "train": frozenset(
        {
            "sdk",
            "http",
            "durable",
            "resolution",
            "config",
            "data",
            "rewards",
            "modeling",
            "loading",
            "inference",
            "serve",
            "envs",
            "rollout",
        }
    ),
    "builtin": frozenset({"sdk", "broadcast", "inference", "serve", "envs", "rewards", "tasks", "train"}),
    "scaffold": frozenset({"sdk"}),
    "vlmreg": frozenset({"sdk", "resolution", "config", "loading", "broadcast", "envs", "train"}),
    "testing": frozenset(
        {
            "vlmreg",
            "sdk",
            "http",
            "resolution",
            "config",
            "data",
            "modeling",
            "loading",
            "broadcast",
            "inference",
            "rollout",
            "train",
        }
    ),
    "cli": frozenset(
        {
            "vlmreg",
            "sdk",
            "http",
            "resolution",
            "config",
            "data",
            "rewards",
            "loading",
            "broadcast",
            "serve",
            "envs",
            "train",
            "scaffold",
            "testing",
        }
    ),
    "__main__": frozenset({"cli"}),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, module: str) -> list[tuple[str, list[str], int, str]]:
    """Every import statement of a file as ``(module imported, names taken from it, line, where)``; ``where`` is
    ``module`` (runs on import), ``typing`` (under ``if TYPE_CHECKING:``) or ``function`` (inside a def or class
    body's function). Relative imports are made absolute against ``module``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str], int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, [], child.lineno, where) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                found.append((base, [a.name for a in child.names], child.lineno, where))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and where == "module":
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), where)
            else:
                visit(child, where)

    visit(tree, "module")
    return found


def vlmreg_modules() -> dict[str, Path]:
    return {module_name(p, SRC): p for p in sorted((SRC / "vlmreg").rglob("*.py"))}


def targets(base: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The vlmreg modules an import statement loads: ``from a.b import c`` is module ``a.b.c`` when that is a module,
    else ``a.b`` (the name ``c`` defined there)."""
    if not (base == "vlmreg" or base.startswith("vlmreg.")):
        return []
    if not names:
        return [base]
    out = {f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names}
    return sorted(out)


def edges(wheres: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the vlmreg modules it imports at the given places (``module``, ``typing``, ``function``)."""
    modules = vlmreg_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for base, names, _, where in imports_of(path, module):
            if where in wheres:
                graph[module].update(t for t in targets(base, names, modules) if t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module, to name in the failure."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


@pytest.mark.parametrize(
    "wheres", [("module",), ("module", "function")], ids=["module-level", "module-and-function-level"]
)
def test_no_import_circles(wheres):
    """No circles among the imports that run at import time, nor when the deferred ones (inside functions) are
    counted too: a deferred import that closes a circle only hides it (``data.images`` deferred ``data.fetch``, which
    imported ``data.images``). Imports under ``TYPE_CHECKING`` never run and are left out."""
    graph = edges(wheres)
    found = cycles(graph)
    assert found == [], f"{len(found)} import circles ({' and '.join(wheres)} imports):\n" + "\n".join(
        " -> ".join(shortest_cycle(graph, c)) + (f"  ({len(c)} modules in the circle)" if len(c) > 2 else "")
        for c in found
    )


def package_of(module: str) -> str:
    """The room a module lives in: ``vlmreg.train.recipe`` -> ``train``, ``vlmreg.durable`` -> ``durable``, the facade
    ``vlmreg`` -> ``vlmreg``."""
    return module.split(".")[1] if "." in module else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, imported in graph.items():
        out.setdefault(package_of(module), set()).update(
            package_of(t) for t in imported if package_of(t) != package_of(module)
        )
    return out


def layer_violations(layers: dict[str, frozenset[str]]) -> list[str]:
    """Each import from one package to another that ``layers`` does not allow, as ``file:line (where): a -> b``."""
    modules = vlmreg_modules()
    bad = []
    for module, path in modules.items():
        source = package_of(module)
        for base, names, line, where in imports_of(path, module):
            for target in targets(base, names, modules):
                to = package_of(target)
                if to != source and to not in layers.get(source, frozenset()):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({where}): {source} -> {to} (imports {target})")
    return bad


def test_every_package_has_a_row_in_the_layer_table():
    missing = sorted({package_of(m) for m in vlmreg_modules()} - LAYERS.keys())
    assert missing == [], (
        f"packages with no row in LAYERS (tests/test_import_graph.py) nor docs/architecture.md: {missing}"
    )
    unknown = sorted({p for allowed in LAYERS.values() for p in allowed} - LAYERS.keys())
    assert unknown == [], f"LAYERS allows packages it has no row for: {unknown}"


def test_the_layer_table_has_no_circles():
    """The table is an order: no package may import one that may import it back, however far round."""
    assert cycles({p: set(allowed) for p, allowed in LAYERS.items()}) == []


def test_packages_import_only_what_the_layer_table_allows():
    bad = layer_violations(LAYERS)
    assert bad == [], (
        f"{len(bad)} imports the layer table (LAYERS, docs/architecture.md) does not allow:\n" + "\n".join(bad)
    )


def test_no_import_circles_between_packages():
    """Follows from the two tests above; named on its own so a circle is reported as one, with its packages."""
    graph = package_graph(edges(("module", "function", "typing")))
    found = cycles(graph)
    assert found == [], "import circles between packages:\n" + "\n".join(
        " -> ".join(shortest_cycle(graph, c)) for c in found
    )


def sdk_upward_imports() -> list[str]:
    modules = vlmreg_modules()
    bad = []
    for module, path in modules.items():
        if module != "vlmreg.sdk" and not module.startswith("vlmreg.sdk."):
            continue
        for base, names, line, where in imports_of(path, module):
            for target in targets(base, names, modules):
                if target != "vlmreg.sdk" and not target.startswith("vlmreg.sdk."):
                    bad.append(
                        f"{path.relative_to(ROOT)}:{line} ({where}): imports {target}"
                        + (f" ({', '.join(names)})" if names else "")
                    )
    return bad


def test_sdk_imports_nothing_above_it():
    bad = sdk_upward_imports()
    assert bad == [], f"{len(bad)} imports from vlmreg.sdk to vlmreg's other packages:\n" + "\n".join(bad)


def public_names() -> set[str]:
    """The names ``vlmreg/__init__.py`` lists in ``__all__`` (read statically)."""
    tree = ast.parse((SRC / "vlmreg" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    raise AssertionError("src/vlmreg/__init__.py has no __all__")


def is_public(base: str, names: list[str], exported: set[str]) -> bool:
    if base == "vlmreg":  # from vlmreg import X: X must be a public name, or the sdk / testing package
        return all(n in exported or n in ("sdk", "testing") for n in names) if names else True
    return any(base == p or base.startswith(p + ".") for p in PUBLIC[1:])


def plugin_files() -> list[Path]:
    bundled = sorted(ROOT.glob("plugins/*/src/**/*.py"))
    examples = sorted(
        p
        for p in ROOT.glob("examples/plugins/*/**/*.py")
        # a local pip install's copies are not the source
        if not {"build", "dist"} & set(p.relative_to(ROOT).parts)
    )
    return bundled + examples


def private_imports_of_plugins() -> list[str]:
    exported = public_names()
    bad = []
    for path in plugin_files():
        for base, names, line, _ in imports_of(path, path.stem):
            if (base == "vlmreg" or base.startswith("vlmreg.")) and not is_public(base, names, exported):
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {base} import {', '.join(names) or '*'}")
    return bad


def test_plugins_import_only_public_modules():
    assert len(plugin_files()) > 20
    bad = private_imports_of_plugins()
    assert bad == [], (
        f"{len(bad)} imports of vlmreg's internals by bundled or example plugins (use vlmreg, vlmreg.sdk or "
        "vlmreg.testing):\n" + "\n".join(bad)
    )


# -- the checks themselves can fail --------------------------------------------------------------------------------
def test_cycles_finds_a_circle_and_not_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_layer_check_names_an_import_the_table_does_not_allow():
    """Take ``modeling`` from what ``loading`` may import: ``loading.load``'s import of the attention module is
    reported, with its file and line."""
    narrowed = dict(LAYERS, loading=LAYERS["loading"] - {"modeling"})
    bad = layer_violations(narrowed)
    assert bad and all(": loading -> modeling (imports vlmreg.modeling." in b for b in bad), bad
    assert any(b.startswith("src/vlmreg/loading/load.py:") for b in bad)


def test_package_graph_and_package_of():
    assert (
        package_of("vlmreg.train.recipe") == "train"
        and package_of("vlmreg.durable") == "durable"
        and package_of("vlmreg") == "vlmreg"
    )
    graph = package_graph(
        {"vlmreg.a.x": {"vlmreg.a.y", "vlmreg.b.z"}, "vlmreg.b.z": {"vlmreg.a.y"}, "vlmreg.a.y": set()}
    )
    assert graph == {"a": {"b"}, "b": {"a"}} and cycles(graph) == [["a", "b"]]


def test_imports_are_read_at_every_depth(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport vlmreg.a\nfrom . import b\nif TYPE_CHECKING:\n    from vlmreg.c "
        "import C\ndef f():\n    from vlmreg.d import D\nclass K:\n    def g(self):\n        import vlmreg.e\n"
    )
    found = {(base, where) for base, _, _, where in imports_of(source, "vlmreg.pkg.m")}
    assert found >= {
        ("vlmreg.a", "module"),
        ("vlmreg.pkg", "module"),
        ("vlmreg.c", "typing"),
        ("vlmreg.d", "function"),
        ("vlmreg.e", "function"),
    }


@pytest.mark.parametrize(
    ("base", "names", "public"),
    [
        ("vlmreg", ["Objective"], True),
        ("vlmreg.sdk", ["LossInputs"], True),
        ("vlmreg.sdk.engine", ["EngineContext"], True),
        ("vlmreg.testing", ["FamilyConformance"], True),
        ("vlmreg", ["sdk"], True),
        ("vlmreg.train.losses", ["aggregate"], False),
        ("vlmreg", ["data"], False),
        ("vlmreg.sdkx", ["A"], False),
        ("vlmreg.broadcast", ["WeightPlan"], False),
    ],
)
def test_public_means_vlmreg_sdk_or_testing(base, names, public):
    assert is_public(base, names, public_names()) is public
