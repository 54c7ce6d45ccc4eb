"""The package's layout: no import cycle between its modules, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the moelab modules it imports (at the top or inside a function)."""
    modules = {}
    for path in sorted((src / "moelab").rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules)
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}  # its own packages
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and "moelab.cli" in graph and "moelab.train.loop" in graph["moelab.cli.train"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_model_and_parallel_know_nothing_of_training_or_the_lab():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith(("moelab.model", "moelab.parallel")):
            bad = [d for d in deps if d.startswith(("moelab.train", "moelab.lab", "moelab.ladder", "moelab.monitor"))]
            assert not bad, (name, bad)
        if name.startswith("moelab.parallel"):
            assert not [d for d in deps if d.startswith("moelab.model")], name
