"""The cold start of `moelab train tiny --steps 2`, side by side with an earlier revision: time to the
first step, phase by phase (wall and CPU, MOELAB_TIMING=1), for two kinds of cold process, alternating
the two source trees round by round on the same machine:

- ``empty cache``: no token store, no compiled programs, no remembered initial evaluation (a first run);
- ``new config``: the token store kept, nothing compiled yet (a model or run setting changed).

The earlier revision (``--baseline``, default the commit before issue 42's cold-start cuts) is checked
out as a git worktree in a temporary folder and run by the same interpreter with its own ``src`` first
on PYTHONPATH. Target (issue 42): the first step within 20 s, cold. Writes
benchmarks/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from first_minute import process_phases, stamped  # noqa: E402 - the same stamping and phase marks

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
BASELINE = "fba8225"  # main before the step's compile beside the initial evaluation and the state beside the store (--baseline to compare another)
STEPS = "2"


def cold_run(src: Path, cache: Path, out: Path) -> dict:
    """One `moelab train tiny --steps 2` with moelab from ``src``: seconds to the first step's line, the
    process's phases (wall and CPU) and its losses (the two trees must agree)."""
    env = {**os.environ, "MOELAB_CACHE": str(cache), "MOELAB_PROGRESS_EVERY": "1000", "MOELAB_TIMING": "1",
           "PYTHONPATH": str(src)}  # fmt: skip
    lines, total, cpu = stamped(["train", "tiny", "--steps", STEPS, "--out", str(out)], env)
    first = next(t for t, text in lines if text.startswith("moelab: timing: steps at"))
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["kind"] == "train"]  # fmt: skip
    return {"first_step_s": round(first, 2), "total_s": round(total, 2), "cpu_s": round(cpu, 2),
            **process_phases(lines, total, cpu), "losses": losses}  # fmt: skip


def median_of(runs: list[dict]) -> dict:
    keys = runs[0]["wall"]
    return {
        "first_step_s": round(statistics.median(r["first_step_s"] for r in runs), 2),
        "first_step_each": [r["first_step_s"] for r in runs],
        "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
        "phases_wall": {k: round(statistics.median(r["wall"][k] for r in runs), 2) for k in keys},
        "phases_cpu": {k: round(statistics.median(r["cpu"][k] for r in runs), 2) for k in keys},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help=f"the earlier revision (default {BASELINE})")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tree and kind, alternating")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moelab-cold-start-"))
    base = work / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.baseline], check=True)
    trees = {"baseline": base / "src", "now": ROOT / "src"}
    runs = {kind: {t: [] for t in trees} for kind in ("empty cache", "new config")}
    load = os.getloadavg()[0]
    try:
        for i in range(args.rounds):
            for name, src in trees.items():
                cache = work / f"cache-{name}-{i}"
                print(f"round {i + 1}/{args.rounds}: {name}, empty cache ...", flush=True)
                runs["empty cache"][name].append(cold_run(src, cache, work / f"run-{name}-{i}-a"))
                # the same store, nothing compiled or remembered: a changed config's first process
                for kept in cache.iterdir():
                    if not kept.name.startswith("store-") and kept.name != "peaks.json":
                        shutil.rmtree(kept) if kept.is_dir() else kept.unlink()
                print(f"round {i + 1}/{args.rounds}: {name}, new config (store kept) ...", flush=True)
                runs["new config"][name].append(cold_run(src, cache, work / f"run-{name}-{i}-b"))
                for kind in runs:
                    print(f"  {kind}: first step at {runs[kind][name][-1]['first_step_s']:.1f} s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    same = all(r["losses"] == runs[k]["baseline"][0]["losses"] for k in runs for t in trees for r in runs[k][t])
    out = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} cpu, {os.cpu_count()} cores",
        "command": f"moelab train tiny --steps {STEPS} (MOELAB_TIMING=1), cold",
        "baseline": args.baseline,
        "rounds": args.rounds,
        "load_average_before": round(load, 2),
        "target_first_step_s": 20,
        "same_losses": same,
        "results": {kind: {t: median_of(rs) for t, rs in by.items()} for kind, by in runs.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cold_start.json").write_text(json.dumps(out, indent=1) + "\n")
    for kind, by in out["results"].items():
        b, n = by["baseline"]["first_step_s"], by["now"]["first_step_s"]
        print(f"{kind}: first step at {n:.1f} s now against {b:.1f} s at {args.baseline} (median of {args.rounds}; "
              f"target 20 s); the same losses: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
