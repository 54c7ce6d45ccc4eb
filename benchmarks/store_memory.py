"""Peak memory of building a token store from a corpus of about 1 GB that includes one 200 MB document.

The corpus is made here from the standard library's source (the files in turn, concatenated): a
directory of 4 MB text files, plus one file that is a single 200 MB document. The store (the tiny
preset's 2,048-token tokenizer trained on it, every document encoded, no byte limit) is built in a
fresh process; its peak resident memory (the kernel's maxrss of that process) and time per phase are
reported against the target of 2 GB.

Prediction, written before the first full-size run (2026-12-03), after a 50 MB trial of the same
script that peaked at 0.64 GB (the tokenizer's training on its text about 0.3 GB of it): peak RSS
between 0.7 and 1.4 GB (the 200 MB file is held as bytes and as text while it is cut into pieces;
the tokenizer learns from at most 64 MB; everything else streams), build time under 10 minutes on
2 cores.

Writes benchmarks/results/store_memory.json. `--gb` and `--single-mb` change the sizes.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

BUILD = """
import sys, time
from pathlib import Path
from moelab.config import load_config
from moelab.data.store import build_store
t0 = time.time()
cfg = load_config("tiny", [f"data.sources=[{sys.argv[1]}]", "data.max_bytes_per_domain=0"])
store = build_store(cfg.data, cfg.model.vocab_size, cache=Path(sys.argv[2]), progress=True)
print("TOKENS", store.manifest["n_tokens"], "DOCS", sum(s["documents"] for d in store.manifest["stats"].values()
      for s in d.values()), "SECONDS", round(time.time() - t0, 1), flush=True)
"""


def make_corpus(root: Path, total_bytes: int, single_bytes: int) -> None:
    """Text files of 4 MB from the standard library's source, and one file of ``single_bytes``."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))

    def stream():
        while True:
            for f in files:
                try:
                    yield f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue

    src = stream()
    root.mkdir(parents=True)

    def fill(path: Path, size: int) -> None:
        written = 0
        with open(path, "w", encoding="utf-8") as fh:
            while written < size:
                chunk = next(src)
                fh.write(chunk)
                written += len(chunk.encode("utf-8"))

    fill(root / "single-document.txt", single_bytes)
    rest, i = total_bytes - single_bytes, 0
    while rest > 0:
        size = min(4 << 20, rest)
        fill(root / f"part-{i:04d}.txt", size)
        rest, i = rest - size, i + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (default 1)")
    ap.add_argument("--single-mb", type=float, default=200, help="the one large document, MB (default 200)")
    ap.add_argument("--work", default="runs/bench/store_memory", help="where the corpus and store go")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    print(f"writing a {args.gb:g} GB corpus with one {args.single_mb:g} MB document into {work}/corpus", flush=True)
    make_corpus(work / "corpus", int(args.gb * 1e9), int(args.single_mb * 1e6))
    size = sum(p.stat().st_size for p in (work / "corpus").iterdir())
    print(f"  {size / 1e9:.2f} GB in {len(list((work / 'corpus').iterdir()))} files ({time.time() - t0:.0f} s)")
    print("building the store in a fresh process ...", flush=True)
    t1 = time.time()
    proc = subprocess.run([sys.executable, "-c", BUILD, str(work / "corpus"), str(work / "cache")], text=True,
                          stdout=subprocess.PIPE)  # fmt: skip
    seconds = time.time() - t1
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode != 0:
        sys.exit(f"the build failed (exit {proc.returncode}) after {seconds:.0f} s; peak RSS {peak_kb / 1e6:.2f} GB")
    fields = proc.stdout.split()
    out = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} cpu",
        "corpus_bytes": size,
        "single_document_bytes": int(args.single_mb * 1e6),
        "tokens": int(fields[fields.index("TOKENS") + 1]),
        "documents_after_cutting": int(fields[fields.index("DOCS") + 1]),
        "build_seconds": round(seconds, 1),
        "peak_rss_gb": round(peak_kb * 1024 / 1e9, 3),
        "target_gb": 2.0,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_memory.json").write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"peak RSS {out['peak_rss_gb']:.2f} GB (target under 2 GB) building a store of {out['tokens']:,} tokens from "
        f"{size / 1e9:.2f} GB in {seconds:.0f} s"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
