"""The forecast: at every 5% of training, fit L(C) = E + A * C^-alpha across the ladder's rungs
and extrapolate to the target's compute at that same fraction; and the backtests that check it.

C is training FLOPs up to that point, without the LM head by default (Marin's choice); L is the
held-out macro loss, dropless. The fit at a fraction uses only the rungs' points at that fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.config import Config, config_from_dict
from moelab.ladder.fits import fit_power
from moelab.train.record import read_jsonl

FRACTIONS = [k / 20 for k in range(1, 21)]


class ForecastError(ValueError):
    """Rungs that cannot be used; one line naming the directory."""


def _flops(cfg: Config, with_head: bool) -> float:
    out = accounting.count(cfg).train(accounting.run_tokens(cfg))
    return out["train_flops"] if with_head else out["train_flops_without_lm_head"]


def rung_curve(run_dir: str | Path, metric: str = "loss_dropless", with_head: bool = False) -> dict:
    """A rung's held-out macro loss at each 5% of its run, with its compute at that point."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise ForecastError(f"{run_dir}: no config.json; is this a training run?")
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text())["config"])
    steps = cfg.train.steps
    total = _flops(cfg, with_head)
    points = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        if rec.get("kind") != "eval" or rec["step"] == 0:
            continue
        k = round(rec["step"] * 20 / steps)
        if abs(rec["step"] - k * steps / 20) <= 0.5 and 1 <= k <= 20:
            points[k] = rec[metric]["macro"]
    if not points:
        raise ForecastError(f"{run_dir}: no held-out evaluations at 5% points of its run")
    return {
        "dir": str(run_dir),
        "name": cfg.name or run_dir.name,
        "steps": steps,
        "flops": total,
        "fractions": {k / 20: v for k, v in sorted(points.items())},
    }


def forecast(
    rungs: list[dict], target_flops: float, target_steps: int, e: float | None = None, n_boot: int = 100
) -> dict:
    """Predicted loss of the target at every 5%, from the rungs' points at that same 5%."""
    out = {"fractions": [], "steps": [], "loss": [], "low": [], "high": [], "fits": []}
    for f in FRACTIONS:
        have = [r for r in rungs if f in r["fractions"]]
        if len(have) < 2:
            continue
        c = np.array([r["flops"] * f for r in have])
        loss = np.array([r["fractions"][f] for r in have])
        fit = fit_power(c, loss, e=e, n_boot=0)
        ct = target_flops * f
        boots = _boot_predictions(c, loss, e, ct, n_boot)
        out["fractions"].append(f)
        out["steps"].append(round(f * target_steps))
        out["loss"].append(float(fit.predict(ct)))
        out["low"].append(float(np.percentile(boots, 5)))
        out["high"].append(float(np.percentile(boots, 95)))
        out["fits"].append({"fraction": f, "E": fit.E, "A": fit.A, "alpha": fit.alpha, "rungs": len(have)})
    return out


def _boot_predictions(c: np.ndarray, loss: np.ndarray, e: float | None, ct: float, n_boot: int) -> np.ndarray:
    """Predictions at ct from fits to rungs resampled with replacement (at least two distinct)."""
    rng = np.random.default_rng(0)
    preds = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(c), len(c))
        if len(set(idx)) < 2:
            continue
        preds.append(float(fit_power(c[idx], loss[idx], e=e, n_boot=0).predict(ct)))
    return np.array(preds) if preds else np.array([np.nan])


def backtest(rungs: list[dict], e: float | None = None) -> dict:
    """Fit on all rungs but the largest, predict the largest's whole curve; and Marin's check:
    each rung's end extrapolated from its own 60-80% window."""
    rungs = sorted(rungs, key=lambda r: r["flops"])
    *small, big = rungs
    fc = forecast(small, big["flops"], big["steps"], e=e, n_boot=50)
    errors = []
    for f, pred in zip(fc["fractions"], fc["loss"], strict=True):
        if f in big["fractions"]:
            actual = big["fractions"][f]
            errors.append({"fraction": f, "predicted": pred, "actual": actual, "error": pred / actual - 1})
    ends = []
    for r in rungs:
        window = [(f, v) for f, v in r["fractions"].items() if 0.6 <= f <= 0.8 + 1e-9]
        if len(window) >= 3 and 1.0 in r["fractions"]:
            c = np.array([r["flops"] * f for f, _ in window])
            fit = fit_power(c, np.array([v for _, v in window]), e=e if e is not None else None, n_boot=0)
            pred = float(fit.predict(r["flops"]))
            ends.append(
                {
                    "rung": r["name"],
                    "predicted_end": pred,
                    "actual_end": r["fractions"][1.0],
                    "error": pred / r["fractions"][1.0] - 1,
                }
            )
    return {"target": big["name"], "curve": errors, "ends": ends}
