"""Import layering of the kdakit package (issue #11 item 3), on the source alone (CPU, no kernels run).

The graph: one node per module under ``kdakit/``; an edge ``a -> b`` for every ``import b`` /
``from b import ...`` (or ``from pkg import b`` naming the submodule ``b``) in ``a``, at any
nesting level (module top, functions, ``if`` / ``try`` blocks). Importing ``a.b.c`` also runs
the ``__init__`` of ``a`` and ``a.b``; those implicit edges are left out (every module would
otherwise close a loop through the package ``__init__`` that re-exports it).

Checked: no cycle in the whole package (a module never imports, directly or through others,
one that imports it back), and no kdakit import inside a function of the recurrent modules
(the way the old cycle was dodged). The layering of the recurrent part, bottom up::

    recurrent_forward              forward kernel + launcher, per-token Triton functions
    recurrent_backward_kernels     backward kernels + one-pass launcher      -> recurrent_forward
    recurrent_backward_segmented   segmented driver      -> recurrent_forward, recurrent_backward_kernels
    decode_step                    one-token in-place decode step kernel     -> recurrent_forward
    decode                         pool / serving kernel                     -> recurrent_forward, decode_step
    recurrent_backward             recurrent_kda_backward, dispatch  -> the first three
    fused_recurrent                fused_recurrent_kda + autograd    -> all of them
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kdakit"

RECURRENT = (
    "kdakit.ops.kda.recurrent.kernels",
    "kdakit.ops.kda.recurrent.backward_kernels",
    "kdakit.ops.kda.recurrent.segmented",
    "kdakit.ops.kda.recurrent.backward",
    "kdakit.ops.kda.serving.step",
    "kdakit.ops.kda.serving.decode",
    "kdakit.ops.kda.recurrent.api",
)

# Import cycles elsewhere in the package, known and not yet removed: each a frozenset of the
# modules of one strongly connected component, with the reason. A new cycle fails the test, and so
# does an entry here that no longer is one (remove it then).
KNOWN_CYCLES: dict[frozenset, str] = {}

# Function-level kdakit imports outside the recurrent modules, known and left as they are:
# (importing module, imported module). test_function_level_imports_listed fails on one not listed
# (and on a listed one that is gone). They close no cycle: the graph counts them. They defer loading a subcommand, backend or tool until it is used.
KNOWN_FUNCTION_LEVEL: set[tuple[str, str]] = {
    # CLI subcommands and the memory tools, loaded when called
    ("kdakit.cli", "kdakit.demo"),
    ("kdakit.cli", "kdakit.memory.mem_cli"),
    ("kdakit.cli", "kdakit.memory.serving_cli"),
    ("kdakit.memory.mem_cli", "kdakit.memory.allocator"),
    ("kdakit.memory.mem_cli", "kdakit.memory.measure"),
    ("kdakit.memory.mem_cli", "kdakit.memory.model"),
    ("kdakit.memory.mem_cli", "kdakit.memory.plot"),
    ("kdakit.memory.model", "kdakit.ops.kda.reference.chunk"),
    ("kdakit.memory.model", "kdakit.ops.kda.plan"),
    ("kdakit.memory.measure_worker", "kdakit"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve_from(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Collector(ast.NodeVisitor):
    """(imported kdakit module, inside a function?) for every import statement of one module."""

    def __init__(self, mod: str, is_pkg: bool, modules: set[str]):
        self.mod, self.is_pkg, self.modules = mod, is_pkg, modules
        self.depth = 0
        self.found: list[tuple[str, bool, int]] = []

    def _target(self, name: str) -> str | None:
        # the longest known module prefix: "kdakit.ops.kda.serving.decode.kda_decode" -> "kdakit.ops.kda.serving.decode"
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in self.modules:
                return cand
        return None

    def _add(self, name: str, lineno: int) -> None:
        target = self._target(name)
        if target is not None and target != self.mod:
            self.found.append((target, self.depth > 0, lineno))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve_from(self.mod, self.is_pkg, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else base, node.lineno)

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Edges per module, and the function-level imports as (module, imported, line)."""
    modules = discover()
    names = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    nested = []
    for mod, path in modules.items():
        col = _Collector(mod, path.name == "__init__.py", names)
        col.visit(ast.parse(path.read_text(), filename=str(path)))
        for target, in_function, line in col.found:
            graph[mod].add(target)
            if in_function:
                nested.append((mod, target, line))
    return graph, nested


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
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
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


