"""Issue 37: the prior, fitted leave-one-corpus-out, and what the forecast then does on every corpus.

Reads the runs of benchmarks/calib_train.py (runs/bench/calib/CORPUS/NAME) and, per development corpus:
1. what it teaches the prior (moelab.ladder.prior.corpus_params: per 5% of the run, the three-parameter
   fit's size exponent and E's share of the top rung's loss, on all rungs and the target);
2. forecasts of its width-104 target from ladder designs that are subsets of the calibration ladder
   (d24-d48 as the demo had it, d24-d56, d16-d56, d16-d56 with d16 down-weighted, d24-d56 with a third
   seed on the top two rungs), by each two-parameter law (alpha from the prior, E from the prior,
   Marin's E = 1.5) and by the law forward chaining picks, with the prior fitted on the OTHER corpora;
   errors against the target at every 5%, the band, the coverage;
3. more real forecasts for the band's coverage: the top rung from the smaller sizes, the d48 rung
   from the sizes below it;
4. on the stdlib, stability: the chosen design's final forecast over three parameter-seed ladders and
   three data orders (train.data_seed).
Then the prior from every corpus is written where moelab ships it (src/moelab/ladder/priors/KEY.json).

Writes benchmarks/results/forecast_calibration.json, docs/forecast_corpora.svg and the tables between
the calibration markers of docs/guides/ladder.md (the manual's forecast section).
The prediction: benchmarks/results/forecast_calibration_prediction.md (committed before the runs were read).

    python benchmarks/forecast_calibration.py [--root runs/bench/calib] [--no-write-prior]
"""

from __future__ import annotations

import argparse
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
RESULTS = ROOT / "benchmarks" / "results"
DESIGNS = {  # name -> (widths, seeds per width, seeds of the top rungs, how many top rungs, weight of the smallest)
    "d24-d48": ((24, 32, 40, 48), 2, 2, 0, 1.0),
    "d16-d48": ((16, 24, 32, 40, 48), 2, 2, 0, 1.0),
    "d16-d48 (d16 x0.25)": ((16, 24, 32, 40, 48), 2, 2, 0, 0.25),
    "d24-d48 (3 seeds on d48)": ((24, 32, 40, 48), 2, 3, 1, 1.0),
    # a wider range, but the d104 target is only 7.8x the d56 rung's training FLOPs: measured, not admissible
    "d24-d56": ((24, 32, 40, 48, 56), 2, 2, 0, 1.0),
    "d16-d56": ((16, 24, 32, 40, 48, 56), 2, 2, 0, 1.0),
    "d24-d56 (3 seeds on d48, d56)": ((24, 32, 40, 48, 56), 2, 3, 2, 1.0),
}
MIN_RATIO = 10.0  # the target's training FLOPs over the largest rung's, at least (issue 37)
LAWS = ("prior-alpha", "prior-e", "marin", "prior-map")
TARGET = "d104"  # the target width's run (--target d112: the d56 top rung's admissible target, 10.0x its FLOPs)
TARGETS = ("d104", "d112")  # trained targets: never rungs


def name_of(width: int, seed: int, order: int = 0) -> str:
    return f"d{width}" + (f"-s{seed}" if seed else "") + (f"-o{order}" if order else "")


def load_curves(root: Path, target: str = TARGET, with_head: bool = False) -> dict[str, dict[str, dict]]:
    """corpus -> run name -> its per-fraction curve, for every complete run (``with_head``: its compute
    counts the LM head)."""
    from moelab import accounting
    from moelab.ladder.forecast import _run_config, rung_curve

    out = {}
    for cdir in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = {d.name: {**rung_curve(d, with_head=with_head), "train_flops": accounting.run_train(_run_config(d))["train_flops"]}
                for d in sorted(cdir.iterdir()) if (d / "summary.json").exists()}  # fmt: skip
        if target in runs:
            out[cdir.name] = runs
    return out


