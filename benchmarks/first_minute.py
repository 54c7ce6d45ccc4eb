"""The first minute of `moelab train tiny --steps 20`: time to the first training step, phase by phase,
cold (an empty cache: no token store, no compiled programs) and warm (the same command again).

Each run is a fresh process with stderr a pipe (as on CI or in a log file); every line it prints is
stamped with the time it arrived, and the phases are the gaps between the lines that open them:
import (to the first line), data (indexing), tokenizer, tokenizing (and writing the store), state
(the model and optimiser state), peak (the matmul peak for MFU, measured once a week), initial
eval, compile (to the line of step 1). Targets: first step within
30 s cold and 10 s warm on 2 cores. Writes benchmarks/results/first_minute.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
# the line that opens each phase (the phase runs until the next one)
OPENERS = [
    ("data", "moelab: indexing the documents"),
    ("tokenizer", "moelab: training a"),
    ("tokenizing", "tokenizing:"),
    ("state", "moelab: building the model"),
    ("peak", "moelab: this machine's"),
    ("initial eval", "moelab: evaluating the initial model"),
    ("compile", "moelab: compiling the train step"),
    ("first step", "train: step "),
]


def one(cache: Path, out: Path) -> dict:
    env = {**os.environ, "MOELAB_CACHE": str(cache), "MOELAB_PROGRESS_EVERY": "1000"}
    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--steps", "20", "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stderr:
        lines.append((time.monotonic() - t0, line.rstrip()))
    proc.wait()
    total = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"the run failed (exit {proc.returncode}): {lines[-1][1] if lines else ''}")
    marks = []
    for name, opener in OPENERS:
        hit = next((t for t, text in lines if text.startswith(opener)), None)
        if hit is not None:
            marks.append((name, hit))
    phases = {"import": round(lines[0][0], 2)}
    for (name, t), nxt in zip(marks, marks[1:] + [("end", None)], strict=True):
        if name != "first step":
            phases[name] = round((nxt[1] if nxt[1] is not None else total) - t, 2)
    first = next(t for name, t in marks if name == "first step")
    return {"first_step_s": round(first, 2), "total_s": round(total, 2), "phases": phases,
            "lines": [f"{t:6.2f}s  {text}" for t, text in lines]}  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    work = Path(tempfile.mkdtemp(prefix="moelab-first-minute-"))
    try:
        cache = work / "cache"
        print("cold: an empty cache ...", flush=True)
        cold = one(cache, work / "cold")
        print("warm: the same command again ...", flush=True)
        warm = one(cache, work / "warm")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"date": date.today().isoformat(), "machine": f"{platform.machine()} cpu, {os.cpu_count()} cores",
           "command": "moelab train tiny --steps 20", "targets_s": {"cold": 30, "warm": 10},
           "cold": cold, "warm": warm}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "first_minute.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, r, target in (("cold", cold, 30), ("warm", warm, 10)):
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
        print(f"{name}: first step at {r['first_step_s']:.1f} s (target {target} s): {parts}")


if __name__ == "__main__":
    main()
