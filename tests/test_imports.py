"""The import structure of the installed package (docs/architecture.md, "Import structure").

The graph is read from the source with `ast`, never by importing: an edge A -> B for every
`import portable.B` / `from portable.B import x` / relative import in module A, at module level
or inside a function (both run; only `if TYPE_CHECKING:` blocks are left out, since they never
do). `from portable.pkg import name` is an edge to `portable.pkg.name` when that is a module, to
`portable.pkg` otherwise.

- No import cycles: every strongly connected component is one module.
- The IR core does not depend on persistence: `portable.ir.program` imports nothing from
  `portable.archive`, `portable.ir.serialize` or `portable.ir.content_hash` (they plug in
  through `register_persistence`).
- Function-level imports of portable modules stay within FUNCTION_IMPORT_BUDGET, so imports
  that only dodge a cycle cannot grow back.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import portable

PACKAGE = Path(portable.__file__).resolve().parent

# Function-level imports of portable modules (statements): what is left are lazy imports that
# keep an import light or defer a registration, not cycle dodges: the CLI's per-command imports,
# backends that import their optional toolchains' glue (xla/neuron/onnx), the pytest plugin
# (which must not import portable for test runs that do not use it), cuda's `ops` (registering
# CUDA kernels of the portable ops only where a .pt2 is loaded or an AOTInductor package built),
# the distributed worker, and the xla / neuron backends' dispatch of a pipelined step to their
# JAX-heavy pipeline modules (and the neuron stand-in's JAX glue). Lower it when you remove
# some; never raise it to dodge a cycle.
FUNCTION_IMPORT_BUDGET = 57

# The IR core and what it must not import (persistence plugs into it).
IR_PROGRAM = "portable.ir.program"
PERSISTENCE = ("portable.archive", "portable.ir.serialize", "portable.ir.content_hash")


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported portable module
    line: int
    in_function: bool
    type_only: bool  # under `if TYPE_CHECKING:`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _existing(name: str) -> str:
    """The longest prefix of `name` that is a module of the package."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")[: None if is_package else -1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _walk(module: str, path: Path) -> Iterator[Import]:
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                seen = set()
                for target in _targets(module, is_package, child):
                    target = _existing(target)
                    if target.split(".")[0] == "portable" and target not in seen:
                        seen.add(target)
                        yield Import(module, target, child.lineno, in_function, type_only)
                continue
            func = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from visit(child, in_function or func, type_only or _is_type_checking(child))

    yield from visit(ast.parse(path.read_text(), str(path)), False, False)


IMPORTS: list[Import] = [i for m, p in MODULES.items() for i in _walk(m, p)]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if not i.type_only and i.target != i.source:
            graph[i.source].add(i.target)
    return graph


def _components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(frozenset(component))
    return found


def test_the_graph_is_read_from_the_installed_package():
    assert "portable.ir.program" in MODULES and "portable.backends.cuda.lowering" in MODULES
    edges = _graph()
    assert "portable.ir.signature" in edges["portable.ir.program"]
    assert "portable.backends.cuda.dispatch" in edges["portable.backends.cuda.lowering"]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(map(sorted, _components(graph))) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_import_cycles_between_modules():
    cycles = sorted(sorted(c) for c in _components(_graph()) if len(c) > 1)
    assert not cycles, f"import cycles (make the dependency go one way): {cycles}"


def test_the_ir_program_does_not_import_persistence():
    """Program.save / content_hash reach the archive through `register_persistence`."""
    reached = [i for i in IMPORTS if i.source == IR_PROGRAM and i.target.startswith(PERSISTENCE)]
    assert not reached, reached


def test_persistence_is_registered_by_importing_portable(tmp_path):
    from portable.archive import save
    from portable.ir.content_hash import program_hash
    from portable.ir.program import _registered

    hook = _registered()
    assert hook.save is save and hook.content_hash is program_hash


def test_function_level_imports_stay_within_the_budget():
    lazy = [i for i in IMPORTS if i.in_function]
    statements = {(i.source, i.line) for i in lazy}
    where = sorted({f"{s}:{line}" for s, line in statements})
    assert len(statements) <= FUNCTION_IMPORT_BUDGET, (
        f"{len(statements)} function-level imports of portable modules (budget "
        f"{FUNCTION_IMPORT_BUDGET}): import at module level and fix the dependency direction "
        f"instead. Where: {where}"
    )


def test_a_second_persistence_is_refused():
    from portable.errors import RegistryError
    from portable.ir.program import Persistence, _registered, register_persistence

    hook = _registered()
    register_persistence(Persistence(hook.save, hook.content_hash))  # the same again: a no-op
    try:
        register_persistence(Persistence(hook.save, lambda program: "0" * 64))
    except RegistryError as exc:
        assert "registered twice" in str(exc)
    else:
        raise AssertionError("a second persistence was accepted")
    assert _registered() == hook
