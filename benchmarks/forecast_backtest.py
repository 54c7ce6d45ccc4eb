"""How well does the ladder forecast runs it never saw, and does its band mean what it says?

Issue 24. The demo's ladder (ladders/demo.yaml: widths 24-48, two seeds each, and a width-104 target
with 12.8x the largest rung's training FLOPs) is trained on each corpus named, the target with three
seeds. The forecast is of the held-out loss weighted by the training mixture (`mix`, dropless).
Then, per corpus:

1. backtests: each law, fitted on the eight rung runs only, forecasts the target's whole curve; the
   error against the target's seed 0 and against the mean of its seeds, at every 5% (mean and largest
   past 20% of the run, the final), the band's width and whether it holds the curve. Marin's method as
   Marin runs it (per fraction, E held at 1.5) and per fraction with E fitted, side by side;
2. real forecasts for the band's coverage: each size left out in turn and forecast from the others
   (both of its seeds are targets), and the target's seeds forecast from the rungs; each forecast's
   final point inside its 90% band or not, and every point past 20%.

Writes benchmarks/results/forecast.json and docs/forecast_{CORPUS}.svg, docs/forecast_coverage.svg.
Trained runs go to runs/bench/ladder/CORPUS/ (d24, d24-s1, ..., d104, d104-s1, d104-s2) and are
reused when complete. The prediction is committed before the runs it predicts:
benchmarks/results/forecast_prediction.md. On 2 cores: about 25 minutes of training per corpus, 10
of forecasts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
CORPORA = ("stdlib", "cheaders")
MARIN_E = 1.5  # Marin fixes E at 1.5 in its per-fraction fits


def jobs(ladder_path: Path, corpus: str, target_seeds: int) -> list[tuple[str, object, str]]:
    """(directory name, config, role) of every run: the rungs' seeds and the target's."""
    from moelab.config import load_config
    from moelab.ladder.plan import load_ladder, rung_config, rung_runs

    lad = load_ladder(ladder_path)
    data = [f"data.sources=[{corpus}]"]
    out = [(name.removeprefix(f"{lad.name}-"), load_config(cfg, data), "rung") for name, cfg in rung_runs(lad)]
    target = load_config(rung_config(lad, len(lad.widths)), data)
    for k in range(target_seeds):
        cfg = target if k == 0 else load_config(target, [f"train.seed={target.train.seed + k}"])
        out.append((f"d{lad.target_width}" + (f"-s{k}" if k else ""), cfg, "target"))
    return out


def train_all(runs, root: Path) -> None:
    from moelab.train.loop import train

    for i, (name, cfg, _) in enumerate(runs):
        out = root / name
        if (out / "summary.json").exists():
            print(f"  [{i + 1}/{len(runs)}] {name}: trained already ({out})", flush=True)
            continue
        t0 = time.time()
        print(f"  [{i + 1}/{len(runs)}] training {name} ({cfg.train.steps} steps) into {out}", flush=True)
        train(cfg, out, resume=True, progress=False)
        print(f"  {name}: {time.time() - t0:.0f} s", flush=True)


def mean_run(runs):
    """The target's seeds as one curve: the geometric mean of their losses at each evaluation."""
    base = runs[0]
    loss = np.exp(np.mean([np.log(r.loss) for r in runs], axis=0))
    out = base.with_loss(base.steps, loss)
    out.name = f"{base.name} (mean of {len(runs)} seeds)"
    return out


def per_fraction(rungs, target, e):
    """Marin's form (moelab.ladder.forecast.backtest with law per-fraction), E held or fitted."""
    from moelab.ladder.forecast import FRACTIONS, _curve_of, forecast_per_fraction, scored, summarize

    curves = [_curve_of(r) for r in rungs]
    # seeds of one size: Marin's fit sees one point per size and fraction, their mean
    by_n: dict = {}
    for r, c in zip(rungs, curves, strict=True):
        by_n.setdefault(r.n, []).append(c)
    merged = []
    for group in by_n.values():
        fr = {f: float(np.exp(np.mean([np.log(c["fractions"][f]) for c in group]))) for f in FRACTIONS
              if all(f in c["fractions"] for c in group)}  # fmt: skip
        merged.append({**group[0], "fractions": fr})
    tc = _curve_of(target)
    fc = forecast_per_fraction(merged, tc["flops"], target.total_steps, e=e, n_boot=100)
    rows = scored(fc, target)
    return {"law": "per-fraction", "e": e, "curve": rows, **summarize(rows)}


