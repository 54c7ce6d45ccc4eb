"""How well does the ladder forecast a run it never saw? Two corpora, every law, calibrated bands.

The demo's ladder (ladders/demo.yaml: four rungs, widths 24-48, and a width-104 target with 12.8x
the largest rung's training FLOPs) is trained on two real corpora that every machine like ours has:
the standard library (`stdlib`) and the compiler's C and C++ headers (`cheaders`). The recipe and
the laws were fixed before either was run (benchmarks/results/forecast_prediction.md). Then:

1. backtests: each law fitted on the four rungs only predicts the target's whole held-out curve:
   error at every 5%, mean and largest past 20% of the run, final error, and the band's coverage;
2. a schedule the rungs never ran: the target's width trained with WSD (stable, then a linear decay
   over the last 20%) is forecast from the linear-decay rungs;
3. the evaluation's own noise: the target's last checkpoint on 8 disjoint sets of held-out windows,
   alone and paired with the largest rung's (the part that does not cancel between runs);
4. calibration: 200 synthetic ladders per corpus, drawn from the default law fitted to the corpus's
   five real runs, with the offsets and noise measured from them (the point noise never below the
   paired eval noise), each forecast as a real ladder is; the nominal 90% band's coverage.

Writes benchmarks/results/forecast.json and the plots docs/forecast_{stdlib,cheaders,calibration}.svg.
Trained runs go to runs/bench/forecast/ and are reused when complete. On 2 cores: about 9 minutes per
corpus and 5 for the WSD run when fresh, the backtests about 5 minutes, the calibration about 13; about
40 minutes in all from nothing, 18 with the runs trained.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
CORPORA = ("stdlib", "cheaders")


def configs(ladder_path: Path, corpus: str) -> list:
    from moelab.config import load_config
    from moelab.ladder.plan import load_ladder, rung_config

    lad = load_ladder(ladder_path)
    return [load_config(rung_config(lad, i), [f"data.sources=[{corpus}]"]) for i in range(len(lad.all_widths()))]


def train_all(runs: list[tuple[str, object]], root: Path) -> None:
    from moelab.train.loop import train

    for name, cfg in runs:
        out = root / name
        if (out / "summary.json").exists():
            print(f"  {name}: trained already ({out})", flush=True)
            continue
        t0 = time.time()
        print(f"  training {name} ({cfg.train.steps} steps) into {out}", flush=True)
        train(cfg, out, resume=True, progress=True)
        print(f"  {name}: {time.time() - t0:.0f} s", flush=True)


def _calibrate(args) -> dict:
    from moelab.ladder.forecast import calibration

    truth, rungs, target, noise, n, seed, label = args
    t0 = time.time()

    def progress(i: int) -> None:
        if (i + 1) % 10 == 0:
            print(f"  {label}: {i + 1} of {n} ladders, {time.time() - t0:.0f} s", flush=True)

    return calibration(truth, rungs, target, noise, n_ladders=n, n_boot=50, seed=seed, progress=progress)


def figure(corpus: str, rungs, target, fc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rungs:
        ax.plot(r.steps / r.total_steps, r.loss, color="0.7", lw=1)
    ax.plot([], [], color="0.7", lw=1, label="rungs (d24-d48)")
    c = fc["curve"]
    x = np.array(c["steps"]) / target.total_steps
    ax.fill_between(x, c["low"], c["high"], color="C0", alpha=0.25, label=f"band ({fc['band']['level']:.0%})")
    ax.plot(x, c["loss"], color="C0", ls="--", label=f"forecast ({fc['law']})")
    ax.plot(target.steps / target.total_steps, target.loss, color="C3", marker=".", label="target d104, actual")
    ax.set_xlabel("fraction of the run")
    ax.set_ylabel("held-out loss, dropless, macro (nats / token)")
    ax.set_title(f"{corpus}: the target's curve forecast from four rungs (12.8x compute)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def calibration_figure(cal: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (corpus, c) in enumerate(cal.items()):
        fr = [float(f) for f in c["coverage_by_fraction"]]
        axes[0].plot(fr, list(c["coverage_by_fraction"].values()), marker=".", color=f"C{i}",
                     label=f"{corpus}: {c['coverage']:.1%} of all points")  # fmt: skip
        axes[1].hist(c["coverage_per_ladder"], bins=np.linspace(0, 1, 11), alpha=0.5, color=f"C{i}", label=corpus)
    axes[0].axhspan(0.85, 0.95, color="0.85", label="85-95%")
    axes[0].axhline(0.9, color="k", lw=0.8)
    axes[0].set_ylim(0.5, 1.0)
    axes[0].set_xlabel("fraction of the target's run")
    axes[0].set_ylabel("coverage of the nominal 90% band")
    axes[0].set_title(f"{next(iter(cal.values()))['ladders']} synthetic ladders per corpus")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("share of a ladder's target points inside its band")
    axes[1].set_ylabel("ladders")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "ladders" / "demo.yaml"))
    ap.add_argument("--out", default="runs/bench/forecast")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--ladders", type=int, default=200, help="synthetic ladders per corpus in the calibration")
    args = ap.parse_args()

    from moelab.config import load_config
    from moelab.ladder import DEFAULT_LAW, LAW_CHOICES
    from moelab.ladder import law as L
    from moelab.ladder.forecast import backtest, corrected_noise, estimate_noise, fitted, rung_run
    from moelab.train.evaluate import eval_noise

    t_start = time.time()
    root = Path(args.out)
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "ladder": str(Path(args.ladder).relative_to(ROOT)), "default_law": DEFAULT_LAW, "corpora": {}}  # fmt: skip
    runs_of = {}
    for corpus in args.corpora:
        print(f"== {corpus}: the ladder", flush=True)
        cfgs = configs(Path(args.ladder), corpus)
        jobs = [(c.name.split("-")[-1], c) for c in cfgs]
        if corpus == "stdlib":  # the target's width on a schedule the rungs never ran
            jobs.append(("d104-wsd", load_config(cfgs[-1], ["train.schedule=wsd", "train.decay_frac=0.2"])))
        train_all(jobs, root / corpus)
        runs_of[corpus] = {name: rung_run(root / corpus / name) for name, _ in jobs}

    cal_jobs = {}
    for corpus in args.corpora:
        runs = runs_of[corpus]
        rungs, target = [runs[k] for k in ("d24", "d32", "d40", "d48")], runs["d104"]
        print(f"== {corpus}: backtests", flush=True)
        res = {"laws": {}}
        for law in LAW_CHOICES:
            bt = backtest(rungs, target, law, n_boot=200)
            fc = bt.pop("forecast")
            res["laws"][law] = bt
            print(
                f"  {law:<13} past 20%: mean |error| {bt['mean_abs_error_past_20']:.2%}, largest "
                f"{bt['max_abs_error_past_20']:.2%}; final {bt['final_error']:+.2%}; band coverage {bt['coverage']:.0%}"
                f"; final band {bt['final_band'][0]:.3f}-{bt['final_band'][1]:.3f}",
                flush=True,
            )
            if law == DEFAULT_LAW:
                figure(corpus, rungs, target, fc, DOCS / f"forecast_{corpus}.svg")
                res["final_band_half_width"] = (
                    (bt["final_band"][1] - bt["final_band"][0]) / 2 / bt["curve"][-1]["predicted"]
                )
        if "d104-wsd" in runs:
            print(f"== {corpus}: WSD target from linear-decay rungs", flush=True)
            res["wsd"] = {}
            for law in LAW_CHOICES:
                bt = backtest(rungs, runs["d104-wsd"], law, n_boot=100)
                bt.pop("forecast")
                res["wsd"][law] = bt
                print(f"  {law:<13} past 20%: mean |error| {bt['mean_abs_error_past_20']:.2%}, largest "
                      f"{bt['max_abs_error_past_20']:.2%}; final {bt['final_error']:+.2%}", flush=True)  # fmt: skip
        print(f"== {corpus}: the evaluation's own noise", flush=True)
        res["eval_noise"] = eval_noise(root / corpus / "d104", against=root / corpus / "d48", progress=False)
        print(f"  one evaluation: {res['eval_noise']['relative_sd']:.3%} alone, "
              f"{res['eval_noise']['paired_relative_sd']:.3%} relative to the d48 rung", flush=True)  # fmt: skip
        # the calibration's truth: the default law through all five real runs, with their measured noise
        five = fitted([*rungs, target])
        truth = L.fit_law(five, DEFAULT_LAW)
        measured = estimate_noise(truth, five)
        noise = corrected_noise(truth, five, measured, np.random.default_rng(7))
        noise["point"] = max(noise["point"], res["eval_noise"]["paired_relative_sd"])
        res["calibration_truth"] = {
            "fit": truth.to_dict(),
            "noise": {k: noise[k] for k in ("rung", "point", "rho", "dof")},
        }
        half = args.ladders // 2
        cal_jobs[corpus] = [
            (truth, rungs, target, noise, half, 0, f"{corpus} (worker 1)"),
            (truth, rungs, target, noise, args.ladders - half, 1, f"{corpus} (worker 2)"),
        ]
        out["corpora"][corpus] = res

    print(f"== calibration: {args.ladders} synthetic ladders per corpus, 2 processes", flush=True)
    cal = {}
    # spawned, not forked: this process has run JAX, whose threads a fork would copy mid-flight
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for corpus, jobs in cal_jobs.items():
            t0 = time.time()
            parts = list(pool.map(_calibrate, jobs))
            per_ladder = [x for p in parts for x in p["coverage_per_ladder"]]
            by_fraction = {f: float(np.average([p["coverage_by_fraction"][f] for p in parts], weights=[p["ladders"] for p in parts]))
                           for f in parts[0]["coverage_by_fraction"]}  # fmt: skip
            cal[corpus] = {
                "ladders": len(per_ladder),
                "coverage": float(np.mean(per_ladder)),
                "coverage_by_fraction": by_fraction,
                "coverage_per_ladder": per_ladder,
                "final_half_width": float(np.mean([p["final_half_width"] for p in parts])),
                "mean_abs_error_past_20": float(np.mean([p["mean_abs_error_past_20"] for p in parts])),
                "noise": parts[0]["noise"],
            }
            out["corpora"][corpus]["calibration"] = cal[corpus]
            print(f"  {corpus}: coverage {cal[corpus]['coverage']:.1%} of the nominal 90% ({len(per_ladder)} ladders, "
                  f"{time.time() - t0:.0f} s); median final half-width {cal[corpus]['final_half_width']:.2%}", flush=True)  # fmt: skip
    calibration_figure(cal, DOCS / "forecast_calibration.svg")
    out["seconds"] = time.time() - t_start
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "forecast.json").write_text(json.dumps(out, indent=1))
    print_tables(out)


def print_tables(out: dict) -> None:
    """The README's tables."""
    for corpus, res in out["corpora"].items():
        print(f"\n{corpus}: fit on d24-d48, predict d104 (12.8x the compute of d48)\n")
        print("| law | 10% | 25% | 50% | 75% | 100% | mean past 20% | largest past 20% | final | band coverage |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for law, bt in res["laws"].items():
            at = {round(r["fraction"], 2): r["error"] for r in bt["curve"]}
            cells = " | ".join(f"{at[f]:+.2%}" if f in at else "" for f in (0.1, 0.25, 0.5, 0.75, 1.0))
            print(f"| {law} | {cells} | {bt['mean_abs_error_past_20']:.2%} | {bt['max_abs_error_past_20']:.2%} | "
                  f"{bt['final_error']:+.2%} | {bt['coverage']:.0%} |")  # fmt: skip
        if "calibration" in res:
            c = res["calibration"]
            print(f"\ncalibration: {c['coverage']:.1%} ({c['ladders']} ladders); final band half-width of the real "
                  f"forecast {res['final_band_half_width']:.2%}; eval noise {res['eval_noise']['relative_sd']:.2%} "
                  f"alone, {res['eval_noise']['paired_relative_sd']:.2%} paired")  # fmt: skip
        if "wsd" in res:
            print("\nWSD target from linear-decay rungs:")
            for law, bt in res["wsd"].items():
                print(
                    f"| {law} | {bt['mean_abs_error_past_20']:.2%} | {bt['max_abs_error_past_20']:.2%} | {bt['final_error']:+.2%} |"
                )


if __name__ == "__main__":
    main()
