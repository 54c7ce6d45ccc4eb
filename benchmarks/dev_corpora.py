"""The development corpora of issue 37: what the forecast's prior is fitted on, all from this machine.

Each is a ``data.sources`` value (the two builtins, or a mapping of domain names to globs); a corpus
whose files are missing here is reported and skipped by the benchmarks, never silently replaced.
Other corpora are kept aside for checks the lab does not see.
"""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])  # the interpreter's installed packages, outside the stdlib

CORPORA: dict[str, object] = {
    "stdlib": "stdlib",
    "cheaders": "cheaders",
    "sitepkgs": {"sitepkgs-code": [f"{SITE}/**/*.py"]},
    "manpages": {
        "man-user": ["/usr/share/man/man1/*.gz"],
        "man-lib": ["/usr/share/man/man2/*.gz", "/usr/share/man/man3/*.gz"],
        "man-admin": [f"/usr/share/man/man{k}/*.gz" for k in range(4, 9)],
    },
    "vim": {"vim-script": ["/usr/share/vim/**/*.vim"], "vim-doc": ["/usr/share/vim/**/doc/*.txt"]},
    "nodejs": {"node-code": ["/usr/lib/node_modules/**/*.js"], "node-docs": ["/usr/lib/node_modules/**/*.md"]},
}


def sources_override(corpus: str) -> str:
    """The ``--set`` item that makes a config read ``corpus``."""
    value = CORPORA[corpus]
    if isinstance(value, str):
        return f"data.sources=[{value}]"
    inner = ", ".join(f"{k}: [{', '.join(v)}]" for k, v in value.items())
    return "data.sources={" + inner + "}"


def available(corpus: str) -> str | None:
    """None when ``corpus`` can be read here, else why not (one line)."""
    value = CORPORA[corpus]
    if isinstance(value, str):
        return None
    for domain, pats in value.items():
        if not any(glob.glob(p, recursive=True) for p in pats):
            return f"{corpus}: no files for domain {domain} ({', '.join(pats)})"
    return None