def target_epochs(curve: dict) -> float:
    """The most passes the target made over any of its domains (from its last training record)."""
    last = {}
    for line in (Path(curve["dir"]) / "metrics.jsonl").read_text().splitlines():
        if '"epochs"' in line:
            last = json.loads(line).get("epochs") or last
    return max(last.values()) if last else float("nan")


def ladder(runs: dict, design: str, seeds=(0, 1), order: int = 0) -> tuple[list[dict], dict | None]:
    widths, k, k_top, n_top, w_small = DESIGNS[design]
    out = []
    for i, d in enumerate(widths):
        use = seeds if (k_top == k or i < len(widths) - n_top) else tuple(range(k_top))
        for s in use:
            name = name_of(d, s, order)
            if name not in runs:
                return [], None
            out.append(runs[name])
    weights = {round(float(out[0]["flops"]), -3): w_small} if w_small != 1.0 else None
    return out, weights


def score(fc: dict, truth: dict) -> dict:
    rows = [(f, p, lo, hi, truth["fractions"][f]) for f, p, lo, hi in zip(fc["fractions"], fc["loss"], fc["low"], fc["high"],
            strict=True) if f in truth["fractions"]]  # fmt: skip
    late = [r for r in rows if r[0] > 0.2 + 1e-9]
    f, p, lo, hi, t = rows[-1]
    return {
        "mean_abs_past_20": float(np.mean([abs(p / t - 1) for _, p, _, _, t in late])),
        "max_abs_past_20": float(np.max([abs(p / t - 1) for _, p, _, _, t in late])),
        "final_error": p / t - 1,
        "final_band": [lo / p - 1, hi / p - 1],
        "final_inside": bool(lo <= t <= hi),
        "late_inside": float(np.mean([lo <= t <= hi for _, _, lo, hi, t in late])),
        "curve": [{"fraction": f, "predicted": p, "low": lo, "high": hi, "actual": t} for f, p, lo, hi, t in rows],
    }


def one(rungs, weights, truth, prior, law, n_boot=400) -> dict:
    from moelab.ladder.prior import forecast_prior, forward_chain

    if law == "auto":
        chain = forward_chain(rungs, prior)
        law = chain["chosen"]
    else:
        chain = None
    fc = forecast_prior(rungs, truth["flops"], truth["steps"], prior, law, n_boot=n_boot, size_weights=weights)
    out = {"law": law, **score(fc, truth), "warnings": fc["warnings"], "basins": fc.get("basins")}
    if chain:
        out["forward_chain"] = chain
    return out


