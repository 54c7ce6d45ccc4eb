"""Issue 37, item 3: runs at other token budgets beside the ladder, so that size and tokens vary apart.

Every run of the calibration ladder reads 20 tokens per active parameter, so the fits cannot tell a
gain from size from a gain from tokens, nor the size exponent from E. This benchmark trains the demo's
widths (24-48) at 10 and 40 tokens per active parameter too (seeds 0 and 1, the recipe of
ladders/calib.yaml otherwise: the rate by Marin's rule at each run's own horizon), and fits, per 5% of
the run, one law over every budget with the exponent tied between size and tokens:

    L_f(N, D) = E + A (N / N0)^-a + B (D / D0)^-a        D = f x the run's tokens

(the issue's "branches that break the size-tokens collinearity": separate runs, since the schedule's
shape spans the whole horizon, no checkpoint of a 20-token run is a prefix of them). The prediction
was committed before any of these runs was trained: benchmarks/results/forecast_tokens_prediction.md.

    python benchmarks/forecast_tokens.py --train [--corpora stdlib ...]   # the runs -> runs/bench/calib_tokens
    python benchmarks/forecast_tokens.py                                   # -> benchmarks/results/forecast_tokens.json

The analysis reads the 20-token runs and targets of benchmarks/calib_train.py (runs/bench/calib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "ladders" / "calib.yaml"
WIDTHS = (24, 32, 40, 48)  # the demo's rungs
BUDGETS = (10, 40)  # tokens per active parameter beside the ladder's 20
SEEDS = (0, 1)
TARGET = "d104"
GRID = np.round(np.arange(0.02, 1.5 + 1e-9, 0.005), 3)  # the tied exponent's grid
N_BOOT = 200
VARIANTS = {"10+20+40": (10, 20, 40), "10+20": (10, 20), "20+40": (20, 40)}  # budgets fitted together
RESULTS = ROOT / "benchmarks" / "results"


def run_name(width: int, budget: int, seed: int) -> str:
    """d24-s1 for the ladder's own runs (20 tokens a parameter), d24-t40-s1 for the others."""
    return f"d{width}" + (f"-t{budget}" if budget != 20 else "") + (f"-s{seed}" if seed else "")


def jobs(corpus: str, seed: int) -> list[tuple[str, object]]:
    from dev_corpora import sources_override
    from moelab.config import load_config
    from moelab.ladder.plan import load_ladder, rung_config

    lad = load_ladder(LADDER)
    data = sources_override(corpus)
    out = []
    for budget in BUDGETS:
        other = dataclasses.replace(lad, tokens_per_active_param=float(budget))
        for w in WIDTHS:
            base = load_config(rung_config(other, lad.widths.index(w)), data)
            out.append((run_name(w, budget, seed), load_config(base, [f"train.seed={seed}"])))
    return out


def train_all(out_root: Path, corpora: list[str]) -> None:
    """Seed 0 on every corpus first, then seed 1: a job cut short still leaves one whole ladder each."""
    from calib_train import run_jobs
    from dev_corpora import available

    todo = []
    for seed in SEEDS:
        for corpus in corpora:
            why = available(corpus)
            if why:
                if seed == SEEDS[0]:
                    print(f"skipped: {why}", flush=True)
                continue
            todo += [(corpus, name, cfg) for name, cfg in jobs(corpus, seed)]
    run_jobs(todo, out_root)


# ---- the analysis ---------------------------------------------------------------------------------


def load_run(run_dir: Path) -> dict:
    """A run's held-out loss at each 5%, its active parameters and its tokens."""
    from moelab import accounting
    from moelab.ladder.curves import _run_config, rung_curve

    acc = accounting.run_train(_run_config(run_dir))
    return {**rung_curve(run_dir), "n": float(acc["active_params"]), "tokens": float(acc["tokens"]),
            "train_flops": float(acc["train_flops"])}  # fmt: skip


def load_corpus(calib: Path, tokens_root: Path, corpus: str) -> dict | None:
    """(width, budget, seed) -> run, and the target, when every run of the design is complete."""
    runs = {}
    for w in WIDTHS:
        for budget in (10, 20, 40):
            for seed in SEEDS:
                d = (calib if budget == 20 else tokens_root) / corpus / run_name(w, budget, seed)
                if (d / "summary.json").exists():
                    runs[(w, budget, seed)] = load_run(d)
    t = calib / corpus / TARGET
    if not (t / "summary.json").exists():
        return None
    return {"runs": runs, "target": load_run(t)}


