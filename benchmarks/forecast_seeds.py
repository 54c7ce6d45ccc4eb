"""Issue 37, item 3: how many seeds a size the forecast needs, from the runs' own noise.

The stability target (the final forecast's sd over seeds <= 0.5%) asks how far the run-to-run noise of
the rungs moves the forecast at the target. Per development corpus, the 20-token calibration runs
(benchmarks/calib_train.py: widths 16-56, two or three seeds) give each width's mean curve and its
seeds' deviations from it. Simulated ladders draw each run as its width's mean times one of those
deviations with a random sign, for a design (widths 24-48 or 24-56) and s seeds a width; each is
forecast at the d104 target with each two-parameter law held (the prior leave-one-corpus-out), and the
sd of the forecasts over the ladders is the noise's share of the forecast. Checked against the two
one-seed ladders the runs hold (seed 0 alone, seed 1 alone). No training: it reads runs/bench/calib.
The prediction was committed before this first ran: benchmarks/results/forecast_seeds_prediction.md.

    python benchmarks/forecast_seeds.py [--draws 200]   # -> benchmarks/results/forecast_seeds.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DESIGNS = {"d24-d48": (24, 32, 40, 48), "d24-d56": (24, 32, 40, 48, 56)}
SEEDS = (1, 2, 4, 8)
LAWS = ("prior-alpha", "prior-e", "marin", "prior-map")
FRACTIONS = (0.5, 1.0)
TARGET_SD = 0.005


def widths_of(runs: dict) -> dict[int, dict]:
    """width -> its mean curve at FRACTIONS, its seeds' relative deviations (one run's spread) and its flops."""
    out = {}
    for w in sorted({int(m[1]) for n in runs if (m := re.fullmatch(r"d(\d+)(-s\d+)?", n))}):
        members = [r for n, r in runs.items() if re.fullmatch(rf"d{w}(-s\d+)?", n)]
        if len(members) < 2 or any(f not in r["fractions"] for r in members for f in FRACTIONS):
            continue
        y = np.array([[r["fractions"][f] for f in FRACTIONS] for r in members])
        mean = y.mean(0)
        dev = (y / mean - 1) * math.sqrt(len(members) / (len(members) - 1))
        out[w] = {"mean": mean, "dev": dev, "flops": float(members[0]["flops"])}
    return out


def forecast(curves: list[dict], prior, law: str, target_flops: float, weights: dict | None = None) -> list[float]:
    """The law's forecast of the target at FRACTIONS, as moelab.ladder.prior.forecast_prior fits it
    (``weights``: per size, its total FLOPs rounded to 1e3, as forecast_prior's ``size_weights``)."""
    from moelab.ladder.prior import MODES, _points, _predict, fit_at

    out = []
    for f in FRACTIONS:
        c, loss, size = _points(curves, f)
        w = np.array([weights[s] for s in size.tolist()]) if weights else None
        fit = fit_at(c, loss, size, float(np.exp(np.mean(np.log(c)))), prior.at(f), MODES[law], w)
        out.append(_predict(fit, target_flops * f))
    return out


def simulated(noise: dict, widths, seeds: int, rng: np.random.Generator) -> list[dict]:
    curves = []
    for w in widths:
        nz = noise[w]
        for _ in range(seeds):
            d = nz["dev"][rng.integers(len(nz["dev"]))] * rng.choice((-1.0, 1.0))
            y = nz["mean"] * (1 + d)
            curves.append({"flops": nz["flops"], "fractions": dict(zip(FRACTIONS, y.tolist(), strict=True))})
    return curves


def noise_weights(run_sd: dict[str, dict[int, float]], corpus: str, noise: dict, widths) -> dict:
    """Per size of ``widths`` (its FLOPs rounded to 1e3): 1 / the run variance at that width, pooled over
    the OTHER corpora (a recipe's noise by width, as the prior is the recipe's exponent), scaled to mean 1."""
    var = {w: float(np.mean([sd[w] ** 2 for c, sd in run_sd.items() if c != corpus and w in sd])) for w in widths}
    inv = {w: 1.0 / v for w, v in var.items()}
    scale = len(widths) / sum(inv.values())
    return {round(noise[w]["flops"], -3): inv[w] * scale for w in widths}


def real_errors(runs: dict, prior, weights: dict | None, design: str) -> dict:
    """The d104 target forecast from the design's two-seed runs, by each law held and by forward chaining."""
    import forecast_calibration as fcal
    from forecast_tokens import TARGET

    rungs = [runs[f"d{w}" + (f"-s{s}" if s else "")] for w in DESIGNS[design] for s in (0, 1)]
    out = {}
    for law in (*LAWS, "auto"):
        o = fcal.one(rungs, weights, runs[TARGET], prior, law, n_boot=100)
        out[law] = {"law": o["law"], "mean_abs_past_20": o["mean_abs_past_20"], "final_error": o["final_error"]}
    return out


def main() -> None:
    from dev_corpora import CORPORA
    from forecast_tokens import TARGET, loo_priors

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calib", default=str(ROOT / "runs" / "bench" / "calib"))
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args()
    if args.draws < 2:
        print(f"--draws: {args.draws}; an sd needs at least 2 ladders", file=sys.stderr)
        sys.exit(2)
    if not Path(args.calib).is_dir():
        print(
            f"--calib: {args.calib} is not a directory of calibration runs; train them: python benchmarks/calib_train.py --no-stability",
            file=sys.stderr,
        )
        sys.exit(2)
    t0 = time.time()

    def log(text):
        print(f"[{time.time() - t0:5.0f} s] {text}", flush=True)

    log(f"reading the runs under {args.calib} ...")
    curves, priors = loo_priors(Path(args.calib), list(CORPORA))
    results, noises = {}, {}
    for c, runs in curves.items():
        noises[c] = widths_of(
            {n: r for n, r in runs.items() if re.fullmatch(r"d\d+(-s\d+)?", n) and n not in (TARGET, "d112")}
        )
    run_sd = {c: {w: float(np.sqrt(np.mean(v["dev"][:, -1] ** 2))) for w, v in nz.items()} for c, nz in noises.items()}
    for c, runs in curves.items():
        noise = noises[c]
        tf = float(runs[TARGET]["flops"])
        row = {"run_sd_final": {str(w): float(np.sqrt(np.mean(v["dev"][:, -1] ** 2))) for w, v in noise.items()}}
        one = {}  # the two one-seed ladders the runs hold, d24-d48
        for law in LAWS:
            f0, f1 = (forecast([runs[f"d{w}" + (f"-s{s}" if s else "")] for w in DESIGNS["d24-d48"]], priors[c], law, tf)[-1]
                      for s in (0, 1))  # fmt: skip
            one[law] = {"finals": [f0, f1], "sd": abs(f0 - f1) / math.sqrt(2) / ((f0 + f1) / 2)}
        row["one_seed_measured"] = one
        sims, real, weights = {}, {}, {}
        for design, widths in DESIGNS.items():
            if not all(w in noise for w in widths):
                log(f"{c}: {design}: a width without two seeds; skipped")
                continue
            wts = noise_weights(run_sd, c, noise, widths)
            weights[design] = {str(w): wts[round(noise[w]["flops"], -3)] for w in widths}
            for s in SEEDS:
                rng = np.random.default_rng(0)
                ladders = [simulated(noise, widths, s, rng) for _ in range(args.draws)]
                for law in LAWS:
                    cell = {}
                    for arm, wt in (("", None), ("weighted_", wts)):
                        pred = np.array([forecast(lad, priors[c], law, tf, wt) for lad in ladders])
                        sd = pred.std(0, ddof=1) / pred.mean(0)
                        cell.update({f"{arm}final_sd": float(sd[-1]), f"{arm}half_sd": float(sd[0])})
                    sims.setdefault(design, {}).setdefault(law, {})[str(s)] = cell
            real[design] = {"unweighted": real_errors(runs, priors[c], None, design),
                            "weighted": real_errors(runs, priors[c], wts, design)}  # fmt: skip
            for arm in ("", "weighted_"):
                log(f"{c:9s} {design} {arm or 'unweighted_'}final sd with s = {', '.join(map(str, SEEDS))}: " +
                    "; ".join(f"{law} " + " ".join(f"{sims[design][law][str(s)][arm + 'final_sd']:.2%}" for s in SEEDS) for law in LAWS))  # fmt: skip
            log(f"{c:9s} {design} final error, unweighted -> weighted: " +
                "; ".join(f"{law} {real[design]['unweighted'][law]['final_error']:+.2%} -> {real[design]['weighted'][law]['final_error']:+.2%}"
                          for law in (*LAWS, "auto")))  # fmt: skip
        row["simulated"] = sims
        row["noise_weights"] = weights
        row["real_errors"] = real
        row["seeds_for_target"] = {d: {law: next((s for s in SEEDS if v[str(s)]["final_sd"] <= TARGET_SD), None)
                                       for law, v in by.items()} for d, by in sims.items()}  # fmt: skip
        results[c] = row
    check = {}
    for law in LAWS:
        meas = [results[c]["one_seed_measured"][law]["sd"] for c in results]
        sim = [
            results[c]["simulated"]["d24-d48"][law]["1"]["final_sd"]
            for c in results
            if "d24-d48" in results[c]["simulated"]
        ]
        check[law] = {
            "measured_rms": float(np.sqrt(np.mean(np.square(meas)))),
            "simulated_rms": float(np.sqrt(np.mean(np.square(sim)))),
        }
        check[law]["ratio"] = check[law]["simulated_rms"] / check[law]["measured_rms"]
        log(f"check, one-seed ladders d24-d48, {law}: measured RMS {check[law]['measured_rms']:.2%}, "
            f"simulated {check[law]['simulated_rms']:.2%} (x{check[law]['ratio']:.2f})")  # fmt: skip
    weighted = {}  # over the corpora, per design and law: the noise with two seeds and the real errors, both arms
    for design in DESIGNS:
        rows = [r for r in results.values() if design in r["simulated"]]
        for law in (*LAWS, "auto"):
            cell = {}
            for arm in ("unweighted", "weighted"):
                e = [r["real_errors"][design][arm][law] for r in rows]
                cell[arm] = {"mean_of_mean_abs_past_20": float(np.mean([x["mean_abs_past_20"] for x in e])),
                             "mean_abs_final": float(np.mean([abs(x["final_error"]) for x in e]))}  # fmt: skip
                if law != "auto":
                    key = "final_sd" if arm == "unweighted" else "weighted_final_sd"
                    cell[arm]["noise_final_sd_2_seeds"] = float(
                        np.mean([r["simulated"][design][law]["2"][key] for r in rows])
                    )
            weighted.setdefault(design, {})[law] = cell
            log(f"{design} {law:11s} " + "; ".join(f"{arm}: " + ", ".join(f"{k} {v:.2%}" for k, v in cell[arm].items())
                                                     for arm in cell))  # fmt: skip
    scaling = {law: float(np.mean([results[c]["simulated"]["d24-d48"][law]["8"]["final_sd"]
                                   / results[c]["simulated"]["d24-d48"][law]["2"]["final_sd"] for c in results]))
               for law in LAWS}  # fmt: skip
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": "python benchmarks/calib_train.py --no-stability && python benchmarks/forecast_seeds.py",
           "seconds": round(time.time() - t0), "target": TARGET, "draws": args.draws, "target_sd": TARGET_SD,
           "check_one_seed": check, "sd_ratio_8_to_2_seeds": scaling, "noise_weighted": weighted, "results": results}  # fmt: skip
    path = RESULTS / "forecast_seeds.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    figure(out, RESULTS / "forecast_seeds.svg")
    log(f"-> {path}, {RESULTS / 'forecast_seeds.svg'}")


def figure(out: dict, path: Path) -> None:
    """The final forecast's noise sd against seeds a width, per corpus (Marin's law), for both designs,
    beside the 0.5% stability target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(DESIGNS), figsize=(5.0 * len(DESIGNS), 3.6), sharey=True, squeeze=False)
    for ax, design in zip(axes[0], DESIGNS, strict=True):
        for i, (c, r) in enumerate(out["results"].items()):
            if design not in r["simulated"]:
                continue
            sd = [100 * r["simulated"][design]["marin"][str(s)]["final_sd"] for s in SEEDS]
            ax.plot(SEEDS, sd, "o-", color=f"C{i}", label=c)
        ax.axhline(100 * out["target_sd"], color="k", ls="--", lw=0.8, label="target 0.5%")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(SEEDS, [str(s) for s in SEEDS])
        ax.set_title(f"{design}, Marin's law", fontsize=9)
        ax.set_xlabel("seeds a width")
        ax.grid(alpha=0.3, which="both")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axes[0][0].set_ylabel(f"noise sd of the {out['target']} final forecast (%)")
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
