"""Do the health checks catch injected faults, and stay quiet on clean runs they were not tuned on?

The tiny model, 200 steps of 8 x 128 tokens, faults injected at step 100 (lr_high from the start).
Each fault changes one thing (moelab.monitor.faults). Two sets of clean runs, apart:

- `--calibrate`: clean seeds 100-104 on the standard library. Each check's statistic, relative to
  its own threshold (every scale at 1), is recorded at its highest over each run. LOGIT_GROWTH and
  EVAL_GAP in moelab.monitor.health were chosen from these, and these runs are part of the
  calibration of its SCALES (benchmarks/health_calibration.py), both before any scoring run.
- scoring (the default): clean seeds 0-9 on the standard library (the false-positive rate), clean
  seeds 0-2 on `cheaders`, a corpus no threshold was chosen on, and one run per fault (seed 0): for
  each, caught or not, steps from the injection to the first ALERT, and every check that raised
  one, with its first step (the monitor over the run's records, as in the training loop, with the
  calibrated SCALES).

Writes benchmarks/results/fault_detection.json (or fault_detection_calibration.json); `--table`
prints the README's table from that JSON. About 18 minutes for the scoring runs, 4 for calibration.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
FAULTS = [
    "lr_spike@{s}:10",
    "lr_high@0:3",
    "data_corruption@{s}",
    "data_stuck@{s}",
    "router_collapse@{s}",
    "router_drift@{s}",
    "zloss_off@{s}",
]
CALIBRATION_SEEDS = range(100, 105)
CLEAN_SEEDS = range(10)
UNSEEN_SEEDS = range(3)


def fired(found: list[dict], after: int = 0) -> dict:
    """check -> the step of its first ALERT at or after ``after``."""
    out = {}
    for a in found:
        if a["step"] >= after and a["check"] not in out:
            out[a["check"]] = a["step"]
    return out


def one(base: list[str], run: Path, extra: list[str], scales=None) -> tuple[list[dict], dict, float]:
    """Train, then the run's ALERTs and each check's highest score (the health monitor offline, under
    ``scales``: None for moelab.monitor.health.SCALES, {} for every check's own rule)."""
    from moelab.config import load_config
    from moelab.monitor.health import check_run
    from moelab.train.loop import train

    t0 = time.time()
    train(load_config("tiny", [*base, *extra]), run, progress=False)
    mon, _ = check_run(run, scales=scales)
    found = [{"step": f.step, "check": f.check} for f in mon.findings if f.level == "ALERT"]
    return found, mon.scores, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/fault_detection")
    ap.add_argument("--calibrate", action="store_true", help="the clean calibration runs (seeds 100-104)")
    ap.add_argument("--table", action="store_true", help="print the README's table from the results JSON")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.table:
        print(table(json.loads((RESULTS / "fault_detection.json").read_text())))
        return
    base = [
        "train.batch_size=8",
        "train.log_every=2",
        "train.eval_every=0",
        "train.checkpoint_every=1000",
        "data.max_bytes_per_domain=2000000",
        f"train.steps={args.steps}",
        *args.overrides,
    ]
    root = Path(args.out) / ("calibration" if args.calibrate else "scoring")
    shutil.rmtree(root, ignore_errors=True)
    at = args.steps // 2
    out = {"date": date.today().isoformat(), "machine": f"{platform.machine()} cpu", "steps": args.steps,
           "injected_at": at, "clean": [], "unseen": [], "faults": []}  # fmt: skip
    if args.calibrate:
        for seed in CALIBRATION_SEEDS:
            found, scores, secs = one(base, root / f"clean-{seed}", [f"train.seed={seed}"], scales={})
            out["clean"].append({"seed": seed, "alerts": len(found), "scores": scores, "seconds": secs})
            worst = max(scores.items(), key=lambda kv: kv[1])
            print(
                f"calibration seed {seed}: {len(found)} ALERTs; highest score {worst[1]:.2f} ({worst[0]})", flush=True
            )
        checks = sorted({c for r in out["clean"] for c in r["scores"]})
        out["highest"] = {c: max(r["scores"].get(c, 0.0) for r in out["clean"]) for c in checks}
        print("\nhighest score per check over the calibration runs (1 = its ALERT threshold):")
        for c, v in out["highest"].items():
            print(f"  {c:<22} {v:.3f}")
        (RESULTS / "fault_detection_calibration.json").write_text(json.dumps(out, indent=1) + "\n")
        return
    for seed in CLEAN_SEEDS:
        found, scores, secs = one(base, root / f"clean-{seed}", [f"train.seed={seed}"])
        out["clean"].append(
            {"seed": seed, "alerts": len(found), "fired": fired(found), "scores": scores, "seconds": secs}
        )
        print(f"clean seed {seed}: {len(found)} ALERTs {sorted(fired(found))}", flush=True)
    for seed in UNSEEN_SEEDS:
        extra = [f"train.seed={seed}", "data.sources=[cheaders]"]
        found, scores, secs = one(base, root / f"cheaders-{seed}", extra)
        out["unseen"].append({"seed": seed, "corpus": "cheaders", "alerts": len(found), "fired": fired(found),
                              "scores": scores, "seconds": secs})  # fmt: skip
        print(f"clean seed {seed} on cheaders: {len(found)} ALERTs {sorted(fired(found))}", flush=True)
    for spec in FAULTS:
        fault = spec.format(s=at)
        start = int(fault.split("@")[1].split(":")[0])
        found, scores, secs = one(base, root / fault.split("@")[0], ["train.seed=0", f"train.inject=[{fault}]"])
        after = fired(found, start)
        first = min(after.values()) if after else None
        out["faults"].append({"fault": fault, "injected_at": start, "caught": bool(after),
                              "delay_steps": None if first is None else first - start, "fired": after,
                              "scores": scores, "seconds": secs})  # fmt: skip
        print(
            f"{fault}: " + (f"caught after {first - start} steps by {sorted(after)}" if after else "NOT caught"),
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_detection.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n" + table(out))


# faults a check sees by construction: the fault changes the very number the check reads, so the catch
# says the check is wired, not that it would see the problem the fault stands for
BY_CONSTRUCTION = {
    "lr_spike": "yes: it multiplies the applied rate, which lr_schedule compares with the plan",
    "data_corruption": "partly: random tokens in the training batch raise the training loss loss_decreasing reads",
    "token_noise": "partly: as data_corruption, for a share of the tokens",
}


def table(res: dict) -> str:
    """The README's table and its false-positive line, from the results JSON (production thresholds)."""
    n = res["steps"]
    lines = ["| fault (seed 0) | caught | first ALERT after the fault | every check that raised an ALERT (first step) "
             "| caught by construction |",
             "|---|---|---|---|---|"]  # fmt: skip
    for f in res["faults"]:
        delay = "-" if f["delay_steps"] is None else f"{f['delay_steps']} steps ({f['delay_steps'] / n:.1%} of the run)"
        checks = ", ".join(f"{c} ({s})" for c, s in sorted(f["fired"].items(), key=lambda kv: kv[1])) or "none"
        kind = f["fault"].split("@")[0]
        lines.append(f"| `{f['fault']}` | {'yes' if f['caught'] else 'no'} | {delay} | {checks} "
                     f"| {BY_CONSTRUCTION.get(kind, 'no')} |")  # fmt: skip
    noisy = [r for r in res["clean"] if r["alerts"]]
    unseen = [r for r in res["unseen"] if r["alerts"]]

    def which(rows: list[dict]) -> str:
        named = ["seed " + str(r["seed"]) + ": " + ", ".join(r["fired"]) for r in rows]
        return f" ({'; '.join(named)})" if named else ""

    lines.append("")
    lines.append(
        f"Clean runs: {len(noisy)} of {len(res['clean'])} standard-library seeds raised an ALERT{which(noisy)}; "
        f"{len(unseen)} of {len(res['unseen'])} seeds on cheaders, a corpus no threshold was chosen on{which(unseen)}."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
