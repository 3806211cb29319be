"""The import graph of the shipped packages flows one way: no import runs back up the
layers, and no two modules import each other, directly or around a circle.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a
type-only import still ties two files together). The layers, low to high, are
``LAYERS``; a module may import its own layer or a lower one.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "inspector", "kernels")

# Low to high. A module belongs to the layer of the longest prefix that names it.
E = "kvscope.engine"
LAYERS: list[tuple[str, ...]] = [
    ("kvscope.kernels",),
    (f"{E}.events",),  # the protocol and its mirror: schema, sink, causes, state
    (f"{E}.events.wire", f"{E}.events.analysis", f"{E}.events.vllm"),
    (f"{E}.cache", "kvscope.inspector"),
    (f"{E}.device", f"{E}.extras", f"{E}.config", f"{E}.features", f"{E}.sequence",
     f"{E}.outputs", f"{E}.model", f"{E}.sampling_params", f"{E}.sampling_ops",
     f"{E}.structured", f"{E}.completion",
     f"{E}.request_state"),
    (f"{E}.scheduler", f"{E}.runner", f"{E}.sampler", f"{E}.reference_generate"),
    (f"{E}.distributed",),
    (f"{E}.engine",),
    (E, f"{E}.llm", f"{E}.server"),
    (f"{E}.router", f"{E}.loadgen"),
    (f"{E}.bench",),
    (f"{E}.commands", f"{E}.cli"),
]
# inspector draws events; it may not reach into the engine's other rooms
INSPECTOR_MAY_IMPORT = ("kvscope.engine.events",)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["kvscope", *parts])] = path  # the installed name (setup.py)
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of this tree that ``name`` imports (a ``from pkg import sub`` names the
    submodule when ``sub`` is one)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import kvscope.engine.x.y` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


@functools.cache
def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
            for a, targets in sorted(graph.items()) for b in sorted(targets)
            if _layer(b) > _layer(a)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # depth bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_up_the_layers():
    upward = upward_imports(_graph())
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def test_inspector_imports_only_the_event_packages():
    bad = [f"{a} imports {b}" for a, targets in sorted(_graph().items())
           if a.startswith("kvscope.inspector") for b in sorted(targets)
           if b.startswith("kvscope.engine") and not b.startswith(INSPECTOR_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    found = circles(_graph())
    assert not found, "modules that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_checks_see_what_they_must_refuse():
    """On a made-up graph the checks find the upward arrow and the circle; on the real
    graph, edges known to exist are seen (the graph is not empty by accident)."""
    fake = {"kvscope.engine.cache.manager": {"kvscope.engine.cache.report"},
            "kvscope.engine.cache.report": {"kvscope.engine.cache.manager"},
            "kvscope.engine.events.state": {"kvscope.engine.engine"}}
    assert upward_imports(fake) == [
        "kvscope.engine.events.state (layer 1) imports kvscope.engine.engine (layer 7)"]
    assert circles(fake) == [["kvscope.engine.cache.manager", "kvscope.engine.cache.report"]]
    graph = _graph()
    assert {"kvscope.engine.scheduler", "kvscope.engine.cache"} <= graph["kvscope.engine.engine"]
    assert "kvscope.engine.events.schema" in graph["kvscope.engine.cache.manager"]


def test_every_import_of_our_code_names_kvscope():
    """Installed, the rooms exist only as ``kvscope.engine``, ``kvscope.inspector`` and
    ``kvscope.kernels`` (setup.py). A bare ``import engine`` still works from the
    checkout's root, where the folders sit on the path, so only this check catches it
    before a user's install does."""
    rooms = ("engine", "inspector", "kernels", "kvscope_assets")
    bad = []
    for folder in (*PACKAGES, "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                        if n.split(".")[0] in rooms]
    assert not bad, "\n".join(bad)


def test_every_shipped_module_fits_in_a_head():
    """The house's size rule: no module of engine/, inspector/ or kernels/ over 600 lines
    (split by job, as the cache manager and KVState were, rather than raise this)."""
    big = {name: n for name, path in _modules().items()
           if (n := len(path.read_text().splitlines())) > 600}
    assert not big, f"modules over 600 lines: {big}"
