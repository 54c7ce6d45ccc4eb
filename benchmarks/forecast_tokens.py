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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "ladders" / "calib.yaml"
WIDTHS = (24, 32, 40, 48)  # the demo's rungs
BUDGETS = (10, 40)  # tokens per active parameter beside the ladder's 20
SEEDS = (0, 1)


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
    from dev_corpora import available
    from moelab.train.loop import train

    todo = []
    for seed in SEEDS:
        for corpus in corpora:
            why = available(corpus)
            if why:
                if seed == SEEDS[0]:
                    print(f"skipped: {why}", flush=True)
                continue
            todo += [(corpus, name, cfg) for name, cfg in jobs(corpus, seed)]
    failed = set()
    for i, (corpus, name, cfg) in enumerate(todo):
        out = out_root / corpus / name
        if (out / "summary.json").exists() or corpus in failed:
            continue
        t0 = time.time()
        print(f"[{i + 1}/{len(todo)}] {corpus}/{name}: {cfg.train.steps} steps", flush=True)
        try:
            train(cfg, out, resume=True, progress=False)
        except Exception as exc:  # a corpus that cannot be read stops that corpus, not the others
            print(f"[{i + 1}/{len(todo)}] {corpus}/{name}: FAILED ({type(exc).__name__}: {exc}); the rest of {corpus} skipped",
                  flush=True)  # fmt: skip
            failed.add(corpus)
            continue
        print(f"[{i + 1}/{len(todo)}] {corpus}/{name}: {time.time() - t0:.0f} s", flush=True)


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
    sys.exit("the analysis is written after the runs' prediction is committed; run with --train")


if __name__ == "__main__":
    main()
