"""The first-party import graph (canary_jax, pallas_kernels, interop), read with ``ast``: no import circles, and
``canary_jax`` never imports ``pallas_kernels`` or ``interop`` at module level (the kernels and the torch side
build on ``canary_jax``, never the reverse). Pure ``ast``: nothing is imported, no JAX.

An edge is an ``import`` / ``from ... import`` statement anywhere outside a function or class body, including
``if TYPE_CHECKING:`` and ``try:`` blocks at module level (a type-only edge is still a circle between the two
modules' jobs). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (so
``from canary_jax import layout`` is no edge to ``canary_jax/__init__.py``). One test also counts imports inside
functions: a lazy import that dodges a circle is still one.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("canary_jax", "pallas_kernels", "interop")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods, *, in_functions: bool) -> set[str]:
    """First-party modules ``name`` imports (module level only unless ``in_functions``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                if in_functions:
                    visit(ast.iter_child_nodes(node))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in mods else base)
            else:
                visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return {m for m in found if m in mods and m != name}


def _graph(*, in_functions: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods, in_functions=in_functions) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_graph_sees_the_packages():
    graph = _graph()
    assert "canary_jax.ops.backends" in graph and "pallas_kernels.verify" in graph and "interop.native.program" in graph
    assert "canary_jax.ops.backends" in graph["pallas_kernels.config"]


def test_no_import_circles_at_module_level():
    assert _cycles(_graph()) == []


def test_no_import_circles_counting_imports_inside_functions():
    # A circle hidden inside a function (a lazy import) is still a circle between two modules' jobs.
    assert _cycles(_graph(in_functions=True)) == []


def test_canary_jax_never_imports_the_kernels_or_interop_at_module_level():
    bad = {
        name: sorted(m for m in deps if not m.startswith("canary_jax"))
        for name, deps in _graph().items()
        if name.startswith("canary_jax")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_backend_registry_names_the_kernels_without_importing_them():
    graph = _graph(in_functions=True)
    assert not any(m.startswith("pallas_kernels") for m in graph["canary_jax.ops.backends"])
    source = (ROOT / "canary_jax" / "ops" / "backends.py").read_text()
    assert '"pallas_kernels.verify:verify_pallas"' in source and '"pallas_kernels.write:write_pallas"' in source


# The rooms of canary_jax, lowest first: a module imports (anywhere in it) only its own room and rooms below it.
ROOM_ORDER = ("contract", "planning", "ops", "runtime", "tools", "adapters", "cli")


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "canary_jax" and len(parts) > 1 and parts[1] in ROOM_ORDER else None


def test_rooms_import_one_way():
    upward = []  # counting imports inside functions: a lazy import upward is still one
    for name, deps in _graph(in_functions=True).items():
        here = _room(name)
        for dep in deps:
            there = _room(dep)
            if here and there and ROOM_ORDER.index(there) > ROOM_ORDER.index(here):
                upward.append((name, dep))
    assert upward == []


def test_the_package_top_holds_only_rooms():
    top = sorted(p.name for p in (ROOT / "canary_jax").iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "__main__.py", "_aliases.py"]
    rooms = {p.name for p in (ROOT / "canary_jax").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ROOM_ORDER) | {"_compat"}