def against(fc: dict, target) -> dict:
    """A joint forecast's curve against a measured run: errors, band, coverage."""
    from moelab.ladder.forecast import scored, summarize

    rows = scored(fc, target)
    out = {"curve": rows, **summarize(rows)}
    last = rows[-1]
    out["final_band_pct"] = [100 * (last["low"] / last["predicted"] - 1), 100 * (last["high"] / last["predicted"] - 1)]
    out["late_inside"] = float(np.mean([r["inside"] for r in rows if r["fraction"] > 0.2 + 1e-9]))
    return out


def coverage(rungs, targets, law: str, n_boot: int, log) -> list[dict]:
    """Real forecasts: each size left out and forecast from the other sizes (every seed of it a
    target), and the target's seeds forecast from every rung."""
    from moelab.ladder.forecast import forecast_joint
    from moelab.ladder.law import LawError

    out = []
    cases = [(f"leave out n={n:.4g}", [r for r in rungs if r.n != n], [r for r in rungs if r.n == n])
             for n in sorted({r.n for r in rungs})]  # fmt: skip
    cases.append(("the target", rungs, targets))
    for label, fit_on, held in cases:
        try:
            fc = forecast_joint(fit_on, held[0].blind(), law, n_boot=n_boot)
        except LawError as exc:
            log(f"  {label}: no forecast ({exc})")
            continue
        for r in held:
            a = against(fc, r)
            out.append({"case": label, "run": r.name, "dir": r.dir, "n": r.n, "final_error": a["final_error"],
                        "final_inside": a["curve"][-1]["inside"], "late_inside": a["late_inside"],
                        "final_band_pct": a["final_band_pct"], "extrapolation": bool(r.n > max(x.n for x in fit_on))})  # fmt: skip
        errs = ", ".join(f"{x['final_error']:+.2%}" for x in out[-len(held) :])
        band = out[-1]["final_band_pct"]
        log(f"  {label}: final errors {errs}, band {band[0]:+.1f}% / {band[1]:+.1f}%")
    return out


