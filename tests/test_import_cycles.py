"""No import cycles inside the product (gateway/, worker/, shared/) nor through the tools that
import it (bench/, scripts/, deploy/), type-checking imports included: a cycle hides who owns
what (a module that needs its caller back should be handed a collaborator instead), and it is
easy to bring back one import at a time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "worker", "shared", "bench", "scripts", "deploy")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in it: top level, functions,
    `if TYPE_CHECKING:` blocks). `from pkg import name` counts as importing `pkg.name` when that
    is a module, else `pkg`."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        graph[name].add(target)
                    elif base in mods:
                        graph[name].add(base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        graph[name].add(alias.name)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_detector_finds_a_cycle_through_a_type_checking_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and graph["gateway.hub"], "the scan found the project's modules"
    assert graph["bench.engine"] and "scripts.stack" in graph and "deploy.healthcheck" in graph, \
        "the scan found the tools' modules"
    found = cycles(graph)
    assert not found, "import cycles (pass the collaborator instead of importing its owner):\n" + \
        "\n".join(" <-> ".join(c) for c in found)
