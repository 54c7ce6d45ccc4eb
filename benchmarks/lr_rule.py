"""What made the ladder's forecast optimistic: the learning-rate rule across sizes (issue 24).

The demo ladder's rungs and target (ladders/demo.yaml, seed 0) are trained at Marin's rule (`lr:
auto`) times 0.5, 1, 2, 4 and 8 (`train.lr_scale`; not every multiple at every size: see SWEEP), on
one development corpus. For each size: the final held-out loss (`mix`) at each multiple, and how much
the best of them gains over the rule's own rate. Then each law is fitted to the four rungs at one
multiple and forecasts the target at the same multiple: the final error at 1x against 2x and 4x.

The prediction was written first: benchmarks/results/optimism_prediction.md. Trained runs go to
runs/bench/forecast/CORPUS/dNN-lrK (dNN for 1x, the issue-13 recipe) and are reused. Writes
benchmarks/results/optimism.json. On 2 cores: about 35 minutes from nothing.
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
SWEEP = {24: (0.5, 1, 2, 4, 8), 32: (1, 2, 4), 40: (1, 2, 4), 48: (0.5, 1, 2, 4), 104: (1, 2, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "ladders" / "demo.yaml"))
    ap.add_argument("--out", default="runs/bench/forecast")
    ap.add_argument("--corpus", default="stdlib")
    args = ap.parse_args()

    from moelab.config import load_config
    from moelab.ladder import law as L
    from moelab.ladder.forecast import fitted, rung_run
    from moelab.ladder.plan import load_ladder, rung_config
    from moelab.train.loop import train

    t0 = time.time()
    lad = load_ladder(args.ladder)
    widths = lad.all_widths()
    root = Path(args.out) / args.corpus
    finals: dict = {}
    runs: dict = {}
    for d, scales in SWEEP.items():
        i = widths.index(d)
        for sc in scales:
            # the recipe before issue 24: the ladder's overrides without its lr_scale
            base = load_config(rung_config(lad, i), [f"data.sources=[{args.corpus}]", "train.lr_scale=1"])
            cfg = load_config(base, [f"train.lr_scale={sc}"])
            out = root / (f"d{d}" if sc == 1 else f"d{d}-lr{sc:g}")
            if not (out / "summary.json").exists():
                print(f"  training d{d} at {sc:g}x ({cfg.train.steps} steps) into {out}", flush=True)
                train(cfg, out, resume=True, progress=False)
            runs[(d, sc)] = rung_run(out)
            finals.setdefault(f"d{d}", {})[f"{sc:g}"] = float(runs[(d, sc)].loss[-1])
    gains = {}
    for d, by in finals.items():
        best = min(by, key=by.get)
        gains[d] = {"best_scale": float(best), "gain_over_1x": by[best] / by["1"] - 1}
        print(
            f"  {d}: "
            + "  ".join(f"{k}x {v:.4f}" for k, v in by.items())
            + f"; best {best}x, {gains[d]['gain_over_1x']:+.2%} over 1x"
        )
    forecasts = {}
    for sc in (1, 2, 4):
        rungs = [runs[(d, sc)] for d in lad.widths]
        target = runs[(lad.target_width, sc)]
        for law in ("lr-annealing", "chinchilla"):
            fit = L.fit_law(fitted(rungs), law)
            err = fit.predict(target.blind()) / target.loss - 1
            fr = target.steps / target.total_steps
            forecasts.setdefault(f"{sc:g}x", {})[law] = {"final_error": float(err[-1]),
                "mean_abs_error_past_20": float(np.abs(err[fr > 0.2 + 1e-9]).mean()), "at_bound": list(fit.at_bound)}  # fmt: skip
            print(f"  rungs and target at {sc:g}x, {law:<13} final {err[-1]:+.2%}, mean past 20% "
                  f"{np.abs(err[fr > 0.2 + 1e-9]).mean():.2%}, on a bound: {', '.join(fit.at_bound) or 'none'}")  # fmt: skip
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "corpus": args.corpus,
           "metric": "mix", "finals": finals, "gains": gains, "forecasts_seed0": forecasts, "seconds": time.time() - t0}  # fmt: skip
    (RESULTS / "optimism.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'optimism.json'}")


if __name__ == "__main__":
    main()
