"""The curves a forecast reads: each rung's held-out loss at its evaluations (a run as the joint law
sees it, moelab.ladder.law.Run; or at every 5% of its run with its compute, for the per-fraction
form), and a target's size, schedule and evaluation steps before it is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.config import Config, config_from_dict
from moelab.errors import ForecastError
from moelab.ladder import law as L
from moelab.runs import branch_point, read_jsonl
from moelab.schedule import eval_points, hyper, lr_factor

# what is forecast: the held-out loss (dropless) with the domains weighted by their share of the training
# mixture (`mix`). The macro average weighs a domain of 2.6% of the tokens as much as the rest, and
# its seed-to-seed spread was most of the noise (benchmarks/results/noise_floor.json)
AGG = "mix"


def held_out(rec: dict, agg: str = AGG, metric: str = "loss_dropless") -> float:
    """An evaluation record's held-out loss as a forecast reads it (``agg``: mix or macro)."""
    return rec[metric][agg]


def lr_schedule(cfg: Config) -> np.ndarray:
    """The rate applied by each update of the run (re-plans included), as a multiple of its peak."""
    import jax.numpy as jnp

    h = hyper(cfg)
    return np.asarray(lr_factor(jnp.arange(h.total_steps), h), np.float64)


def _run_config(run_dir: Path) -> Config:
    if not (run_dir / "config.json").is_file():
        raise ForecastError(f"{run_dir}: no config.json; is this a training run?")
    try:
        return config_from_dict(json.loads((run_dir / "config.json").read_text())["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ForecastError(f"{run_dir}/config.json: not a run's config ({exc})") from None


def target_run(cfg: Config, name: str | None = None, steps=None) -> L.Run:
    """The law's view of a run not yet trained: its size, its schedule, and where it will be evaluated."""
    a = accounting.count(cfg)
    lr = lr_schedule(cfg)
    at = np.array(sorted(eval_points(cfg, len(lr)) - {0}), float) if steps is None else np.asarray(steps, float)
    return L.Run(name or cfg.name or "target", a.active_params, cfg.train.batch_size * cfg.model.seq_len, lr, at,
                 None, 3 * a.forward_flops_per_token_without_lm_head, peak_lr=hyper(cfg).peak_lr)  # fmt: skip


def rung_run(run_dir: str | Path, metric: str = "loss_dropless", agg: str = AGG) -> L.Run:
    """A trained run as the law sees it: its held-out loss (``agg`` of the domains) at every
    evaluation after step 0."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    points = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        if rec.get("kind") == "eval" and rec.get("step", 0) > 0 and metric in rec:
            if agg not in rec[metric]:
                raise ForecastError(f"{run_dir}: its evaluations have no {agg!r} held-out loss (an older run); "
                                    f"re-run it, or forecast the {'macro' if agg != 'macro' else 'mix'} loss")  # fmt: skip
            points[rec["step"]] = rec[metric][agg]  # a resumed run's repeat replaces the first
    if not points:
        raise ForecastError(f"{run_dir}: no held-out evaluations after step 0")
    steps = np.array(sorted(points), float)
    run = target_run(cfg, cfg.name or run_dir.name, steps)
    if steps[-1] > run.total_steps:
        raise ForecastError(f"{run_dir}: evaluations past the run's {run.total_steps} steps")
    loss = np.array([points[s] for s in sorted(points)])
    if not np.all(np.isfinite(loss)) or np.any(loss <= 0):
        raise ForecastError(f"{run_dir}: a held-out loss is not a finite positive number")
    run = run.with_loss(steps, loss)
    run.dir = str(run_dir)
    ev = branch_point(run_dir)
    run.group = ev["parent"] if ev else str(run_dir.resolve())  # a branch shares its parent's seed
    return run


def shared_prefixes_once(runs: list[L.Run]) -> list[L.Run]:
    """A branch (moelab.train.branch) holds its parent's evaluations up to the branch step: when the
    parent is among ``runs`` too, the branch keeps only its own, so that no measurement counts twice."""
    dirs = {str(Path(r.dir).resolve()) for r in runs if r.dir}
    out = []
    for r in runs:
        ev = branch_point(r.dir) if r.dir else None
        if ev is not None and ev["parent"] in dirs:
            keep = r.steps > ev["step"]
            cut = r.with_loss(r.steps[keep], r.loss[keep])
            cut.dir = r.dir
            r = cut
        out.append(r)
    return out


def rung_curve(run_dir: str | Path, metric: str = "loss_dropless", with_head: bool = False, agg: str = AGG) -> dict:
    """A rung's held-out macro loss at each 5% of its run, with its compute (the per-fraction form)."""
    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    steps = cfg.train.steps
    out = accounting.run_train(cfg)
    total = out["train_flops"] if with_head else out["train_flops_without_lm_head"]
    points = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        if rec.get("kind") != "eval" or rec["step"] == 0:
            continue
        k = round(rec["step"] * 20 / steps)
        if abs(rec["step"] - k * steps / 20) <= 0.5 and 1 <= k <= 20:
            points[k] = rec[metric][agg]
    if not points:
        raise ForecastError(f"{run_dir}: no held-out evaluations at 5% points of its run")
    return {"dir": str(run_dir), "name": cfg.name or run_dir.name, "steps": steps, "flops": total,
            "fractions": {k / 20: v for k, v in sorted(points.items())}}  # fmt: skip


def _curve_of(run: L.Run) -> dict:
    """The per-fraction form's view of a law.Run: its points at 5% fractions and its total compute."""
    steps = run.total_steps
    fr = {}
    for s, v in zip(run.steps, run.loss if run.loss is not None else [], strict=False):
        k = round(s * 20 / steps)
        if abs(s - k * steps / 20) <= 0.5 and 1 <= k <= 20:
            fr[k / 20] = float(v)
    return {"dir": run.dir, "name": run.name, "steps": steps, "flops": run.flops_per_token * run.tokens_per_step * steps,
            "fractions": dict(sorted(fr.items()))}  # fmt: skip
