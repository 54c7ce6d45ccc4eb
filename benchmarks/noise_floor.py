"""The noise floor under the forecast: how far apart do runs of one recipe land, and what lowers it?

Issue 24, item 1. The demo's ladder recipe (ladders/demo.yaml) is trained with several seeds (a seed
sets the initialisation and the data order) at its largest rung (d48) and at its target (d104), on
each development corpus. For each, and for two ways of averaging the domains' held-out losses (the
macro mean, and `mix`: each domain by its share of the training mixture):
- the per-run standard deviation of the held-out loss (dropless) at the end and at 50% of the
  run, relative to the mean, with a 90% confidence interval (chi-square, seeds - 1 degrees of freedom);
- the evaluation's part, separated with paired windows: every seed's last checkpoint is evaluated on
  the same K disjoint sets of held-out windows; a two-way decomposition of the log-loss [seed, set]
  gives the run-by-window interaction (the part of one evaluation's noise that does not cancel
  between two runs on the same windows) and the seed spread with the windows averaged out (the model's
  own part).
Then one variable at a time on the d48 rung of the first corpus, each with the same seeds: Adam's
beta2 (0.95 against the rule's 0.9999), twice the batch (the same tokens in half the steps), four
times the evaluation tokens (the baseline's checkpoints evaluated again: no training), a warm-up of
5% against 1%. Cost is counted in tokens (training and evaluation), not seconds, so that a figure
does not move with what else the machine runs; noise per unit of cost is variance x cost.

The prediction was committed before this ran: benchmarks/results/noise_floor_prediction.md.
Seed 0 of each run lives where benchmarks/forecast_backtest.py keeps it (runs/bench/forecast/CORPUS/
d48, d104), the others beside it (d48-s1, ...); finished runs are reused. Writes
benchmarks/results/noise_floor.json. On 2 cores: about 20 minutes per corpus, 12 for the variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CORPORA = ("stdlib", "cheaders")
SETS = 6  # disjoint window sets per evaluation of a last checkpoint


def chi2_interval(sd: float, n: int, level: float = 0.9) -> list[float]:
    """The confidence interval of a standard deviation seen in n samples."""
    from scipy.stats import chi2

    dof = n - 1
    if dof < 1:
        return [math.nan, math.nan]
    q = (1 - level) / 2
    return [sd * math.sqrt(dof / chi2.ppf(1 - q, dof)), sd * math.sqrt(dof / chi2.ppf(q, dof))]


def spread(values) -> dict:
    """Relative standard deviation of a few runs' losses, with its 90% interval."""
    x = np.log(np.asarray(values, float))
    sd = float(x.std(ddof=1)) if len(x) > 1 else math.nan
    return {"n": len(x), "mean": float(np.exp(x.mean())), "rel_sd": sd, "ci90": chi2_interval(sd, len(x))}


def decompose(table: np.ndarray) -> dict:
    """[seeds, sets] log-losses: the run-by-window interaction sd (one evaluation's noise that does
    not cancel between runs on the same windows) and the seed sd with the windows averaged out."""
    r, c = table.shape
    resid = table - table.mean(1, keepdims=True) - table.mean(0, keepdims=True) + table.mean()
    inter = float(np.sqrt(np.sum(resid**2) / max((r - 1) * (c - 1), 1)))
    row_var = float(table.mean(1).var(ddof=1))
    model = math.sqrt(max(row_var - inter**2 / c, 0.0))
    window = float(table.mean(0).std(ddof=1))  # how far one set of windows sits from another (shared)
    return {
        "interaction_rel_sd": inter,
        "model_rel_sd": model,
        "model_ci90": chi2_interval(model, r),
        "window_rel_sd": window,
        "seeds": r,
        "sets": c,
    }


def run_dir(root: Path, corpus: str, name: str, seed: int, variant: str = "") -> Path:
    tag = name + (f"-{variant}" if variant else "") + (f"-s{seed}" if seed else "")
    return root / corpus / tag


def train_one(cfg, out: Path) -> float:
    from moelab.train.loop import train

    if (out / "summary.json").exists():
        print(f"  {out}: trained already", flush=True)
        return 0.0
    t0 = time.time()
    print(f"  training {out.name} ({cfg.train.steps} steps, seed {cfg.train.seed}) into {out}", flush=True)
    train(cfg, out, resume=True, progress=False)
    dt = time.time() - t0
    print(f"  {out.name}: {dt:.0f} s", flush=True)
    return dt


