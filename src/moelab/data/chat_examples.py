"""A small conversation set made offline from the standard library, for fine-tuning examples.

Each public function of some standard-library modules with a docstring gives two conversations:
"What does module.name do?" answered by the first paragraph of its docstring, and "What is the
signature of module.name?" answered by its name and signature. The set depends only on the Python
that makes it; ``write(path)`` writes it as JSON lines of ``{"messages": [...]}`` (the chat form),
shuffled by ``seed``. ``python -m moelab.data.chat_examples OUT`` does the same.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import random
import sys
from pathlib import Path

MODULES = (
    "textwrap", "string", "json", "os.path", "shutil", "itertools", "functools", "collections", "math",
    "statistics", "random", "re", "fnmatch", "glob", "heapq", "bisect", "base64", "binascii", "difflib",
    "html", "ipaddress", "keyword", "operator", "pathlib", "pprint", "secrets", "shlex", "tempfile",
    "time", "urllib.parse", "uuid", "zlib", "calendar", "copy", "csv", "datetime", "decimal", "fractions",
)  # fmt: skip
MAX_ANSWER = 240  # characters of a docstring's first paragraph


def conversations() -> list[dict]:
    """Two conversations per documented public function of MODULES, in a fixed order."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            fn = getattr(mod, attr)
            if attr.startswith("_") or not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
                continue
            doc = inspect.getdoc(fn) or ""
            first = " ".join(doc.split("\n\n")[0].split())
            if not first or len(first) > MAX_ANSWER:
                continue
            qual = f"{name}.{attr}"
            out.append(_pair(f"What does {qual} do?", first))
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            out.append(_pair(f"What is the signature of {qual}?", f"{attr}{sig}"))
    return out


def _pair(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write(path: str | Path, seed: int = 0) -> int:
    """Write the set, shuffled by ``seed``, to ``path`` (whole or not at all); the number of conversations."""
    rows = conversations()
    random.Random(seed).shuffle(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelab.data.chat_examples", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON-lines file to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = write(args.out, args.seed)
    print(f"wrote {n} conversations to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