def figure(corpus: str, rungs, targets, fc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rungs:
        ax.plot(r.steps / r.total_steps, r.loss, color="0.7", lw=1)
    ax.plot([], [], color="0.7", lw=1, label=f"rungs ({len(rungs)} runs)")
    c = fc["curve"]
    x = np.array(c["steps"]) / targets[0].total_steps
    ax.fill_between(x, c["low"], c["high"], color="C0", alpha=0.25, label=f"band ({fc['band']['level']:.0%})")
    ax.plot(x, c["loss"], color="C0", ls="--", label=f"forecast ({fc['law']})")
    for k, t in enumerate(targets):
        ax.plot(t.steps / t.total_steps, t.loss, color="C3", marker=".", lw=0.8, alpha=1.0 if k == 0 else 0.5,
                label="target d104, seeds" if k == 0 else None)  # fmt: skip
    ax.set_xlabel("fraction of the run")
    ax.set_ylabel("held-out loss, dropless, mix (nats / token)")
    ax.set_title(f"{corpus}: the target's curve forecast from the rungs (12.8x compute)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def coverage_figure(cov: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (corpus, rows) in enumerate(cov.items()):
        for j, r in enumerate(rows):
            lo, hi = r["final_band_pct"]
            y = i * (len(rows) + 2) + j
            ax.plot([lo, hi], [y, y], color=f"C{i}", lw=3, alpha=0.4)
            # the measured final loss relative to the forecast, on the band's scale
            ax.plot(-100 * r["final_error"] / (1 + r["final_error"]), y, "k|" if r["final_inside"] else "rx")
        ax.text(ax.get_xlim()[0] if ax.get_xlim() else 0, i * (len(rows) + 2), corpus, fontsize=8, va="bottom")
    ax.set_yticks([])
    ax.axvline(0, color="k", lw=0.5)
    ax.set_xlabel("final loss relative to the forecast (%): band (90%) and measured (| inside, x outside)")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "ladders" / "demo.yaml"))
    ap.add_argument("--out", default="runs/bench/ladder")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--target-seeds", type=int, default=3)
    ap.add_argument("--n-boot", type=int, default=100)
    args = ap.parse_args()

    from moelab.ladder import DEFAULT_LAW, LAWS
    from moelab.ladder.forecast import backtest, rung_run

    t_start = time.time()
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "ladder": str(Path(args.ladder).relative_to(ROOT)), "default_law": DEFAULT_LAW, "metric": "mix",
           "corpora": {}}  # fmt: skip
    path = RESULTS / "forecast.json"
    cov_all = {}
    for corpus in args.corpora:
        print(f"== {corpus}: the ladder and the target's seeds", flush=True)
        runs = jobs(Path(args.ladder), corpus, args.target_seeds)
        root = Path(args.out) / corpus
        train_all(runs, root)
        loaded = {name: rung_run(root / name) for name, _, _ in runs}
        rungs = [loaded[n] for n, _, role in runs if role == "rung"]
        targets = [loaded[n] for n, _, role in runs if role == "target"]
        mean = mean_run(targets)
        res = {"runs": {n: {"final": float(r.loss[-1]), "n": r.n, "steps": r.total_steps} for n, r in loaded.items()},
               "laws": {}}  # fmt: skip
        print(f"== {corpus}: backtests (fit on {len(rungs)} rung runs)", flush=True)
        for law in [x for x in LAWS if not x.endswith("-peak")]:
            t0 = time.time()
            bt = backtest(rungs, targets[0], law, n_boot=args.n_boot)
            fc = bt.pop("forecast")
            entry = {"seed0": against(fc, targets[0]), "mean": against(fc, mean),
                     "fit": fc["fit"], "params": fc["params"], "warnings": fc["warnings"], "noise": fc["noise"],
                     "model_error": fc["model_error"], "e_sensitivity": fc["e_sensitivity"]}  # fmt: skip
            for r in entry["seed0"]["curve"]:
                r.pop("low", None), r.pop("high", None)
            res["laws"][law] = entry
            s0, m = entry["seed0"], entry["mean"]
            print(f"  {law:<13} seed 0: mean past 20% {s0['mean_abs_error_past_20']:.2%}, final {s0['final_error']:+.2%}"
                  f"; mean of seeds: final {m['final_error']:+.2%}; band {s0['final_band_pct'][0]:+.2f}% / "
                  f"{s0['final_band_pct'][1]:+.2f}%, past 20% inside {s0['late_inside']:.0%}; bound {fc['fit']['at_bound']}"
                  f" ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
            if law == DEFAULT_LAW:
                figure(corpus, rungs, targets, fc, DOCS / f"forecast_{corpus}.svg")
        for e, key in ((MARIN_E, "per-fraction (Marin: E = 1.5)"), (None, "per-fraction (E fitted)")):
            pf = {"seed0": per_fraction(rungs, targets[0], e), "mean": per_fraction(rungs, mean, e)}
            res["laws"][key] = pf
            print(f"  {key:<30} seed 0: mean past 20% {pf['seed0']['mean_abs_error_past_20']:.2%}, final "
                  f"{pf['seed0']['final_error']:+.2%}; mean of seeds: final {pf['mean']['final_error']:+.2%}", flush=True)  # fmt: skip
        print(f"== {corpus}: real forecasts for the band's coverage ({DEFAULT_LAW})", flush=True)
        cov_all[corpus] = res["coverage"] = coverage(rungs, targets, DEFAULT_LAW, args.n_boot, print)
        out["corpora"][corpus] = res
        out["seconds"] = time.time() - t_start
        path.write_text(json.dumps(out, indent=1))
    rows = [r for c in cov_all.values() for r in c]
    out["coverage"] = {
        "forecasts": len(rows),
        "final_inside": float(np.mean([r["final_inside"] for r in rows])) if rows else None,
        "late_points_inside": float(np.mean([r["late_inside"] for r in rows])) if rows else None,
    }
    coverage_figure(cov_all, DOCS / "forecast_coverage.svg")
    out["seconds"] = time.time() - t_start
    path.write_text(json.dumps(out, indent=1))
    print_tables(out)


def print_tables(out: dict) -> None:
    """The README's tables."""
    for corpus, res in out["corpora"].items():
        print(
            f"\n{corpus}: fit on the rungs, forecast d104 (12.8x the compute of d48); the target's final {res['runs']['d104']['final']:.4f}\n"
        )
        print("| law | 25% | 50% | 75% | 100% | mean past 20% | final (mean of seeds) | final band | past 20% inside |")
        print("|---|---|---|---|---|---|---|---|---|")
        for law, e in res["laws"].items():
            s0 = e["seed0"]
            at = {round(r["fraction"], 2): r["error"] for r in s0["curve"]}
            cells = " | ".join(f"{at[f]:+.2%}" if f in at else "" for f in (0.25, 0.5, 0.75, 1.0))
            band = (
                f"{s0['final_band_pct'][0]:+.1f}% / {s0['final_band_pct'][1]:+.1f}%" if "final_band_pct" in s0 else "-"
            )
            inside = f"{s0['late_inside']:.0%}" if "late_inside" in s0 else "-"
            print(
                f"| {law} | {cells} | {s0['mean_abs_error_past_20']:.2%} | {e['mean']['final_error']:+.2%} | {band} | {inside} |"
            )
    c = out.get("coverage")
    if c and c["forecasts"]:
        print(f"\ncoverage over {c['forecasts']} real forecasts: final point inside the 90% band {c['final_inside']:.0%}, "
              f"points past 20% inside {c['late_points_inside']:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
