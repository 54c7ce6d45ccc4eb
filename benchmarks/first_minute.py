"""The first minute of `moelab train tiny --steps 20`: time to the first training step, phase by phase,
cold (an empty cache: no token store, no compiled programs) and warm (the same command again); and the
second command, a warm `moelab train tiny --steps 2`, phase by phase from its start to its exit.

Each run is a fresh process with stderr a pipe (as on CI or in a log file); every line it prints is
stamped with the time it arrived, and the phases are the gaps between the lines that open them
(the 2-step command's also in CPU seconds, which the other load of a shared machine changes less).
To the first step: import (to the first line), data (indexing), tokenizer, tokenizing (and writing
the store), state (the model and optimiser state), peak (the matmul peak for MFU, measured once a
week), initial eval, compile (to the line of step 1). Targets: first step within 30 s cold and 10 s
warm on 2 cores. The whole second command runs with MOELAB_TIMING=1, whose lines open its phases
(moelab/progress.py): start-up (the interpreter and imports), fit check (the memory plan), store
check, state, launch (the run's records), peak, initial eval, compile (the train step, from the XLA
cache, and step 1), steps, eval (the evaluations between), final eval, checkpoint, summary, and exit
(from the command's end to the process's). Target: within 10 s. Writes
benchmarks/results/first_minute.json; with --record LABEL also that section of --record-file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
# the line that opens each phase to the first step (the phase runs until the next one)
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
# the phases of the whole warm 2-step process, in order; every one is reported (0.0 when it did not open)
PHASES = ["start-up", "fit check", "store check", "state", "launch", "peak", "initial eval", "compile", "steps",
          "eval", "final eval", "checkpoint", "summary", "exit"]  # fmt: skip
MARK = "moelab: timing: "  # MOELAB_TIMING=1's line opening a phase: "moelab: timing: NAME at T s"


def stamped(args: list[str], env: dict) -> tuple[list[tuple[float, str]], float, float]:
    """Run ``python -m moelab ARGS``: its stderr lines stamped with seconds since its start, the
    seconds to its exit, and the CPU seconds it took (user and system, its children too)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "moelab", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    lines = [(time.monotonic() - t0, line.rstrip()) for line in proc.stderr]
    proc.wait()
    total = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"the run failed (exit {proc.returncode}): {lines[-1][1] if lines else ''}")
    return lines, total, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def first_step_phases(lines: list[tuple[float, str]], total: float) -> dict:
    """The phases to the first step, from the lines that open them (those that did not print, left out)."""
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
    return {"first_step_s": round(first, 2), "total_s": round(total, 2), "phases": phases}


def process_phases(lines: list[tuple[float, str]], total: float, cpu_total: float | None = None) -> dict:
    """Seconds of each phase of a MOELAB_TIMING=1 process, in PHASES' order, from its stamped stderr
    lines and the seconds to its exit: ``wall`` (start-up to the first mark, each mark to the next, a
    name opened again adding up, exit from its mark to the process's end) and ``cpu`` (from the CPU
    seconds each mark carries; exit's from ``cpu_total``, the process's whole, when given).
    ValueError without the marks."""
    marks = []
    for t, text in lines:
        if text.startswith(MARK):
            name, _, rest = text[len(MARK) :].rpartition(" at ")
            if name not in PHASES:
                raise ValueError(f"unknown phase {name!r} in {text!r}")
            marks.append((name, t, float(rest.rsplit("cpu ", 1)[1].split()[0])))
    if not marks or marks[-1][0] != "exit":
        raise ValueError("no MOELAB_TIMING=1 marks ending in 'exit': was the process run with MOELAB_TIMING=1?")
    wall, cpu = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
    wall["start-up"], cpu["start-up"] = marks[0][1], marks[0][2]
    ends = [*marks[1:], ("end", total, cpu_total if cpu_total is not None else marks[-1][2])]
    for (name, t, c), (_, t_end, c_end) in zip(marks, ends, strict=True):
        wall[name] += t_end - t
        cpu[name] += c_end - c
    return {"wall": {k: round(v, 2) for k, v in wall.items()}, "cpu": {k: round(v, 2) for k, v in cpu.items()}}