def main() -> None:
    from moelab.ladder.plan import load_ladder
    from moelab.ladder.prior import corpus_params, fit_prior, prior_path, recipe_fields, recipe_key, save_prior

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(ROOT / "runs" / "bench" / "calib"))
    ap.add_argument("--design", default=None, help="the demo's design (default: the best by leave-one-corpus-out)")
    ap.add_argument("--no-write-prior", action="store_true")
    ap.add_argument("--with-head", action="store_true",
                    help="item 4's variant: compute counts the LM head (a comparison: writes its own json only)")  # fmt: skip
    ap.add_argument("--target", default=TARGET, choices=TARGETS,
                    help="the target run forecast (d112: a comparison, written to its own json only)")  # fmt: skip
    args = ap.parse_args()
    target = args.target
    variant = ("_with_head" if args.with_head else "") + (f"_{target}" if target != TARGETS[0] else "")
    if variant:
        args.no_write_prior = True
    t0 = time.time()

    def log(text):
        print(f"[{time.time() - t0:5.0f} s] {text}", flush=True)

    from dev_corpora import CORPORA

    log(f"reading the runs under {args.root} ...")
    curves = load_curves(Path(args.root), target, args.with_head)
    aside = {c: r for c, r in curves.items() if c not in CORPORA}  # kept aside: judged once, at the end
    curves = {c: r for c, r in curves.items() if c in CORPORA}
    if len(curves) < 3:
        sys.exit(f"{args.root}: {len(curves)} corpora have a trained target; leave-one-corpus-out needs 3")
    log(f"corpora with a target: {', '.join(f'{c} ({len(r)} runs)' for c, r in curves.items())}")
    lad = load_ladder(ROOT / "ladders" / "calib.yaml")
    key = recipe_key(lad)
    params, repeats = {}, {}
    for c, runs in curves.items():
        rungs = [r for n, r in runs.items() if n not in TARGETS and "-o" not in n]
        p = corpus_params(rungs, runs[target])
        i = p["fractions"].index(1.0)
        ep = target_epochs(runs[target])
        log(
            f"{c}: the prior's view at the end: alpha {p['alpha'][i]:.3f}, E/top {p['e_share'][i]:.3f}; "
            f"the target reads {ep:.2f} epochs"
        )
        if ep > 1.0:  # a target that repeats its data follows another law: forecast, never fitted into the prior
            repeats[c] = ep
        else:
            params[c] = p
    if repeats:
        log(
            f"not in the prior (the target repeats its data): {', '.join(f'{c} ({e:.2f} epochs)' for c, e in repeats.items())}"
        )

    results = {c: {} for c in curves}
    forecasts = []  # real forecasts, for the band's coverage
    for c, runs in curves.items():
        prior = fit_prior(params, key, leave_out=c)
        truth = runs[target]
        for design in DESIGNS:
            rungs, weights = ladder(runs, design)
            if not rungs:
                continue
            row = {law: one(rungs, weights, truth, prior, law) for law in (*LAWS, "auto")}
            results[c][design] = row
            a = row["auto"]
            log(f"{c:9s} {design:26s} auto={a['law']:8s} mean {a['mean_abs_past_20']:.2%} final {a['final_error']:+.2%} "
                f"band {a['final_band'][0]:+.1%}/{a['final_band'][1]:+.1%} " +
                " ".join(f"{law}:{row[law]['final_error']:+.2%}" for law in LAWS))  # fmt: skip
    # the demo's design: of those whose target has >= 10x the top rung's training FLOPs, the smallest
    # mean |error| past 20% over the corpora (forward chaining's law)
    some = next(iter(curves.values()))
    ratio = {d: some[target]["train_flops"] / some[f"d{DESIGNS[d][0][-1]}"]["train_flops"] for d in DESIGNS}
    design = args.design or min(
        (d for d in DESIGNS if all(d in results[c] for c in curves) and ratio[d] >= MIN_RATIO),
        key=lambda d: np.mean([results[c][d]["auto"]["mean_abs_past_20"] for c in curves]),
    )
    log(f"the demo's design: {design}")
    for c, runs in curves.items():
        prior = fit_prior(params, key, leave_out=c)
        rungs, weights = ladder(runs, design)
        a = results[c][design]["auto"]
        forecasts.append({"corpus": c, "case": f"target from {design}", "law": a["law"], "final_error": a["final_error"],
                          "final_inside": a["final_inside"], "late_inside": a["late_inside"], "final_band": a["final_band"]})  # fmt: skip
        sizes = sorted({round(float(r["flops"]), -3) for r in rungs})
        for cut in (1, 2):  # the top rung from the sizes below; the next from the sizes below it
            held_size = sizes[-cut]
            below = [r for r in rungs if round(float(r["flops"]), -3) < held_size]
            held = [r for r in rungs if round(float(r["flops"]), -3) == held_size]
            if len({round(float(r["flops"]), -3) for r in below}) < 3:
                continue
            w = weights if weights and min(weights) in {round(float(r["flops"]), -3) for r in below} else None
            for h in held:
                o = one(below, w, h, prior, "auto", n_boot=200)
                forecasts.append({"corpus": c, "case": f"rung {Path(h['dir']).name} from the sizes below", "law": o["law"],
                                  "final_error": o["final_error"], "final_inside": o["final_inside"],
                                  "late_inside": o["late_inside"], "final_band": o["final_band"]})  # fmt: skip
    stability = {}
    if "stdlib" in curves:
        runs, prior = curves["stdlib"], fit_prior(params, key, leave_out="stdlib")
        truth = runs[target]
        for kind, ladders in (("parameter seeds", [((0, 1), 0), ((2, 3), 0), ((4, 5), 0)]),
                              ("data orders", [((0, 1), 0), ((0, 1), 1), ((0, 1), 2)])):  # fmt: skip
            finals, rows = [], []
            for seeds, order in ladders:
                widths, k, k_top, n_top, w_small = DESIGNS[design]
                plain = next(d for d, v in DESIGNS.items() if v[0] == widths and v[2] == k and v[4] == w_small)
                rungs, weights = ladder(runs, plain, seeds, order)  # two seeds a rung, of each pair
                if not rungs:
                    continue
                o = one(rungs, weights, truth, prior, "auto")
                finals.append(o["curve"][-1]["predicted"])
                by_law = {
                    law: one(rungs, weights, truth, prior, law, n_boot=1)["curve"][-1]["predicted"] for law in LAWS
                }
                rows.append({"seeds": list(seeds), "data_order": order, "law": o["law"], "final": finals[-1],
                             "final_error": o["final_error"], "mean_abs_past_20": o["mean_abs_past_20"],
                             "final_by_law": by_law})  # fmt: skip
                if (seeds, order) != ((0, 1), 0):
                    forecasts.append({"corpus": "stdlib", "case": f"target, {kind} {seeds} order {order}", "law": o["law"],
                                      "final_error": o["final_error"], "final_inside": o["final_inside"],
                                      "late_inside": o["late_inside"], "final_band": o["final_band"]})  # fmt: skip
            sd = float(np.std(finals, ddof=1) / np.mean(finals)) if len(finals) > 1 else None
            per_law = {law: float(np.std([r["final_by_law"][law] for r in rows], ddof=1)
                                  / np.mean([r["final_by_law"][law] for r in rows])) for law in LAWS} if len(rows) > 1 else {}  # fmt: skip
            stability[kind] = {"ladders": rows, "final_sd": sd, "final_sd_by_law": per_law}
            log(f"stability over {kind}: {len(finals)} ladders, final sd {sd if sd is None else f'{sd:.2%}'}")
    inside = [f["final_inside"] for f in forecasts]
    coverage = {"forecasts": len(forecasts), "final_inside": float(np.mean(inside)) if inside else None,
                "late_inside": float(np.mean([f["late_inside"] for f in forecasts])) if forecasts else None,
                "target_band_halfwidth": [max(abs(results[c][design]["auto"]["final_band"][0]),
                                              abs(results[c][design]["auto"]["final_band"][1])) for c in curves]}  # fmt: skip
    log(
        f"coverage: {coverage['final_inside']:.0%} of {len(forecasts)} final points inside the 90% band, "
        f"{coverage['late_inside']:.0%} of the points past 20%"
    )
    prior_all = fit_prior(params, key, recipe=recipe_fields(lad), created=str(date.today()))
    kept_aside = {}
    for c, runs in aside.items():  # the design and the law as chosen, the prior from every development corpus
        rungs, weights = ladder(runs, design)
        if not rungs:
            continue
        a = one(rungs, weights, runs[target], prior_all, "auto")
        kept_aside[c] = {**a, "target_epochs": target_epochs(runs[target])}
        log(
            f"kept aside {c}: {a['law']} mean {a['mean_abs_past_20']:.2%} final {a['final_error']:+.2%} "
            f"band {a['final_band'][0]:+.1%}/{a['final_band'][1]:+.1%}"
        )
    if not args.no_write_prior:
        path = save_prior(prior_all, prior_path(key))
        log(f"the prior from all {len(params)} corpora -> {path}")
    for c in results:  # the curves of the demo's design only; the others by their numbers
        for dz, row in results[c].items():
            for law, r in row.items():
                if dz != design or law != "auto":
                    r.pop("curve", None)
    out = {"target_flops_ratio": ratio, "date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": "python benchmarks/calib_train.py && python benchmarks/forecast_calibration.py",
           "seconds": round(time.time() - t0), "recipe": key, "corpora": list(curves), "design": design, "params": params,
           "repeats": repeats, "results": results, "kept_aside": kept_aside, "forecasts": forecasts, "coverage": coverage, "stability": stability,
           "prior": prior_all.to_dict()}  # fmt: skip
    out["target"] = target
    out["compute"] = "with the LM head" if args.with_head else "without the LM head"
    if variant:  # a comparison: the shipped prior, the manual and the figure stay as they are
        flags = ("--with-head " if args.with_head else "") + (f"--target {target}" if target != TARGETS[0] else "")
        extra = f" --extra-target {target[1:]}" if target != TARGETS[0] else ""
        out["command"] = (
            f"python benchmarks/calib_train.py --no-stability{extra} && python benchmarks/forecast_calibration.py {flags.strip()}"
        )
        path = RESULTS / f"forecast_calibration{variant}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        log(f"-> {path}")
        print_table(out)
        return
    (RESULTS / "forecast_calibration.json").write_text(json.dumps(out, indent=1) + "\n")
    log(f"-> {RESULTS / 'forecast_calibration.json'}")
    figure(out, ROOT / "docs" / "forecast_corpora.svg")
    write_manual(out, ROOT / "docs" / "guides" / "ladder.md")
    log("-> docs/forecast_corpora.svg, docs/guides/ladder.md (the calibration tables)")
    print_table(out)


