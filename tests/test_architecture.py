"""kvguard's import graph, read from the source: no circles, and arrows point one way.

Every `import` and `from ... import` in every module under kvguard/ counts, at module top,
inside functions, and under `if TYPE_CHECKING:` alike: a lazy import (kept lazy so an
unset KVGUARD and the pytest plugin import no torch) is still an arrow. `from kvguard
import _x` is an arrow to the module `kvguard._x`, not to the package.
"""

from __future__ import annotations

import ast
import configparser
import pathlib
from typing import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvguard"

# Rooms in the order arrows may point: a module may import its own room and any room
# after its own, never one before. The package itself (`kvguard`, its public names) and
# `kvguard.__main__` sit above them all; the top-level leaves below them all.
ROOMS = ("_activate", "_guard", "_engine", "_protect", "_native", "_report")
LEAVES = ("_errors", "_text", "_paths", "_config", "_ranks", "_state", "_kinds", "_presets", "_intended",
          "_torch")  # import no room
FENCE = "kvguard._torch"  # the folder of fences: every private torch API, one concern per module; a leaf room
# The name older `.pth` lines call (`import kvguard._startup`; no installer removes such a line):
# it re-exports activation's module, so it sits with the package, above every room.
SHIMS = ("_startup",)
# A top-level module that is none of the above: a new one must be given its place.
UNPLACED = -1


def module_names() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name, compiled ones (a `.pyi` beside them) included."""
    names: dict[str, pathlib.Path] = {}
    for path in sorted(PACKAGE.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if path.suffix == ".py" or name not in names:
            names[name] = path
    return names


def imports(name: str, path: pathlib.Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for each import in one module that names a kvguard module."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                yield target, node.lineno


def graph() -> dict[str, dict[str, int]]:
    modules = module_names()
    known = set(modules)
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        for target, line in imports(name, path, known):
            edges[name].setdefault(target, line)
    return edges


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    members = set(component)
    arrows = [
        f"  {name} -> {target} (line {line})"
        for name in component
        for target, line in sorted(edges[name].items())
        if target in members
    ]
    return "circle: " + ", ".join(component) + "\n" + "\n".join(arrows)


def room(name: str) -> int:
    """Where a module sits: 0 the package and __main__, 1.. the rooms in order, last the leaves."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__main__" or parts[1] in SHIMS:
        return 0
    if parts[1] in ROOMS and (PACKAGE / parts[1]).is_dir():  # a room is a subpackage
        return 1 + ROOMS.index(parts[1])
    if parts[1] in LEAVES:
        return 1 + len(ROOMS)
    return UNPLACED


def test_the_graph_is_read() -> None:
    edges = graph()
    assert "kvguard._errors" in edges
    assert sum(map(len, edges.values())) > 50


def test_no_import_circles() -> None:
    edges = graph()
    found = circles(edges)
    assert not found, "\n".join(describe(c, edges) for c in found)


def test_arrows_point_one_way_between_rooms() -> None:
    edges = graph()
    upward = [
        f"{name} -> {target} (line {line})"
        for name, targets in edges.items()
        for target, line in targets.items()
        if UNPLACED not in (room(name), room(target)) and room(target) < room(name)
    ]  # none, not even under `if TYPE_CHECKING:` (MutationError lives with the events it carries)
    assert not upward, "\n".join(upward)


def test_every_module_has_its_place() -> None:
    """A new top-level module is a leaf, a shim or in a room: otherwise its arrows go unchecked."""
    unplaced = sorted(name for name in graph() if room(name) == UNPLACED)
    assert not unplaced, f"put these in a room, or list them in LEAVES or SHIMS: {unplaced}"


def test_the_rooms_are_read() -> None:
    assert room("kvguard") == room("kvguard.__main__") == 0
    assert room("kvguard._report.events") == 1 + ROOMS.index("_report")
    assert room("kvguard._errors") == room("kvguard._text") == 1 + len(ROOMS)


def test_every_subpackage_is_shipped() -> None:
    """A room missing from setup.cfg's `packages` is left out of wheels (editable installs still see it)."""
    config = configparser.ConfigParser()
    config.read(PACKAGE.parent / "setup.cfg")
    shipped = {name.strip() for name in config["options"]["packages"].replace("\n", ",").split(",") if name.strip()}
    subpackages = {".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")}
    assert subpackages <= shipped, f"not in setup.cfg's packages: {sorted(subpackages - shipped)}"


def private_torch(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, name) of the private torch APIs a module names in code, one per line: `torch._C...`,
    `from torch.utils._pytree import ...`, `x._cdata`, `getattr(torch, "_disable_dynamo")`,
    `getattr(x, "_schema")`, and the private pytree module's registry read through any name
    (`pytree.SUPPORTED_NODES`, `node.flatten_with_keys_fn`)."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            named = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            named = [a.name for a in node.names if a.name.startswith("torch")]
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                chain.append(value.id)
            named = [".".join(reversed(chain))] if chain[-1] == "torch" or node.attr in TORCH_PRIVATE_ATTRS else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) > 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "torch" \
                and isinstance(node.args[1], ast.Constant):
            named = [f"torch.{node.args[1].value!s}"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in TORCH_PRIVATE_ATTRS:
            named = [f"<object>.{node.args[1].value!s}"]
        else:
            continue
        for name in named:
            if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:]) \
                    or name.rpartition(".")[2] in TORCH_PRIVATE_ATTRS:
                found.setdefault(node.lineno, name)
    return sorted(found.items())


# Private attributes of torch's objects, and of the private pytree module (its registry and node
# definitions), whatever name holds them.
TORCH_PRIVATE_ATTRS = {"_cdata", "_schema", "_destroy", "_values", "_indices",
                       "SUPPORTED_NODES", "flatten_fn", "flatten_with_keys_fn"}


def in_the_fence(name: str) -> bool:
    return name == FENCE or name.startswith(FENCE + ".")


def test_private_torch_apis_are_used_only_in_the_fence() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
             for name, path in module_names().items() if path.suffix == ".py" and not in_the_fence(name)
             for line, name in private_torch(path)]
    assert not found, "private torch APIs outside kvguard/_torch/:\n" + "\n".join(found)


def test_the_fence_imports_no_other_room() -> None:
    """The fence is a leaf room: its modules import each other and torch, nothing else of kvguard."""
    assert any(in_the_fence(name) and name != FENCE for name in graph()), "the fence is a folder of modules"
    outward = [f"{name} -> {target} (line {line})" for name, targets in graph().items() if in_the_fence(name)
               for target, line in targets.items() if not in_the_fence(target)]
    assert not outward, "\n".join(outward)


def test_the_fence_check_finds_private_apis(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom torch.utils._pytree import SUPPORTED_NODES\nk = torch._C.DispatchKey\n"
                      "i = t._cdata\nd = getattr(torch, '_disable_dynamo')\nok = torch.utils.swap_tensors\n"
                      "n = pytree.SUPPORTED_NODES.get(tp)\nf = node.flatten_with_keys_fn\ns = getattr(func, '_schema', None)\n"
                      "v = t._values()\nok = t.values()\n")
    assert [line for line, _ in private_torch(module)] == [2, 3, 4, 5, 7, 8, 9, 10]


def test_circles_are_found() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert circles(edges) == [["a", "b", "c"]]


def test_the_top_level_stays_small() -> None:
    """At most 12 modules at the top of the package (issue 35's bar): a new concern is a module
    in a room, or a room, not one more leaf beside `_config`."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