def fit_tied(n: np.ndarray, d: np.ndarray, loss: np.ndarray) -> dict:
    """L = E + A (N/N0)^-a + B (D/D0)^-a on relative residuals: a on GRID, E, A, B >= 0 by NNLS for each."""
    from scipy.optimize import nnls

    n0, d0 = float(np.exp(np.mean(np.log(n)))), float(np.exp(np.mean(np.log(d))))
    best = None
    for a in GRID:
        x = np.stack([np.ones_like(loss), (n / n0) ** -a, (d / d0) ** -a], 1) / loss[:, None]
        coef, rnorm = nnls(x, np.ones_like(loss))
        if best is None or rnorm < best[0]:
            best = (rnorm, float(a), coef)
    rnorm, a, (e, big_a, big_b) = best
    return {"E": float(e), "A": float(big_a), "B": float(big_b), "a": a, "n0": n0, "d0": d0,
            "rms": float(rnorm / np.sqrt(len(loss))), "edge": bool(a in (GRID[0], GRID[-1]))}  # fmt: skip


def predict(fit: dict, n: float, d: float) -> float:
    return fit["E"] + fit["A"] * (n / fit["n0"]) ** -fit["a"] + fit["B"] * (d / fit["d0"]) ** -fit["a"]


def forecast_tied(runs: list[dict], target: dict, boot: list[list[dict]] = ()) -> dict:
    """Per 5% of the target: the tied law fitted on ``runs`` at that fraction, and the band from ``boot``
    (the same fit on each resampled set of runs)."""
    fractions = [f for f in sorted(target["fractions"]) if all(f in r["fractions"] for r in runs)]

    def at(rs, f):
        n = np.array([r["n"] for r in rs])
        return fit_tied(n, f * np.array([r["tokens"] for r in rs]), np.array([r["fractions"][f] for r in rs]))

    fits = [at(runs, f) for f in fractions]
    pred = [predict(ft, target["n"], f * target["tokens"]) for ft, f in zip(fits, fractions, strict=True)]
    low, high = list(pred), list(pred)
    if boot:
        draws = np.array([[predict(at(rs, f), target["n"], f * target["tokens"]) for f in fractions] for rs in boot])
        low, high = list(np.percentile(draws, 5, axis=0)), list(np.percentile(draws, 95, axis=0))
    end = fits[-1]
    return {"fractions": fractions, "loss": pred, "low": low, "high": high,
            "fit_at_end": {k: end[k] for k in ("E", "A", "B", "a", "rms", "edge")},
            "exponent": [ft["a"] for ft in fits], "edges": [f for ft, f in zip(fits, fractions, strict=True) if ft["edge"]]}  # fmt: skip


def resample(cells: dict, rng: np.random.Generator, n_boot: int) -> list[list[dict]]:
    """Per draw, each (width, budget) cell's runs drawn with replacement from its seeds."""
    out = []
    for _ in range(n_boot):
        rs = []
        for members in cells.values():
            rs += [members[i] for i in rng.integers(0, len(members), len(members))]
        out.append(rs)
    return out


def design(runs: dict, budgets, seeds=SEEDS) -> tuple[list[dict], dict]:
    cells = {}
    for (w, b, s), r in sorted(runs.items()):
        if b in budgets and s in seeds:
            cells.setdefault((w, b), []).append(r)
    complete = len(cells) == len(WIDTHS) * len(budgets) and all(len(v) == len(seeds) for v in cells.values())
    return ([r for v in cells.values() for r in v] if complete else []), cells


def loo_priors(calib: Path, corpora: list[str]) -> tuple[dict, dict]:
    """The 20-token runs' curves per corpus (forecast_calibration.load_curves) and, per corpus, the prior
    fitted on the others (leave-one-corpus-out, as forecast_calibration.py fits it)."""
    import forecast_calibration as fcal
    from moelab.ladder.plan import load_ladder
    from moelab.ladder.prior import corpus_params, fit_prior, recipe_key

    curves = {c: r for c, r in fcal.load_curves(calib, TARGET).items() if c in corpora}
    key = recipe_key(load_ladder(LADDER))
    params = {}
    for c, runs in curves.items():
        if fcal.target_epochs(runs[TARGET]) <= 1.0:  # a target that repeats its data is not in the prior
            rungs = [r for n, r in runs.items() if n not in fcal.TARGETS and "-o" not in n]
            params[c] = corpus_params(rungs, runs[TARGET])
    return curves, {c: fit_prior(params, key, leave_out=c) for c in curves}


