"""The package stays laid out as built: every import runs down the floors of docs/ARCHITECTURE.md,
no room imports another's private names, no cycle, and no import hidden in a function to dodge one.

Read from the source (``ast``), nothing imported: this runs in a fraction of a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "optimus2d"

# room → the rooms it may import (the floors below it); a room is a folder or a top-level module
BELOW: dict[str, set[str]] = {
    "_deprecated": set(),
    "comm": set(),
    "faults": {"comm"},
    "cost": {"comm"},
    "context": {"comm", "cost"},
    "megatron": {"comm", "layers"},
    "layers": {"comm", "cost"},
    "training": {"comm", "cost", "layers"},
    "convert": {"comm", "cost", "context", "layers", "megatron"},
    "checkpoint": {"comm", "cost", "layers", "convert"},
    "families": {"comm", "cost", "layers", "convert", "checkpoint"},  # a converted HF model's save_pretrained
    "pipeline": {"comm", "cost", "context", "layers", "convert", "training", "_deprecated"},
    "launch": {"comm", "faults", "_deprecated"},
}
# imports inside functions that are not there to dodge a cycle: an optional dependency (mpi4py)
LAZY = {("comm/mesh.py", "optimus2d.comm.mpi"), ("context/hf.py", "transformers")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(module imported, names taken from it, whether inside a function) for each optimus2d import."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, [], nested) for a in child.names if a.name.startswith("optimus2d"))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("optimus2d"):
                names = [a.name for a in child.names]
                for name in names:  # `from optimus2d.comm import watch` takes a module
                    sub = f"{child.module}.{name}"
                    is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or (
                        PACKAGE.parent / sub.replace(".", "/")
                    ).is_dir()
                    found.append((sub, [], nested) if is_module else (child.module, [name], nested))
            visit(child, inner)

    visit(tree, False)
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py"))
GRAPH = {_module_name(p): _imports(p) for p in FILES}


def test_imports_run_down_the_floors():
    upward = []
    for module, imports in GRAPH.items():
        room = _room(module)
        if room == "__init__":
            continue
        for target, _, _ in imports:
            there = _room(target)
            if there != room and there not in BELOW[room]:
                upward.append(f"{module} → {target} ({room} may import {sorted(BELOW[room]) or 'nothing'})")
    assert not upward, "imports that run up or sideways:\n  " + "\n  ".join(upward)


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in GRAPH} - {"__init__"}
    assert rooms == set(BELOW), f"rooms with no place in BELOW: {sorted(rooms - set(BELOW))}"


def _private_reads(path: Path) -> list[tuple[str, str]]:
    """(module, name) for each ``alias._name`` read, where ``alias`` is an optimus2d module."""
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optimus2d"):
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.name.startswith("optimus2d") and a.asname})
    return [
        (aliases[node.value.id], node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
        if node.attr.startswith("_") and not node.attr.startswith("__")
    ]


def test_no_private_name_crosses_a_room():
    taken = [(m, t, n) for m, imports in GRAPH.items() for t, names, _ in imports for n in names]
    read = [(_module_name(p), t, n) for p in FILES for t, n in _private_reads(p)]
    crossing = [
        f"{module} takes {name} from {target}"
        for module, target, name in taken + read
        if name.startswith("_") and _room(target) != _room(module)
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_hidden_in_a_function():
    hidden = [
        f"{module} imports {target} inside a function"
        for module, imports in GRAPH.items()
        for target, _, nested in imports
        if nested and (str(Path(*module.split(".")[1:])) + ".py", target) not in LAZY
    ]
    assert not hidden, "\n".join(hidden)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def _file_of(target: str) -> str:
    """The module a target names: a package's ``__init__`` is the package."""
    while target not in GRAPH and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def test_no_cycle_between_files():
    # a package's __init__ re-exports its files, so arrows *into* a package's own files from its
    # __init__ are kept, and an import of a name through a package counts as one of that package
    graph = {m: {_file_of(t) for t, _, _ in imports} - {m} for m, imports in GRAPH.items()}
    cycle = _cycle({m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()})
    assert cycle is None, "import cycle: " + " → ".join(cycle)


@pytest.mark.parametrize(
    "old, name",
    [
        ("optimus2d.pipeline_models", "llama_stages"),
        ("optimus2d.pipeline_models", "save_stages"),
        ("optimus2d.random", "Dropout2D"),
        ("optimus2d.random", "shard_rng"),
        ("optimus2d.plan", "propose_layouts"),
        ("optimus2d.plan.scale", "best"),
        ("optimus2d.parallelize", "register_converter"),
        ("optimus2d.checkpoint_files", "PREVIOUS"),
        ("optimus2d.memory", "saved_activation_bytes"),
    ],
)
def test_old_module_paths_still_import_with_a_warning(old, name):
    import importlib

    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated: use optimus2d\."):
        assert callable(getattr(module, name)) or isinstance(getattr(module, name), str)


def test_old_top_level_names_warn_and_parallelize_stays_the_function():
    import optimus2d.parallelize

    import optimus2d
    import optimus2d.convert.parallelizer as new

    assert optimus2d.parallelize is new.parallelize
    with pytest.warns(DeprecationWarning, match=r"optimus2d\.Linear2D is deprecated: use optimus2d\.layers"):
        assert optimus2d.Linear2D is optimus2d.layers.Linear2D
    with pytest.warns(DeprecationWarning, match=r"optimus2d\.pipeline\.clip_grad_norm_ is deprecated"):
        assert optimus2d.pipeline.clip_grad_norm_ is optimus2d.clip_grad_norm_
    with pytest.warns(DeprecationWarning, match=r"optimus2d\.launch\.report_failure is deprecated"):
        assert optimus2d.launch.report_failure is optimus2d.faults.report_failure
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        optimus2d.nothing_here  # noqa: B018