AGGS = ("macro", "mix")


def shares(out: Path) -> dict:
    """The run's domains' shares of its training rows (the weights of ``mix``)."""
    from moelab.data.mixture import build_mixture
    from moelab.data.store import build_store
    from moelab.runs import load_run_config
    from moelab.train.evaluate import _no_cap

    cfg = load_run_config(out)
    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    return build_mixture(_no_cap(cfg), store).shares(cfg.train.steps)


def curve(out: Path, agg: str) -> dict:
    """step -> held-out loss (dropless, ``agg``) of a finished run; ``mix`` worked out from the
    domains' losses for runs evaluated before the evaluator wrote it."""
    from moelab.runs import read_jsonl

    recs = [r["loss_dropless"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    if agg == "mix" and any("mix" not in r for r in recs):
        w = shares(out)
        recs = [{**r, "mix": sum(w[d] * r[d] for d in w)} for r in recs]
    return {s: r[agg] for s, r in zip(steps, recs, strict=True)}


def window_sets(out: Path, eval_tokens: int | None = None, sets: int = SETS) -> list[dict]:
    """The last checkpoint's held-out losses (dropless; macro and mix) on ``sets`` disjoint sets of windows."""
    from moelab.train.evaluate import Evaluator, disjoint_sets, restored

    _, cfg, store, state, _ = restored(out, progress=False)
    if eval_tokens:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_tokens=eval_tokens))
    per = disjoint_sets(store, cfg.model.seq_len, cfg.train.eval_tokens)
    # as many sets as every domain that has more than one holds (a domain read whole repeats itself)
    n = min(sets, min([p for p in per.values() if p > 1] or [1]))
    return [
        Evaluator(cfg, store, offset={d: k % per[d] for d in per}, dropless_only=True)(
            state["params"], state["model_state"]
        )["loss_dropless"]
        for k in range(n)
    ]