def baseline(calib: Path, corpora: list[str], log) -> dict:
    """Forward chaining on the 20-token runs alone (d24-d48, two seeds), the prior leave-one-corpus-out."""
    import forecast_calibration as fcal

    curves, priors = loo_priors(calib, corpora)
    out = {}
    for c, runs in curves.items():
        rungs, weights = fcal.ladder(runs, "d24-d48")
        if rungs:
            out[c] = fcal.one(rungs, weights, runs[TARGET], priors[c], "auto")
            log(f"{c:9s} baseline (forward chaining, 20 tokens): {out[c]['law']} mean {out[c]['mean_abs_past_20']:.2%} "
                f"final {out[c]['final_error']:+.2%}")  # fmt: skip
    return out


def analyse(calib: Path, tokens_root: Path, corpora: list[str]) -> dict:
    import forecast_calibration as fcal

    t0 = time.time()

    def log(text):
        print(f"[{time.time() - t0:5.0f} s] {text}", flush=True)

    results = {}
    for c in corpora:
        data = load_corpus(calib, tokens_root, c)
        if data is None:
            log(f"{c}: no {TARGET} target under {calib}; skipped")
            continue
        truth, row = data["target"], {}
        for name, budgets in VARIANTS.items():
            rs, cells = design(data["runs"], budgets)
            if not rs:
                log(f"{c}: {name}: runs missing ({len(data['runs'])} found); skipped")
                continue
            boot = resample(cells, np.random.default_rng(0), N_BOOT) if name == "10+20+40" else ()
            fc = forecast_tied(rs, truth, boot)
            s = fcal.score(fc, truth)
            row[name] = {**s, "fit_at_end": fc["fit_at_end"], "exponent": fc["exponent"], "edges": fc["edges"]}
            if name != "10+20+40":  # no band for these (no bootstrap): their errors only
                for k in ("curve", "final_band", "final_inside", "late_inside"):
                    row[name].pop(k)
            band = f"band {s['final_band'][0]:+.1%}/{s['final_band'][1]:+.1%} {'inside' if s['final_inside'] else 'outside'}"
            log(f"{c:9s} tied {name:9s} a={fc['fit_at_end']['a']:.3f} E={fc['fit_at_end']['E']:.3f} "
                f"mean {s['mean_abs_past_20']:.2%} final {s['final_error']:+.2%} " + (band if boot else ""))  # fmt: skip
        finals = []
        for seed in SEEDS:  # stability: each seed's ladder alone
            rs, _ = design(data["runs"], VARIANTS["10+20+40"], (seed,))
            if rs:
                finals.append(forecast_tied(rs, truth)["loss"][-1])
        if len(finals) == 2:
            row["seed_ladders"] = {"finals": finals, "final_errors": [p / truth["fractions"][1.0] - 1 for p in finals],
                                   "sd": float(np.std(finals, ddof=1) / np.mean(finals))}  # fmt: skip
            log(f"{c:9s} seed ladders: finals {finals[0]:.4f} {finals[1]:.4f}, sd {row['seed_ladders']['sd']:.2%}")
        if row:
            results[c] = row
    base = baseline(calib, list(results), log)
    for c in results:
        if c in base:
            b = base[c]
            results[c]["baseline"] = {
                k: b[k] for k in ("law", "mean_abs_past_20", "final_error", "final_band", "final_inside")
            }
            results[c]["baseline"]["curve"] = b["curve"]
    summary = {}
    for name in (*VARIANTS, "baseline"):
        rows = [results[c][name] for c in results if name in results[c]]
        if rows:
            summary[name] = {
                "corpora": len(rows),
                "mean_of_mean_abs_past_20": float(np.mean([r["mean_abs_past_20"] for r in rows])),
                "mean_abs_final": float(np.mean([abs(r["final_error"]) for r in rows])),
                "met_both_1pct": int(sum(r["mean_abs_past_20"] <= 0.01 and abs(r["final_error"]) <= 0.01 for r in rows)),
            }  # fmt: skip
            if "final_band" in rows[0]:
                summary[name]["final_inside"] = int(sum(bool(r["final_inside"]) for r in rows))
                summary[name]["band_under_3pct"] = int(sum(max(abs(x) for x in r["final_band"]) <= 0.03 for r in rows))
    sds = [results[c]["seed_ladders"]["sd"] for c in results if "seed_ladders" in results[c]]
    summary["seed_ladder_sd_mean"] = float(np.mean(sds)) if sds else None
    return {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "command": "python benchmarks/forecast_tokens.py --train && python benchmarks/forecast_tokens.py",
            "seconds": round(time.time() - t0), "target": TARGET, "widths": list(WIDTHS), "budgets": [10, 20, 40],
            "law": "L_f(N, D) = E + A (N/N0)^-a + B (D/D0)^-a, per 5% of the run", "summary": summary, "results": results}  # fmt: skip


