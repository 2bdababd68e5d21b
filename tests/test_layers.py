"""The package's layers (issue 20): its import graph, drawn from the source.

* no cycle: every import of ``fleet`` inside ``fleet/`` counts, at module level or
  in a function;
* no import inside a function, except one commented as lazy on purpose;
* folders by layer (issue 36, :data:`LAYERS`): every import runs down them, and the
  root holds only the errors, ``_compat`` and the public modules;
* configuration (``DistributedStrategy``) imports nothing of fleet but its errors;
* ``io`` takes no underscore-prefixed name from the core's modules;
* no file over 350 lines but one that says why in its docstring (none over 450),
  no function over 60.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fleet

ROOT = Path(fleet.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The module of ``fleet`` a dotted name lives in (``fleet.comm._sync.current``:
    ``fleet.comm._sync``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path) -> list[tuple[str, list[str], ast.AST, bool]]:
    """``(module, names, node, in_function)`` for each import of fleet in a file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("fleet"):
                found.append((child.module, [a.name for a in child.names], child, inside))
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("fleet"):
                        found.append((a.name, [], child, inside))
            visit(child, inside)

    visit(tree, False)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for module, names, _, _ in imports(path):
            targets = [resolve(f"{module}.{n}") for n in names] or [resolve(module)]
            edges[name] |= {t for t in targets if t and t != name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that ends where it starts, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_inside_a_function_but_the_commented_lazy_ones():
    """Of fleet, of another library or of Python's own: every import at the top."""
    found = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    comment = " ".join(lines[max(0, inner.lineno - 4):inner.lineno])
                    if "on purpose" not in comment:
                        found.append(f"{name}:{inner.lineno}: {ast.unparse(inner)}")
    assert found == []


#: The package's layers, lowest first (docs/architecture.md): a module imports
#: only from its own layer and those before it. A layer is a folder (its
#: ``__init__`` included) or one of the root's modules.
LAYERS = (
    "fleet._errors",     # the errors every layer raises
    "fleet._compat",     # the one door to what jax, flax and optax keep private
    "fleet.strategy",    # the configuration: DistributedStrategy and Paddle's fields
    "fleet.static",      # InputSpec (Paddle's paddle.static)
    "fleet.runtime",     # environment, cluster, XLA flags, worker, agreement, world, leaves
    "fleet.comm",        # gradient synchronisation: buckets, reducer, collectives
    "fleet.sections",    # the strategy sections' implementations
    "fleet.wrappers",    # DataParallel, DistributedOptimizer
    "fleet.semantics",   # what a step means across replicas: outputs, metrics, randomness
    "fleet.step",        # fleet.distributed_step: decorator, program, guards, verify
    "fleet.io",          # samplers, loaders, placement of host batches
    "fleet.checkpoint",  # fleet.save / load, CheckpointManager
    "fleet.launch",      # fleetrun, fleet.spawn
    "fleet.optimizer",   # Paddle's optimizer classes
    "fleet.hapi",        # fleet.Model
    "fleet",             # the public face: imports them all
)


def layer_of(module: str) -> int:
    return max(i for i, name in enumerate(LAYERS)
               if module == name or module.startswith(name + "."))


def test_every_import_runs_down_the_layers():
    """No module imports from a layer above its own: the configuration imports only
    the errors, the runtime nothing of synchronisation, the core nothing of
    ``io``, ``checkpoint``, ``launch`` or ``hapi``."""
    edges = graph()
    up = sorted(f"{m} -> {t}" for m in MODULES for t in edges[m] if layer_of(t) > layer_of(m))
    assert up == []


def test_the_root_holds_only_the_errors_the_door_and_the_public_modules():
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert root == ["__init__.py", "_compat.py", "_errors.py", "optimizer.py", "static.py"]


def test_every_module_has_a_layer():
    assert all(any(m == n or m.startswith(n + ".") for n in LAYERS) for m in MODULES)


CONFIGURATION = ("fleet.strategy", "fleet.strategy._strategy", "fleet.strategy._configs",
                 "fleet.strategy._paddle_fields")


def test_configuration_imports_only_the_errors():
    """``DistributedStrategy`` (``fleet/strategy/``): the sections' implementations
    (``fleet/sections/``) build on the core, the configuration does not."""
    edges = graph()
    found = {m: sorted(t for t in edges[m] if t not in CONFIGURATION and t != "fleet._errors")
             for m in CONFIGURATION}
    assert {m: t for m, t in found.items() if t} == {}


def test_io_takes_no_private_name_of_the_core():
    """``io`` uses the core's public helpers (``to_global``, ``world``), no ``_`` name."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("fleet.io"):
            continue
        for module, names, node, _ in imports(path):
            if not module.startswith(("fleet.io", "fleet._errors")):
                found += [f"{name}:{node.lineno}: {module}.{n}" for n in names
                          if n.startswith("_")]
    assert found == []


def test_no_file_over_350_lines_unless_it_says_why_and_no_function_over_60():
    """One idea per file (issue 36, item 6): no file of fleet/ over 350 lines but
    one whose docstring says why ("Over 350 lines on purpose: ..."), none over
    450, and no function over 60 lines."""
    long_files = {}
    long_functions = []
    for name, path in MODULES.items():
        text = path.read_text()
        n = len(text.splitlines())
        why = "Over 350 lines on purpose" in (ast.get_docstring(ast.parse(text)) or "")
        if n > 450 or (n > 350 and not why):
            long_files[name] = n
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > 60:
                    long_functions.append(f"{name}.{node.name}: {n} lines")
    assert long_files == {} and long_functions == []
