"""The built-in code-generation task ``doctests``: write a function's body from its signature and its
docstring, checked by the docstring's own examples run in the sandbox (HumanEval's form).

Made offline from local material that the demo corpus never holds: the pure-Python functions of the
installed packages outside the standard library (``site-packages``), so a model trained on the
standard library has not seen them. (A corpus built from those packages, such as the development
corpus of installed packages, has: score it on other tasks.) A function is taken when

- it is defined at the top of its module, without decorators, and its docstring holds ``>>>`` examples;
- it needs nothing but Python's builtins and what it imports itself (no module globals);
- its own body passes its examples in the sandbox, and the body ``pass`` fails them (the examples
  check the body, not just print constants).

Each line: ``{"name": "package/module.py:function", "prompt": signature and docstring, "tests": the
doctest runner, "solution": the original body}`` (the solution is kept for reference, never shown to a
model). ``data/doctests.json`` records the Python, the packages and their versions, and a hash of
every source file taken; ``python -m moelab.eval.doctest_tasks`` regenerates the file from this
machine's packages (other packages, other tasks: the manifest says which were used).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import json
import random
import sys
import sysconfig
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from moelab.eval.generation import Sandbox
from moelab.progress import say

DATA = Path(__file__).parent / "data"
NAME = "doctests"
SEED = 0
N_TASKS = 64
MAX_PROMPT_CHARS = 1200  # a prompt a small model's context holds
# the doctest runner: every example of the module's docstrings, exit 1 when one fails or none ran
RUNNER = (
    "import doctest as _d, sys as _s\n"
    "_r = _d.testmod(optionflags=_d.ELLIPSIS | _d.NORMALIZE_WHITESPACE)\n"
    "_s.exit(1 if _r.failed or not _r.attempted else 0)"
)
_BUILTINS = set(dir(builtins))


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """The names ``fn`` reads that it neither binds nor imports, less the builtins and itself."""
    bound = {fn.name}
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return reads - bound - _BUILTINS


def candidates(text: str) -> list[tuple[str, str, str]]:
    """(function name, prompt, solution) of each function in a module's source that can be a task."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.decorator_list or len(fn.body) < 2:
            continue
        doc = ast.get_docstring(fn)
        first = fn.body[0]
        if not doc or ">>>" not in doc or not isinstance(first, ast.Expr) or _free_names(fn):
            continue
        if fn.col_offset != 0 or lines[fn.lineno - 1].lstrip().startswith("async"):
            continue
        prompt = "\n".join(lines[fn.lineno - 1 : first.end_lineno]) + "\n"
        solution = "\n".join(lines[first.end_lineno : fn.end_lineno]) + "\n"
        if len(prompt) <= MAX_PROMPT_CHARS and solution.strip():
            out.append((fn.name, prompt, solution))
    return out


def _distribution_versions() -> dict[str, str]:
    """Top-level import names of the installed distributions -> "name version"."""
    out = {}
    for dist in metadata.distributions():
        top = (dist.read_text("top_level.txt") or "").split() or [dist.metadata["Name"].replace("-", "_")]
        for name in top:
            out.setdefault(name, f"{dist.metadata['Name']} {dist.version}")
    return out


def generate(out: Path = DATA, site: Path | None = None, seed: int = SEED, n: int = N_TASKS, progress=True) -> dict:
    """Write ``doctests.jsonl`` and its manifest ``doctests.json`` to ``out``; return the manifest."""
    site = Path(site or sysconfig.get_paths()["purelib"])
    box = Sandbox(timeout=10, memory_mb=1024)
    files = sorted(p for p in site.rglob("*.py") if "/tests/" not in str(p) and "/test/" not in str(p))
    say(f"reading {len(files)} Python files under {site} for functions with doctests ...", progress)
    found, seen = [], set()
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if ">>>" not in text:
            continue
        rel = path.relative_to(site).as_posix()
        for name, prompt, solution in candidates(text):
            key = hashlib.sha256((prompt + solution).encode()).hexdigest()
            if key not in seen:
                seen.add(key)
                found.append((rel, name, prompt, solution, hashlib.sha256(text.encode()).hexdigest()[:16]))
    rng = random.Random(seed)
    rng.shuffle(found)
    say(f"{len(found)} candidate functions; checking each in the sandbox (its body passes, `pass` fails) ...", progress)
    rows, used = [], {}
    for i, (rel, name, prompt, solution, digest) in enumerate(found):
        if len(rows) == n:
            break
        if progress and i % 25 == 0:
            say(f"  {i}/{len(found)} checked, {len(rows)} kept", progress)
        if not box.run(prompt + solution + "\n" + RUNNER + "\n").passed:
            continue
        if box.run(prompt + "    pass\n\n" + RUNNER + "\n").passed:
            continue
        rows.append({"name": f"{rel}:{name}", "prompt": prompt, "tests": RUNNER, "solution": solution})
        used[rel] = digest
    rows.sort(key=lambda r: r["name"])
    versions = _distribution_versions()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (out / f"{NAME}.jsonl.tmp").write_text(body, encoding="utf-8")
    (out / f"{NAME}.jsonl.tmp").replace(out / f"{NAME}.jsonl")
    manifest = {
        "generated_by": "python -m moelab.eval.doctest_tasks",
        "seed": seed,
        "python": sys.version.split()[0],
        "tasks": len(rows),
        "candidates": len(found),
        "rule": "top-level functions with doctests needing only builtins; their body passes the examples, `pass` fails",
        "packages": sorted({versions.get(r.split("/")[0].removesuffix(".py"), r.split("/")[0]) for r in used}),
        "files": dict(sorted(used.items())),
    }
    (out / f"{NAME}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    say(f"wrote {len(rows)} tasks to {out / (NAME + '.jsonl')}", progress)
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelab.eval.doctest_tasks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DATA, help="folder for doctests.jsonl and doctests.json")
    ap.add_argument("--site", type=Path, help="the packages' folder (default: this Python's site-packages)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--n", type=int, default=N_TASKS, help="tasks at most")
    args = ap.parse_args(argv)
    if args.site is not None and not args.site.is_dir():
        print(f"--site {args.site}: no such folder", file=sys.stderr)
        return 2
    generate(args.out, args.site, args.seed, args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