def figure(out: dict, path: Path) -> None:
    """Each corpus's target: the tied law's forecast and band, forward chaining's on 20 tokens, the truth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = [c for c in out["results"] if "10+20+40" in out["results"][c]]
    cols = 3
    rows = max(1, (len(corpora) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, c in zip(axes.flat, corpora, strict=False):
        r = out["results"][c]["10+20+40"]
        x = [p["fraction"] for p in r["curve"]]
        ax.fill_between(x, [p["low"] for p in r["curve"]], [p["high"] for p in r["curve"]], color="C0", alpha=0.25,
                        label="90% band (seeds)")  # fmt: skip
        ax.plot(x, [p["predicted"] for p in r["curve"]], "C0--", label="tied law, 10+20+40")
        if "baseline" in out["results"][c]:
            b = out["results"][c]["baseline"]["curve"]
            ax.plot([p["fraction"] for p in b], [p["predicted"] for p in b], "C2:", label="forward chaining, 20")
        ax.plot(x, [p["actual"] for p in r["curve"]], "C3.-", lw=0.8, label=f"target {out['target']}")
        ax.set_title(f"{c}: final {r['final_error']:+.2%}, mean>20% {r['mean_abs_past_20']:.2%}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlim(0.2, 1.02)
        base = [p["predicted"] for p in out["results"][c].get("baseline", {}).get("curve", []) if p["fraction"] >= 0.2]
        lo = min([min(p["actual"], p["low"]) for p in r["curve"] if p["fraction"] >= 0.2] + base)
        hi = max(max(p["actual"], p["high"]) for p in r["curve"] if p["fraction"] >= 0.2)
        ax.set_ylim(0.97 * lo, 1.03 * hi)
    for ax in list(axes.flat)[len(corpora) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"The {out['target']} target from d24-d48 at 10, 20 and 40 tokens a parameter (exponent tied)", fontsize=10
    )
    fig.supxlabel("fraction of the run")
    fig.supylabel("held-out loss, mix (nats / token)")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    from dev_corpora import CORPORA

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", action="store_true", help="train the runs at 10 and 40 tokens a parameter")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "calib_tokens"))
    ap.add_argument("--calib", default=str(ROOT / "runs" / "bench" / "calib"), help="the 20-token runs and targets")
    args = ap.parse_args()
    if args.train:
        train_all(Path(args.out), args.corpora)
        return
    if not Path(args.calib).is_dir():
        print(
            f"--calib: {args.calib} is not a directory of calibration runs; train them: python benchmarks/calib_train.py --no-stability",
            file=sys.stderr,
        )
        sys.exit(2)
    out = analyse(Path(args.calib), Path(args.out), args.corpora)
    if not out["results"]:
        print(f"{args.out}: no corpus has its runs and target; train them first (--train)", file=sys.stderr)
        sys.exit(2)
    path = RESULTS / "forecast_tokens.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    figure(out, RESULTS / "forecast_tokens.svg")
    print(f"-> {path}, {RESULTS / 'forecast_tokens.svg'}", flush=True)
    for name, s in out["summary"].items():
        print(f"{name}: {s}", flush=True)


if __name__ == "__main__":
    main()
