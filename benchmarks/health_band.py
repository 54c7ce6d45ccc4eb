"""Does the forecast band catch a fault that moves the target's loss by 5%, and stay quiet on clean runs?

Issue 24, item 5. The check is the health monitor's forecast_track (moelab/monitor/health.py): the
forecast re-centred on the run's own level (the median of its log-ratios to the forecast over the 30%
of the run before), with an ALERT past 5 times the rms of the same statistic on the rungs the forecast
leaves out one size at a time. The registered band itself (forecast_band) is reported beside it.

1. Clean runs: the real forecasts of benchmarks/forecast_backtest.py's coverage (each size of the
   demo ladder left out and forecast from the others, both its seeds scored, and the target's three
   seeds forecast from every rung), on each development corpus: every check of the monitor, with the
   production thresholds, over each run's own records.
2. Planted faults: the target (d104, seed 0) trained again with token_noise@S:0.2 (a fifth of every
   batch's tokens made random from step S on) at 30% and at 60% of its run. The same seed and config
   make it the clean run's twin up to S (checked: equal evaluations), so the fault's size is the pair's
   ratio at each evaluation after S. Caught means a forecast_track ALERT within 10% of the run after S.

Uses the runs forecast_backtest.py trained (runs/bench/ladder/CORPUS); the faulted twins go beside them
(d104-token_noise-30, ...) and are reused when complete. Writes benchmarks/results/health_band.json
and docs/health_band.svg. The prediction was committed before the faulted runs trained and before the
clean runs were scored: benchmarks/results/health_band_prediction.md. On 2 cores: about 7 minutes per
faulted run, 5 minutes of forecasts per corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from forecast_backtest import CORPORA, DOCS, RESULTS, ROOT, jobs  # noqa: E402

AGG = "mix"  # the forecasts are of the held-out loss weighted by the training mixture
FAULT = "token_noise"
NOISE = 0.2  # the fraction of tokens made random
STARTS = (0.3, 0.6)  # where in the target's run the fault starts
WITHIN = 0.1  # caught within this fraction of the run after the fault starts


def evals(run_dir: Path, agg: str = AGG) -> dict[int, float]:
    from moelab.runs import read_jsonl

    return {r["step"]: r["loss_dropless"][agg] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"}


def judge(run_dir: Path, fc: dict) -> dict:
    """Every check's level over the run's records against ``fc``, with the production thresholds."""
    from moelab.monitor.health import check_run

    mon, checks = check_run(run_dir, forecast=fc)
    alerts = {c: v["first_alert"] for c, v in checks.items() if v["first_alert"] is not None}
    return {
        "alerts": alerts,
        "track_score": mon.scores.get("forecast_track"),  # the largest, 1 = at the ALERT threshold
        "band_score": mon.scores.get("forecast_band"),
        "track_level": checks.get("forecast_track", {}).get("level"),
    }


def clean_cases(rungs, targets, n_boot: int, log) -> list[dict]:
    """The coverage benchmark's real forecasts, each held-out run judged against its forecast."""
    from moelab.ladder import DEFAULT_LAW
    from moelab.ladder.forecast import forecast_joint
    from moelab.ladder.law import LawError

    out = []
    cases = [(f"leave out n={n:.4g}", [r for r in rungs if r.n != n], [r for r in rungs if r.n == n])
             for n in sorted({r.n for r in rungs})]  # fmt: skip
    cases.append(("the target", rungs, targets))
    for label, fit_on, held in cases:
        t0 = time.time()
        try:
            fc = {**forecast_joint(fit_on, held[0].blind(), DEFAULT_LAW, n_boot=n_boot), "metric": AGG}
        except LawError as exc:
            log(f"  {label}: no forecast ({exc})")
            continue
        for r in held:
            j = judge(Path(r.dir), fc)
            out.append({"case": label, "run": Path(r.dir).name, "n": r.n, "track_rms": fc["track"]["rms"], **j})
            log(f"  {label}, {Path(r.dir).name}: forecast_track max score {j['track_score'] or 0:.2f} "
                f"(ALERT at 1; width {5 * fc['track']['rms']:.2%}), alerts {j['alerts'] or 'none'} "
                f"({time.time() - t0:.0f} s)")  # fmt: skip
    return out