def measure(runs: list[tuple[object, Path]], eval_tokens: int | None = None) -> dict:
    """Spread at the end and at 50%, the paired-window decomposition, and the cost of one run; for
    the macro and the mixture-weighted held-out loss."""
    cfg = runs[0][0]
    steps = cfg.train.steps
    half = int(round(steps / 2))
    sets = [window_sets(out, eval_tokens) for _, out in runs]
    w = shares(runs[0][1])
    evals = len(curve(runs[0][1], "macro"))
    tokens = steps * cfg.train.batch_size * cfg.model.seq_len
    eval_tok = (eval_tokens or cfg.train.eval_tokens) * 3 * evals  # three domains per evaluation
    out = {"steps": steps, "seeds": [c.train.seed for c, _ in runs], "cost_tokens": tokens + eval_tok,
           "train_tokens": tokens, "eval_tokens_per_domain": eval_tokens or cfg.train.eval_tokens, "shares": w}  # fmt: skip
    for agg in AGGS:
        curves = [curve(o, agg) for _, o in runs]
        table = np.log(np.array([[x.get(agg, sum(w[d] * x[d] for d in w)) for x in row] for row in sets]))
        # with other eval tokens than the run's, its own evaluations do not apply: the first set does
        finals = list(np.exp(table[:, 0])) if eval_tokens else [c[steps] for c in curves]
        out[agg] = {
            "final": spread(finals),
            "final_on_first_set": spread(np.exp(table[:, 0])),
            "half": spread([c[half] for c in curves]) if not eval_tokens and all(half in c for c in curves) else None,
            "windows": decompose(table),
            "finals": finals,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "ladders" / "demo.yaml"))
    ap.add_argument("--out", default="runs/bench/forecast")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--rung-seeds", type=int, default=4)
    ap.add_argument("--target-seeds", type=int, default=3)
    ap.add_argument("--no-variants", action="store_true")
    args = ap.parse_args()

    from moelab.config import load_config
    from moelab.ladder.plan import load_ladder, rung_config
    from moelab.train.optim import hyper

    t_start = time.time()
    root = Path(args.out)
    lad = load_ladder(args.ladder)
    n = len(lad.all_widths())
    res = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "ladder": str(Path(args.ladder).relative_to(ROOT)), "corpora": {}, "variants": {}}  # fmt: skip
    path = RESULTS / "noise_floor.json"

    def save() -> None:
        res["seconds"] = time.time() - t_start
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, path)

    def seeded(corpus: str, i: int, name: str, seeds: int, sets=(), variant: str = "") -> list:
        base = load_config(rung_config(lad, i), [f"data.sources=[{corpus}]", *sets])
        runs = []
        for s in range(seeds):
            cfg = load_config(base, [f"train.seed={s}"])
            out = run_dir(root, corpus, name, s, variant)
            train_one(cfg, out)
            runs.append((cfg, out))
        return runs

    for corpus in args.corpora:
        print(f"== {corpus}: seeds of the largest rung and of the target", flush=True)
        rung = seeded(corpus, n - 2, "d48", args.rung_seeds)
        res["corpora"].setdefault(corpus, {})["d48"] = measure(rung)
        save()
        target = seeded(corpus, n - 1, "d104", args.target_seeds)
        res["corpora"][corpus]["d104"] = measure(target)
        save()
        report_corpus(corpus, res["corpora"][corpus])

    if not args.no_variants:
        corpus = args.corpora[0]
        print(f"== variants of the d48 rung on {corpus}, one at a time", flush=True)
        base_runs = [(load_config(rung_config(lad, n - 2), [f"data.sources=[{corpus}]", f"train.seed={s}"]),
                      run_dir(root, corpus, "d48", s)) for s in range(args.rung_seeds)]  # fmt: skip
        rule = hyper(base_runs[0][0])
        res["variants"]["baseline"] = res["corpora"][corpus]["d48"]
        half_steps = int(math.ceil(base_runs[0][0].train.steps / 2))
        variants = {
            # lr: auto takes beta2 from Marin's rule; the same peak given as a number keeps beta2 as set
            "beta2=0.95": [f"train.lr={rule.peak_lr!r}", "train.beta2=0.95"],
            "batch=16": ["train.batch_size=16", f"train.steps={half_steps}"],
            "warmup=5%": ["train.warmup_frac=0.05"],
        }
        for tag, sets in variants.items():
            runs = seeded(corpus, n - 2, "d48", args.rung_seeds, sets, tag.replace("=", "").replace("%", "pc"))
            res["variants"][tag] = measure(runs) | {"overrides": sets}
            save()
        res["variants"]["eval_tokens=32768"] = measure(base_runs, eval_tokens=32768)
        save()
        report_variants(res["variants"])
    save()
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")


def report_corpus(corpus: str, r: dict) -> None:
    for name, run in r.items():
        for agg in AGGS:
            m = run[agg]
            w = m["windows"]
            half = f"; at 50% {m['half']['rel_sd']:.2%}" if m["half"] else ""
            print(
                f"  {corpus} {name} ({agg}): {m['final']['n']} seeds, final {m['final']['mean']:.4f}, per-run sd "
                f"{m['final']['rel_sd']:.2%} [90%: {m['final']['ci90'][0]:.2%}, {m['final']['ci90'][1]:.2%}]{half}; "
                f"windows averaged {w['model_rel_sd']:.2%}, run-by-window {w['interaction_rel_sd']:.2%}, "
                f"set to set {w['window_rel_sd']:.2%}",
                flush=True,
            )


def report_variants(v: dict) -> None:
    for agg in AGGS:
        base = v["baseline"]
        b_cost, b_var = base["cost_tokens"], base[agg]["final"]["rel_sd"] ** 2
        print(f"\nheld-out loss, {agg}:")
        print("| variant | final loss | per-run sd (90% CI) | run-by-window sd | cost (tokens) | variance x cost |")
        print("|---|---|---|---|---|---|")
        for tag, run in v.items():
            m = run[agg]
            f = m["final"]
            print(
                f"| {tag} | {f['mean']:.4f} | {f['rel_sd']:.2%} ({f['ci90'][0]:.2%}-{f['ci90'][1]:.2%}) | "
                f"{m['windows']['interaction_rel_sd']:.2%} | {run['cost_tokens']:.3g} | "
                f"{f['rel_sd'] ** 2 * run['cost_tokens'] / (b_var * b_cost):.2f}x |"
            )


if __name__ == "__main__":
    main()
