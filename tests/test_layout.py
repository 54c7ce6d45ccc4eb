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


def packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """moelab's packages (moelab.X) -> the other packages their modules import."""
    top = lambda name: ".".join(name.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        out.setdefault(top(name), set()).update(top(d) for d in deps if top(d) != top(name))
    return out


def test_no_import_cycles_between_packages():
    """A package whose modules sit in two layers (eval's tasks below train, a bridge above it) is a
    loop among the packages even when the modules make none: eval -> export -> train -> eval."""
    graph = packages(import_graph())
    assert "moelab.eval" in graph["moelab.train"]
    assert cycles(graph) == []
    assert cycles(packages({"m.p.a": {"m.q.b"}, "m.q.b": {"m.p.c"}, "m.p.c": set()})) == [["m.p", "m.q"]]


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


# The layers, lowest first (docs/architecture.md): a module imports moelab modules of its own layer or
# below, never above. A name is placed by its longest listed prefix.
LAYERS = [
    ("moelab", "moelab.errors", "moelab.jsonl", "moelab.progress", "moelab.devices", "moelab._alloc",
     "moelab.presets", "moelab.paths", "moelab.cache", "moelab.extras"),
    ("moelab.schedule",),
    ("moelab.config",),
    ("moelab.accounting", "moelab.parallel", "moelab.runs"),
    ("moelab.model",),
    ("moelab.data",),
    ("moelab.monitor", "moelab.eval"),
    ("moelab.ladder",),
    ("moelab.train",),
    ("moelab.plan", "moelab.export", "moelab.lab", "moelab.report"),
    ("moelab.cli", "moelab.docgen", "moelab.bench", "moelab.__main__"),
]  # fmt: skip

# where a moelab module may be imported inside a function: the command line's modules, so that
# `moelab --help` and a one-line refusal load no JAX (0.2 s, against 1.3 s with it)
LOCAL_IMPORTS_ALLOWED = ("moelab.cli",)


def layer_of(name: str, layers=LAYERS) -> int:
    best, rank = -1, None
    for i, names in enumerate(layers):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{name}: in no layer of tests/test_layout.py's LAYERS"
    return rank


def upward(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """(module, what it imports from a higher layer)."""
    return sorted(
        (name, dep) for name, deps in graph.items() for dep in deps if layer_of(dep, layers) > layer_of(name, layers)
    )


def local_imports(src: Path = SRC) -> list[tuple[str, int, str]]:
    """(module, line, moelab module) of every moelab import inside a function."""
    out = []
    for path in sorted((src / "moelab").rglob("*.py")):
        if "remote_code" in path.parts:
            continue
        name = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = ["moelab.(relative)"] if node.level else [node.module or ""]
                else:
                    continue
                out += [(name, node.lineno, m) for m in mods if m == "moelab" or m.startswith("moelab.")]
    return out


def test_layers_only_point_down():
    graph = {k: v for k, v in import_graph().items() if "remote_code" not in k}
    assert {layer_of(name) for name in graph} == set(range(len(LAYERS)))  # every layer holds a module
    assert upward(graph) == []


def test_no_moelab_module_is_imported_inside_a_function():
    found = [(m, line, dep) for m, line, dep in local_imports() if not m.startswith(LOCAL_IMPORTS_ALLOWED)]
    assert found == []


def test_the_layer_check_finds_an_upward_import():
    layers = [("a",), ("b",), ("c",)]
    assert upward({"a": set(), "b": {"a"}, "c": {"b", "a"}}, layers) == []
    assert upward({"a": {"c.x"}, "b": {"a"}, "c.x": set()}, layers) == [("a", "c.x")]
    assert layer_of("a.x", [("a",), ("a.x",)]) == 1  # the longest listed prefix places a name
    assert layer_of("moelab.export.harness") > layer_of("moelab.train") > layer_of("moelab.eval.tasks")


def sizes(src: Path = SRC) -> tuple[list[tuple[str, int]], list[tuple[str, str, int]]]:
    """(modules of 600 lines or more), (functions over 80 lines whose first body lines state no reason:
    a comment ``# long (N lines): why`` right after the def or its docstring)."""
    big, long = [], []
    for path in sorted((src / "moelab").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) >= 600:
            big.append((str(path.relative_to(src)), len(lines)))
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 80:
                first = fn.body[0]
                top = lines[first.lineno - 2 : first.end_lineno + 2]  # around the docstring (or the first line)
                if not any(line.strip().startswith("# long (") for line in top):
                    long.append((str(path.relative_to(src)), fn.name, fn.end_lineno - fn.lineno + 1))
    return big, long


def test_modules_under_600_lines_and_long_functions_say_why():
    big, long = sizes()
    assert big == [] and long == []


def test_the_command_lines_parser_loads_no_jax():
    """The one place moelab imports inside functions (LOCAL_IMPORTS_ALLOWED) keeps `moelab --help` and
    a refusal free of JAX, and `--devices` possible (it must be set before JAX loads)."""
    import subprocess
    import sys

    code = "import sys; from moelab.cli import build_parser; build_parser(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