def faulted_twin(clean_dir: Path, start: float, fc: dict, log) -> Path:
    from moelab.config import load_config
    from moelab.runs import load_run_config
    from moelab.train.loop import train

    cfg = load_run_config(clean_dir)
    at = round(start * cfg.train.steps)
    out = clean_dir.parent / f"{clean_dir.name}-{FAULT}-{round(100 * start)}"
    if (out / "summary.json").exists():
        log(f"  {out.name}: trained already")
        return out
    if out.exists():
        shutil.rmtree(out)  # a twin cut short: trained again whole (it is compared step for step)
    out.mkdir(parents=True)
    (out / "forecast.json").write_text(json.dumps(fc))  # monitored live against the target's forecast
    t0 = time.time()
    log(f"  training {out.name}: {FAULT}@{at}:{NOISE} ({cfg.train.steps} steps) into {out}")
    train(load_config(cfg, [f"train.inject=[{FAULT}@{at}:{NOISE}]", "train.forecast_update_every=0"]), out,
          progress=False)  # fmt: skip
    log(f"  {out.name}: {time.time() - t0:.0f} s")
    return out


def fault_case(clean_dir: Path, twin: Path, start: float, fc: dict) -> dict:
    from moelab.runs import load_run_config

    total = load_run_config(clean_dir).train.steps
    at = round(start * total)
    a, b = evals(clean_dir), evals(twin)
    same = all(a[s] == b[s] for s in a if s <= at)
    size = {f"{s / total:.2f}": b[s] / a[s] - 1 for s in sorted(a) if s > at}
    j = judge(twin, fc)
    caught = j["alerts"].get("forecast_track")
    within = [s for s in sorted(a) if at < s <= at + WITHIN * total + 1e-9]
    return {
        "run": twin.name, "start": start, "at_step": at, "steps": total, "twin_equal_before": same,
        "size": size, "size_within": max(b[s] / a[s] - 1 for s in within),
        "size_final": b[max(a)] / a[max(a)] - 1, "caught_at": caught,
        "caught_after_fraction": None if caught is None else (caught - at) / total,
        "caught_within": caught is not None and at < caught <= at + WITHIN * total + 1e-9,
        "band_alert": j["alerts"].get("forecast_band"), "alerts": j["alerts"], "track_score": j["track_score"],
    }  # fmt: skip


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["corpora"]), figsize=(5.5 * len(res["corpora"]), 3.8), squeeze=False)
    for ax, (corpus, r) in zip(axes[0], res["corpora"].items(), strict=True):
        clean = [c["track_score"] or 0.0 for c in r["clean"]]
        ax.scatter(range(len(clean)), clean, s=14, color="tab:blue", label=f"clean runs ({len(clean)})")
        x0 = len(clean) + 1
        for k, f in enumerate(r["faults"]):
            ax.scatter([x0 + k], [f["track_score"] or 0.0], s=30, marker="s", color="tab:red",
                       label="token_noise 0.2 (largest score)" if k == 0 else None)  # fmt: skip
            ax.annotate(f"{int(100 * f['start'])}%: {f['size_within']:+.1%}", (x0 + k, f["track_score"] or 0.0),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.axhline(0.5, color="0.6", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"{corpus}: forecast_track score (ALERT > 1, WATCH > 0.5)", fontsize=9)
        ax.set_xlabel("run")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "ladders" / "demo.yaml"))
    ap.add_argument("--out", default="runs/bench/ladder")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--n-boot", type=int, default=100)
    args = ap.parse_args()

    from moelab.ladder import DEFAULT_LAW
    from moelab.ladder.forecast import forecast_joint, rung_run

    def log(msg: str) -> None:
        print(msg, flush=True)

    t_start = time.time()
    res = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "fault": {"kind": FAULT, "noise": NOISE, "starts": list(STARTS), "within": WITHIN}, "corpora": {}}  # fmt: skip
    path = RESULTS / "health_band.json"
    for corpus in args.corpora:
        root = Path(args.out) / corpus
        runs = jobs(Path(args.ladder), corpus, 3)
        missing = [n for n, _, _ in runs if not (root / n / "summary.json").exists()]
        if missing:
            sys.exit(f"{root}: runs {', '.join(missing)} are missing: run benchmarks/forecast_backtest.py first")
        rungs = [rung_run(root / n) for n, _, role in runs if role == "rung"]
        targets = [rung_run(root / n) for n, _, role in runs if role == "target"]
        log(f"== {corpus}: the target's forecast from {len(rungs)} rung runs")
        # what the forecast is of (the health checks read the record's loss of this name; macro without it)
        fc = {**forecast_joint(rungs, targets[0].blind(), DEFAULT_LAW, n_boot=args.n_boot), "metric": AGG}
        log(f"  forecast_track width {5 * fc['track']['rms']:.2%} (5 x rms {fc['track']['rms']:.2%} over "
            f"{fc['track']['points']} points of the rungs left out)")  # fmt: skip
        log(f"== {corpus}: planted faults ({FAULT} {NOISE} at {', '.join(f'{s:.0%}' for s in STARTS)})")
        faults = []
        for start in STARTS:
            twin = faulted_twin(Path(targets[0].dir), start, fc, log)
            f = fault_case(Path(targets[0].dir), twin, start, fc)
            faults.append(f)
            log(f"  {twin.name}: the fault moved the loss {f['size_within']:+.2%} within {WITHIN:.0%} of the run "
                f"({f['size_final']:+.2%} at the end); forecast_track ALERT at step {f['caught_at']} "
                f"({'caught' if f['caught_within'] else 'NOT caught'} within {WITHIN:.0%}); the band: "
                f"{f['band_alert']}; twin equal before: {f['twin_equal_before']}")  # fmt: skip
        log(f"== {corpus}: clean runs against the real forecasts")
        clean = clean_cases(rungs, targets, args.n_boot, log)
        res["corpora"][corpus] = {"track": fc["track"], "faults": faults, "clean": clean}
        path.write_text(json.dumps(res, indent=1))
    every_clean = [c for r in res["corpora"].values() for c in r["clean"]]
    every_fault = [f for r in res["corpora"].values() for f in r["faults"]]
    res["summary"] = {
        "clean_runs": len(every_clean),
        "clean_track_alerts": sum("forecast_track" in c["alerts"] for c in every_clean),
        "clean_any_alerts": sum(bool(c["alerts"]) for c in every_clean),
        "clean_largest_track_score": max((c["track_score"] or 0.0) for c in every_clean) if every_clean else None,
        "faults": len(every_fault),
        "faults_caught_within": sum(f["caught_within"] for f in every_fault),
        "faults_band_alert_within": sum(
            f["band_alert"] is not None and f["at_step"] < f["band_alert"] <= f["at_step"] + WITHIN * f["steps"] + 1e-9
            for f in every_fault
        ),
    }
    res["seconds"] = time.time() - t_start
    path.write_text(json.dumps(res, indent=1))
    figure(res, DOCS / "health_band.svg")
    s = res["summary"]
    print(f"\nclean runs: {s['clean_runs']}, forecast_track ALERTs {s['clean_track_alerts']}, any ALERT "
          f"{s['clean_any_alerts']}, largest score {s['clean_largest_track_score']:.2f}")  # fmt: skip
    print(f"planted faults: {s['faults']}, caught within {WITHIN:.0%} of the run {s['faults_caught_within']}, "
          f"by the registered band {s['faults_band_alert_within']}")  # fmt: skip
    print(f"{path} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