GRAPH, NESTED = import_graph()


def test_graph_sees_the_recurrent_modules():
    for mod in RECURRENT:
        assert mod in GRAPH, mod
    # a sanity check of the collector: the known top-level edges are there
    assert "kdakit.ops.kda.recurrent.kernels" in GRAPH["kdakit.ops.kda.serving.decode"]
    assert "kdakit.ops.kda.recurrent.backward" in GRAPH["kdakit.ops.kda.recurrent.api"]


def test_no_import_cycle():
    found = {c: sorted(c) for c in cycles(GRAPH)}
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles in kdakit: {unexpected}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"KNOWN_CYCLES lists cycles that no longer exist: {stale}"


@pytest.mark.parametrize("mod", RECURRENT)
def test_no_function_level_import_in_recurrent_modules(mod):
    hidden = [(target, line) for m, target, line in NESTED if m == mod]
    assert not hidden, f"{mod} imports kdakit modules inside functions: {hidden}"


def test_recurrent_layering():
    """Each recurrent module imports only the ones below it (the order of the module docstring)."""
    allowed = {
        "kdakit.ops.kda.recurrent.kernels": set(),
        "kdakit.ops.kda.recurrent.backward_kernels": {"kdakit.ops.kda.recurrent.kernels"},
        "kdakit.ops.kda.recurrent.segmented": {"kdakit.ops.kda.recurrent.kernels",
                                                        "kdakit.ops.kda.recurrent.backward_kernels"},
        "kdakit.ops.kda.serving.step": {"kdakit.ops.kda.recurrent.kernels"},
        "kdakit.ops.kda.serving.decode": {"kdakit.ops.kda.recurrent.kernels", "kdakit.ops.kda.serving.step"},
        "kdakit.ops.kda.recurrent.backward": {"kdakit.ops.kda.recurrent.kernels",
                                              "kdakit.ops.kda.recurrent.backward_kernels",
                                              "kdakit.ops.kda.recurrent.segmented"},
        "kdakit.ops.kda.recurrent.api": set(RECURRENT) - {"kdakit.ops.kda.recurrent.api"},
    }
    for mod, ok in allowed.items():
        got = GRAPH[mod] & set(RECURRENT)
        assert got <= ok, f"{mod} imports {sorted(got - ok)}, above it in the layering"


def test_function_level_imports_listed():
    """Function-level kdakit imports elsewhere are listed explicitly, not left silent."""
    got = {(m, t) for m, t, _ in NESTED}
    assert got == KNOWN_FUNCTION_LEVEL, (
        f"unlisted: {sorted(got - KNOWN_FUNCTION_LEVEL)}; stale: {sorted(KNOWN_FUNCTION_LEVEL - got)}")


# The package's floors, bottom up: a module imports only from its own floor or those below it.
FLOORS = (
    ("kdakit.ops",),
    ("kdakit.distributed", "kdakit.nn", "kdakit.memory", "kdakit.testing"),
    ("kdakit.demo", "kdakit.cli", "kdakit.__main__", "kdakit"),
)
# The one edge up the floors: the subprocess the memory tools start calls the public API, as a user's script does.
UPWARD_ALLOWED = {("kdakit.memory.measure_worker", "kdakit")}


def floor_of(mod: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes if p != "kdakit") or mod in prefixes:
            return level
    raise AssertionError(f"{mod} is on no floor of FLOORS")


def test_no_import_runs_up_the_floors():
    up = sorted((mod, target) for mod, targets in GRAPH.items() for target in targets
                if floor_of(target) > floor_of(mod) and (mod, target) not in UPWARD_ALLOWED)
    assert not up, f"imports from a lower floor to a higher one: {up}"