def first_minute(cache: Path, out: Path) -> dict:
    env = {**os.environ, "MOELAB_CACHE": str(cache), "MOELAB_PROGRESS_EVERY": "1000"}
    env.pop("MOELAB_TIMING", None)
    lines, total, _ = stamped(["train", "tiny", "--steps", "20", "--out", str(out)], env)
    return {**first_step_phases(lines, total), "lines": [f"{t:6.2f}s  {text}" for t, text in lines]}


def second_command(cache: Path, out: Path) -> dict:
    """One warm `moelab train tiny --steps 2` into a fresh ``out``, phase by phase."""
    env = {**os.environ, "MOELAB_CACHE": str(cache), "MOELAB_PROGRESS_EVERY": "1000", "MOELAB_TIMING": "1"}
    lines, total, cpu = stamped(["train", "tiny", "--steps", "2", "--out", str(out)], env)
    return {"total_s": round(total, 2), "cpu_s": round(cpu, 2), **process_phases(lines, total, cpu)}


def summarize(runs: list[dict]) -> dict:
    """Median and range over the runs: the total, the CPU seconds and each phase."""

    def spread(xs):
        return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}

    return {
        "runs": len(runs),
        "total_s": spread([r["total_s"] for r in runs]),
        "cpu_s": spread([r["cpu_s"] for r in runs]),
        "phases_median_s": {k: round(statistics.median(r["wall"][k] for r in runs), 2) for k in PHASES},
        "phases_cpu_median_s": {k: round(statistics.median(r["cpu"][k] for r in runs), 2) for k in PHASES},
        "each": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed second commands (after one that warms the cache)")
    ap.add_argument("--second-only", action="store_true", help="only the warm 2-step command (not the first minute)")
    ap.add_argument("--cache", type=Path, help="an existing MOELAB_CACHE to use (default: a fresh one, built cold)")
    ap.add_argument("--record", metavar="LABEL", help="also write the 2-step figures as LABEL in --record-file")
    ap.add_argument("--record-file", type=Path, default=RESULTS / "first_minute_29.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moelab-first-minute-"))
    load = os.getloadavg()[0]
    try:
        cache = args.cache or work / "cache"
        cold = warm = None
        if not args.second_only:
            print("cold: an empty cache ...", flush=True)
            cold = first_minute(cache, work / "cold")
            print("warm: the same command again ...", flush=True)
            warm = first_minute(cache, work / "warm")
        print("the second command: warm moelab train tiny --steps 2 (one to warm the cache first) ...", flush=True)
        second_command(cache, work / "two-0")
        runs = []
        for i in range(args.repeat):
            runs.append(second_command(cache, work / f"two-{i + 1}"))
            print(f"  {runs[-1]['total_s']:.1f} s ({runs[-1]['cpu_s']:.1f} CPU s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    second = {"load_average_before": round(load, 2), **summarize(runs)}
    machine = f"{platform.machine()} cpu, {os.cpu_count()} cores"
    if not args.second_only:
        out = {"date": date.today().isoformat(), "machine": machine,
               "command": "moelab train tiny --steps 20; then moelab train tiny --steps 2",
               "targets_s": {"cold": 30, "warm": 10, "second_command": 10},
               "cold": cold, "warm": warm, "second_command": second}  # fmt: skip
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "first_minute.json").write_text(json.dumps(out, indent=1) + "\n")
        for name, r, target in (("cold", cold, 30), ("warm", warm, 10)):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
            print(f"{name}: first step at {r['first_step_s']:.1f} s (target {target} s): {parts}")
    if args.record:
        rec = json.loads(args.record_file.read_text()) if args.record_file.exists() else {}
        # the newest batch's date and machine on top (each batch keeps its own): the results pages read them
        rec.update(date=date.today().isoformat(), machine=machine, command="moelab train tiny --steps 2 (warm)")
        rec[args.record] = {"date": date.today().isoformat(), "machine": machine, **second}
        args.record_file.write_text(json.dumps(rec, indent=1) + "\n")
    t = second["total_s"]
    c = second["cpu_s"]
    parts = ", ".join(
        f"{k} {v:.1f} ({second['phases_cpu_median_s'][k]:.1f})" for k, v in second["phases_median_s"].items()
    )
    print(f"second command: {t['median']:.1f} s to exit (median of {len(runs)}; {t['min']:.1f}-{t['max']:.1f}; "
          f"target 10 s; {c['median']:.1f} CPU s; load average {load:.1f} before); each phase, wall (CPU): {parts}")  # fmt: skip


if __name__ == "__main__":
    main()