def figure(out: dict, path: Path) -> None:
    """Each corpus's target forecast (the demo's design, leave-one-corpus-out) against its curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(out["results"])
    cols = 3
    rows = (len(corpora) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, c in zip(axes.flat, corpora, strict=False):
        a = out["results"][c][out["design"]]["auto"]
        x = [p["fraction"] for p in a["curve"]]
        ax.fill_between(x, [p["low"] for p in a["curve"]], [p["high"] for p in a["curve"]], color="C0", alpha=0.25,
                        label="90% band")  # fmt: skip
        ax.plot(x, [p["predicted"] for p in a["curve"]], "C0--", label=f"forecast ({a['law']})")
        ax.plot(x, [p["actual"] for p in a["curve"]], "C3.-", lw=0.8, label=f"target {out.get('target', 'd104')}")
        ax.set_title(f"{c}: final {a['final_error']:+.2%}, mean>20% {a['mean_abs_past_20']:.2%}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlim(0.2, 1.02)
        lo = min(p["actual"] for p in a["curve"] if p["fraction"] >= 0.2)
        hi = max(p["high"] for p in a["curve"] if p["fraction"] >= 0.2)
        ax.set_ylim(0.97 * lo, 1.01 * hi)
    for ax in list(axes.flat)[len(corpora) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"The {out.get('target', 'd104')} target forecast from {out['design']} with the prior fitted on the other corpora",
        fontsize=10,
    )
    fig.supxlabel("fraction of the run")
    fig.supylabel("held-out loss, mix (nats / token)")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


START, END = "<!-- calibration:start -->", "<!-- calibration:end -->"


def manual_tables(out: dict) -> str:
    """The manual's tables: per corpus against the targets, the designs, stability, coverage, the prior."""
    d = out["design"]
    lines = [f"Measured {out['date']} (`{out['command']}`; figures in `benchmarks/results/forecast_calibration.json`).",
             f"The demo's design: **{d}**, two seeds a size, target {out.get('target', 'd104')}; the prior for each corpus fitted on the "
             "others (leave-one-corpus-out). Targets: mean |error| past 20% <= 1%, final <= 1%, band <= +-3%.", "",
             "| corpus | law (forward chaining) | mean \\|error\\| past 20% | final error | final band | inside |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for c, rows in out["results"].items():
        a = rows[d]["auto"]
        lines.append(f"| {c} | {a['law']} | {a['mean_abs_past_20']:.2%} | {a['final_error']:+.2%} | "
                     f"{a['final_band'][0]:+.1%} / {a['final_band'][1]:+.1%} | {'yes' if a['final_inside'] else 'no'} |")  # fmt: skip
    for c, a in out.get("kept_aside", {}).items():
        lines.append(f"| {c} (kept aside) | {a['law']} | {a['mean_abs_past_20']:.2%} | {a['final_error']:+.2%} | "
                     f"{a['final_band'][0]:+.1%} / {a['final_band'][1]:+.1%} | {'yes' if a['final_inside'] else 'no'} |")  # fmt: skip
    lines += ["", "Every design and law, over the development corpora (mean of mean |error| past 20%; largest |final error|; "
              "mean band half-width):", "", "| design | " + " | ".join(("auto", *LAWS)) + " |",
              "|---|" + "---|" * (len(LAWS) + 1)]  # fmt: skip
    for dz in DESIGNS:
        if not all(dz in out["results"][c] for c in out["results"]):
            continue
        cells = []
        for law in ("auto", *LAWS):
            rs = [out["results"][c][dz][law] for c in out["results"]]
            cells.append(f"{np.mean([r['mean_abs_past_20'] for r in rs]):.2%}; {max(abs(r['final_error']) for r in rs):.2%}; "
                         f"+-{np.mean([max(-r['final_band'][0], r['final_band'][1]) for r in rs]):.1%}")  # fmt: skip
        lines.append(f"| {dz} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Stability on the stdlib (the demo's widths, two seeds on every rung; the final forecast's sd, target "
        "<= 0.5%; with the law forward chaining chose, then with each law held):",
        "",
    ]
    for kind, st in out["stability"].items():
        finals = ", ".join(f"{r['final']:.4f} ({r['law']})" for r in st["ladders"])
        sd = "-" if st["final_sd"] is None else f"{st['final_sd']:.2%}"
        held = "; ".join(f"{law} {v:.2%}" for law, v in st.get("final_sd_by_law", {}).items())
        lines.append(f"- {kind}: finals {finals}; sd **{sd}**" + (f"; one law held: {held}" if held else ""))
    cov = out["coverage"]
    lines += ["", f"The band over {cov['forecasts']} real forecasts (the targets, the top rungs from the sizes below, "
              f"the stability ladders): {cov['final_inside']:.0%} of final points inside the 90% band, "
              f"{cov['late_inside']:.0%} of the points past 20% (target: 85-95%).", "",
              f"The prior (`src/moelab/ladder/priors/{out['recipe']}.json`, fitted on {', '.join(out['prior']['corpora'])}): "
              "per corpus and fraction, E, A and alpha fitted on the rungs and the target together (a profile over "
              "alpha); the prior is their mean and sample sd across corpora. At the end of the run:", "",
              "| corpus | alpha (on compute) | E / top rung's loss |", "|---|---|---|"]  # fmt: skip
    for c, p in out["params"].items():
        i = p["fractions"].index(1.0)
        lines.append(f"| {c} | {p['alpha'][i]:.3f} | {p['e_share'][i]:.3f} |")
    pr = out["prior"]
    i = pr["fractions"].index(1.0)
    for c, ep in out.get("repeats", {}).items():
        lines.append(f"| {c} | not in the prior: its target reads {ep:.2f} epochs of its data | |")
    lines.append(
        f"| **prior** | **{pr['alpha'][i]:.3f} +- {pr['alpha_sd'][i]:.3f}** | **{pr['e_share'][i]:.3f} +- {pr['e_share_sd'][i]:.3f}** |"
    )
    lines += ["", "![Each corpus's target forecast against its curve](../forecast_corpora.svg)"]
    return "\n".join(lines)


def write_manual(out: dict, path: Path) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{path}: no {START} ... {END} markers to write the tables between")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + START + "\n" + manual_tables(out) + "\n" + END + tail)


def print_table(out: dict) -> None:
    d = out["design"]
    print(f"\n{'corpus':10s} {'law':8s} {'mean>20%':>9s} {'final':>8s} {'band':>14s} inside")
    for c, rows in out["results"].items():
        a = rows[d]["auto"]
        print(f"{c:10s} {a['law']:8s} {a['mean_abs_past_20']:9.2%} {a['final_error']:+8.2%} "
              f"{a['final_band'][0]:+6.1%}/{a['final_band'][1]:+5.1%} {a['final_inside']}")  # fmt: skip


if __name__ == "__main__":
    main()
