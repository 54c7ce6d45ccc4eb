"""The health checks' ALERT thresholds, from clean runs on corpora that nothing is scored on; and what
those thresholds then say about clean runs on corpora they never saw.

A LADDER_DIR holds the rungs of the demo's ladder recipe (`ladders/demo.yaml`; directories d24, d32,
d40, d48, as `benchmarks/forecast_backtest.py` or `moelab ladder run` leave them) and any other runs of
the same recipe (the target, other seeds, a WSD schedule). Each run is checked as the training loop
would check it: the rungs on their own, every other run against the rungs (gradient norm and drops)
and against the forecast the rungs make for it (the default law).

- `--calibrate LADDER_DIR...`: every check's highest score over those clean runs and over the tiny
  model's clean calibration seeds (`fault_detection_calibration.json`), with every threshold at the
  one in the check's code; the scale each check then gets (twice that highest score, never below 1)
  goes to benchmarks/results/health_calibration.json, and from there by hand into
  moelab.monitor.health.SCALES.
- `--score LADDER_DIR...` (the default): the same clean runs with the scales in place: every ALERT,
  which should be none. Written to benchmarks/results/health_unseen.json.

The development corpora (npm's JavaScript, Debian's Python packages) are those the forecast recipe
was developed on; the ladders for them are `moelab ladder run ladders/demo.yaml --set
"data.sources=[/usr/lib/node_modules]"` and the like. About 15 s per run (the forecast's fit).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RUNGS = ("d24", "d32", "d40", "d48")


def runs_of(ladder: Path) -> tuple[list[Path], list[Path]]:
    rungs = [ladder / r for r in RUNGS]
    missing = [str(r) for r in rungs if not (r / "summary.json").is_file()]
    if missing:
        sys.exit(f"{ladder}: rungs {', '.join(missing)} have not finished training; train the ladder first")
    others = sorted(
        d for d in ladder.iterdir() if d.is_dir() and d.name not in RUNGS and (d / "summary.json").is_file()
    )
    return rungs, others


def check_ladder(ladder: Path, scales) -> list[dict]:
    from moelab.ladder.forecast import forecast
    from moelab.monitor.health import check_run, ladder_trajectories
    from moelab.runs import load_run_config

    rungs, others = runs_of(ladder)
    lad = ladder_trajectories(rungs)
    out = []
    for run in [*rungs, *others]:
        fc = None
        if run not in rungs:
            cfg = load_run_config(run)
            fc = forecast([str(r) for r in rungs], cfg, n_boot=100, target_name=run.name, log=lambda _t: None)
        mon, _ = check_run(run, fc, ladder=None if run in rungs else lad, scales=scales)
        found = [{"step": f.step, "check": f.check, "evidence": f.evidence} for f in mon.findings if f.level == "ALERT"]
        out.append({"run": str(run), "scores": mon.scores, "alerts": found})
        print(f"  {run}: {len(found)} ALERTs {sorted({a['check'] for a in found})}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ladders", nargs="+", type=Path, metavar="LADDER_DIR")
    ap.add_argument("--calibrate", action="store_true", help="choose the scales (else: score with them)")
    args = ap.parse_args()
    from moelab.monitor.health import SCALES

    rows = []
    for ladder in args.ladders:
        print(f"== {ladder}", flush=True)
        rows += check_ladder(ladder, {} if args.calibrate else None)
    head = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} cpu",
        "ladders": list(map(str, args.ladders)),
    }
    if not args.calibrate:
        out = {**head, "scales": SCALES, "runs": rows, "alerts": sum(len(r["alerts"]) for r in rows)}
        (RESULTS / "health_unseen.json").write_text(json.dumps(out, indent=1))
        print(f"{out['alerts']} ALERTs over {len(rows)} clean runs -> {RESULTS / 'health_unseen.json'}")
        return
    tiny = json.loads((RESULTS / "fault_detection_calibration.json").read_text())["clean"]
    highest: dict[str, float] = {}
    for r in [*rows, *tiny]:
        for check, s in r["scores"].items():
            highest[check] = max(highest.get(check, 0.0), s)
    scales = {c: round(max(1.0, 2 * s), 2) for c, s in sorted(highest.items()) if 2 * s > 1}
    out = {**head, "tiny_seeds": [r["seed"] for r in tiny], "runs": rows, "highest": dict(sorted(highest.items())),
           "scales": scales}  # fmt: skip
    (RESULTS / "health_calibration.json").write_text(json.dumps(out, indent=1))
    print("highest clean score per check:", ", ".join(f"{c} {s:.2f}" for c, s in sorted(highest.items())))
    print(f"SCALES = {scales!r}")


if __name__ == "__main__":
    main()
