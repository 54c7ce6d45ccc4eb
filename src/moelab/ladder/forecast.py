"""The forecast: the target's whole held-out loss curve from the ladder's rungs, with a band; and the
backtests that check it.

Three ways to forecast:
- ``prior`` (moelab.ladder.prior; what the demo registers): per fraction, two free parameters and the
  size exponent from the recipe's prior, fitted across development corpora (issue 37);
- a joint law (moelab.ladder.law; the default, ``lr-annealing``): one fit through every evaluation
  of every rung, given each run's size and learning-rate schedule, read at the target's own size
  and schedule (so a re-planned horizon or another schedule is forecast as it will run);
- ``per-fraction``, Marin's form kept as the baseline: at every 5% of training L(C) = E + A * C^-alpha
  across the rungs' points at that fraction, extrapolated to the target's compute at that fraction
  (C = training FLOPs up to that point without the LM head).

The band of a joint law is a parametric bootstrap from the fit's own residuals: each rung's curve
sits off the law by an offset of its own (a seed, a shape) plus noise from point to point, both
measured from the residuals. Synthetic ladders are drawn from the fitted law with that noise, the
law refitted to each, and the target read with an offset and noise of its own; the band is the
5th-95th percentile of those readings. Four rungs measure the offsets' spread with few degrees of
freedom, so each draw first draws that spread from its sampling distribution (a scaled inverse
chi-square): the band widens as a Student t does, instead of trusting a spread seen in four numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.config import Config, config_from_dict
from moelab.errors import ForecastError
from moelab.ladder import law as L
from moelab.ladder.fits import fit_power
from moelab.monitor.health import departures
from moelab.runs import read_jsonl
from moelab.schedule import eval_points

FRACTIONS = [k / 20 for k in range(1, 21)]
# what is forecast: the held-out loss (dropless) with the domains weighted by their share of the training
# mixture (`mix`). The macro average weighs a domain of 2.6% of the tokens as much as the rest, and
# its seed-to-seed spread was most of the noise (benchmarks/results/noise_floor.json)
AGG = "mix"


def held_out(rec: dict, agg: str = AGG, metric: str = "loss_dropless") -> float:
    """An evaluation record's held-out loss as a forecast reads it (``agg``: mix or macro)."""
    return rec[metric][agg]


LAW_CHOICES = L.LAW_CHOICES
MIN_FRACTION = 0.1  # a joint law is fitted to evaluations from this fraction of each run on
LEVEL = 0.9  # the band's nominal coverage


# ------------------------------------------------------------------------------------ inputs


def lr_schedule(cfg: Config) -> np.ndarray:
    """The rate applied by each update of the run (re-plans included), as a multiple of its peak."""
    import jax.numpy as jnp

    from moelab.train import optim

    h = optim.hyper(cfg)
    return np.asarray(optim.lr_factor(jnp.arange(h.total_steps), h), np.float64)


def _run_config(run_dir: Path) -> Config:
    if not (run_dir / "config.json").is_file():
        raise ForecastError(f"{run_dir}: no config.json; is this a training run?")
    try:
        return config_from_dict(json.loads((run_dir / "config.json").read_text())["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ForecastError(f"{run_dir}/config.json: not a run's config ({exc})") from None


def target_run(cfg: Config, name: str | None = None, steps=None) -> L.Run:
    """The law's view of a run not yet trained: its size, its schedule, and where it will be evaluated."""
    from moelab.train import optim

    a = accounting.count(cfg)
    lr = lr_schedule(cfg)
    at = np.array(sorted(eval_points(cfg, len(lr)) - {0}), float) if steps is None else np.asarray(steps, float)
    return L.Run(name or cfg.name or "target", a.active_params, cfg.train.batch_size * cfg.model.seq_len, lr, at,
                 None, 3 * a.forward_flops_per_token_without_lm_head, peak_lr=optim.hyper(cfg).peak_lr)  # fmt: skip


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
    from moelab.train.branch import branch_point

    ev = branch_point(run_dir)
    run.group = ev["parent"] if ev else str(run_dir.resolve())  # a branch shares its parent's seed
    return run


def shared_prefixes_once(runs: list[L.Run]) -> list[L.Run]:
    """A branch (moelab.train.branch) holds its parent's evaluations up to the branch step: when the
    parent is among ``runs`` too, the branch keeps only its own, so that no measurement counts twice."""
    from moelab.train.branch import branch_point

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


# ------------------------------------------------------------------------------ per-fraction


def forecast_per_fraction(
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
        if len(set(c[idx].tolist())) < 2:  # two seeds of one size are one size: no line through them
            continue
        preds.append(float(fit_power(c[idx], loss[idx], e=e, n_boot=0).predict(ct)))
    return np.array(preds) if preds else np.array([np.nan])


# ---------------------------------------------------------------------------- joint law


def fitted(runs: list[L.Run], min_fraction: float = MIN_FRACTION) -> list[L.Run]:
    """Each run cut to its evaluations from ``min_fraction`` of its run on (the fast early drop
    before that is warm-up and transient, not the law's business)."""
    out = []
    for r in runs:
        keep = r.steps >= min_fraction * r.total_steps - 0.5
        if np.any(keep):
            cut = r.with_loss(r.steps[keep], r.loss[keep])
            cut.dir = r.dir
            out.append(cut)
    return out


MIN_DOF = 3  # every variance the band uses is known with at least this many degrees of freedom


def _lineages(runs: list[L.Run]) -> list[list[int]]:
    """Indices of the runs of each lineage (a run and the branches that share its seed's offset)."""
    order: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        order.setdefault(r.lineage, []).append(i)
    return list(order.values())


def estimate_noise(fit: L.LawFit, runs: list[L.Run], floor: dict | None = None) -> dict:
    """The residuals' structure (log-loss): each lineage's offset from the law (a seed: a run and its
    branches share one) and the noise about it, point to point.

    rung: the spread of the lineages' offsets, two degrees of freedom spent on the size term (A, alpha);
    point: the spread about each run's offset; rho: its lag-1 autocorrelation. ``floor`` ({"sd", "dof"}:
    a run-to-run spread measured apart, a noise floor) is pooled with the offsets' spread."""
    res = [np.log(r.loss) - np.log(np.maximum(fit.predict(r), 1e-9)) for r in runs]
    within = [x - x.mean() for x in res]
    n = sum(len(x) for x in res)
    point = math.sqrt(sum(float(np.sum(w * w)) for w in within) / max(n - len(res), 1))
    num = sum(float(np.sum(w[1:] * w[:-1])) for w in within if len(w) > 1)
    den = sum(float(np.sum(w * w)) for w in within if len(w) > 1)
    rho = float(np.clip(num / den, 0.0, 0.95)) if den > 0 else 0.0
    inflate = (1 + rho) / (1 - rho)  # the variance of a mean of autocorrelated points
    groups = _lineages(runs)
    means = np.array([np.concatenate([res[i] for i in g]).mean() for g in groups])
    sizes = [sum(len(res[i]) for i in g) for g in groups]
    dof = len(groups) - 2
    mean_var = float(np.mean([point**2 * inflate / k for k in sizes]))
    var = max(float(np.sum(means**2)) / max(dof, 1) - mean_var, 1e-8)
    out = {"rung": math.sqrt(var), "point": point, "rho": rho, "dof": float(max(dof, 0)), "lineages": len(groups),
           "offsets": [float(m) for m in means]}  # fmt: skip
    if floor:
        k = float(floor["dof"])
        pooled = (max(dof, 0) * var + k * float(floor["sd"]) ** 2) / (max(dof, 0) + k)
        out.update(rung=math.sqrt(pooled), dof=max(dof, 0) + k, floor=dict(floor), ladder_rung=math.sqrt(var))
    return out


def _ar1(rng, n: int, sigma: float, rho: float) -> np.ndarray:
    e = np.empty(n)
    e[0] = rng.normal(0.0, sigma)
    innov = sigma * math.sqrt(1.0 - rho * rho)
    for i in range(1, n):
        e[i] = rho * e[i - 1] + rng.normal(0.0, innov)
    return e


def draw_ladder(rng, fit: L.LawFit, runs: list[L.Run], noise: dict, rung_sd: float | None = None) -> list[L.Run]:
    """Synthetic runs: the law's values at each run's points, each lineage off by an offset of its own
    (sd ``rung_sd``, the measured one by default) and each run noisy from point to point."""
    sd = noise["rung"] if rung_sd is None else rung_sd
    offset = {}
    out = []
    for r in runs:
        if r.lineage not in offset:
            offset[r.lineage] = rng.normal(0.0, sd)
        dev = offset[r.lineage] + _ar1(rng, len(r.steps), noise["point"], noise["rho"])
        out.append(r.with_loss(r.steps, fit.predict(r) * np.exp(dev)))
    return out


def corrected_noise(fit: L.LawFit, runs: list[L.Run], noise: dict, rng, draws: int = 30) -> dict:
    """The residuals' noise with its bias removed. A law of several parameters absorbs part of
    every lineage's offset and of the noise about it, so the residuals read them low (with four rungs,
    by half or more). Ladders drawn with the estimate and refitted show by how much: each spread is
    scaled by estimate / (its re-estimate on those ladders), the autocorrelation moved by its shift.
    A pooled noise floor (``noise["floor"]``) is left as it was measured."""
    seen = []
    for _ in range(draws):
        synth = draw_ladder(rng, fit, runs, noise)
        try:
            seen.append(estimate_noise(L.fit_law(synth, fit.law, start=fit, e_fixed=_fixed_e(fit)), synth))
        except L.LawError:
            continue
    if not seen:
        return dict(noise)
    out = dict(noise)
    keys = ("point",) if "floor" in noise else ("rung", "point")
    for key in keys:
        again = math.sqrt(np.mean([x[key] ** 2 for x in seen]))
        out[key] = noise[key] * noise[key] / max(again, 1e-12)
    out["rho"] = float(np.clip(2 * noise["rho"] - np.mean([x["rho"] for x in seen]), 0.0, 0.95))
    out["measured"] = {k: noise[k] for k in ("rung", "point", "rho")}
    return out


def _fixed_e(fit: L.LawFit) -> float | None:
    return fit.linear[0] if "E" in fit.fixed else None


def model_error(
    use: list[L.Run],
    law: str,
    noise: dict,
    target: L.Run,
    e_fixed: float | None = None,
    min_fraction: float = MIN_FRACTION,
) -> dict:
    """What the law misses beyond noise, measured by leaving each size out: the law fitted to the other
    sizes forecasts the held-out size's runs (their mean log-error past 20% of each run). The excess of
    those errors' mean square over what the noise alone gives (the lineage spread, the point noise's
    share of a run's mean) is the model error's variance, with one degree of freedom per size left
    out. It is assumed to grow with the distance in log-size: at the target, scaled by its distance
    from the nearest size fitted over the folds' mean distance (never below 1).

    The same forecasts of left-out sizes measure how far a clean run moves off its own level against
    its forecast from one evaluation to the next (``track``: the rms of ``health.departures`` over
    every left-out run's points), the width the health check's forecast_track is held to."""
    sizes = sorted({r.n for r in use})
    folds, track = [], []
    for n in sizes:
        rest, held = [r for r in use if r.n != n], [r for r in use if r.n == n]
        try:
            f = L.fit_law(rest, law, e_fixed=e_fixed)
        except L.LawError:
            continue
        errs, counts = [], []
        for r in held:
            late = r.steps > 0.2 * r.total_steps + 1e-9
            if np.any(late):
                errs.append(float(np.mean(np.log(f.predict(r)[late] / r.loss[late]))))
                counts.append(int(late.sum()))
            d = departures(r.steps / r.total_steps, np.log(r.loss / f.predict(r)), min_fraction)
            track.extend(float(x) for x in d[np.isfinite(d)])
        if errs:
            others = [m for m in sizes if m != n]
            folds.append({"n": float(n), "error": float(np.mean(errs)), "points": counts,
                          "distance": float(min(abs(math.log(n / m)) for m in others)),
                          "extrapolation": bool(n > max(others) or n < min(others))})  # fmt: skip
    tracked = {"rms": math.sqrt(float(np.mean(np.square(track)))) if track else None,
               "max": float(np.max(np.abs(track))) if track else None, "points": len(track)}  # fmt: skip
    inflate = (1 + noise["rho"]) / (1 - noise["rho"])
    # what noise alone gives a fold's error: its runs' offset and the mean of their late points' noise
    expected = float(np.mean([noise["rung"] ** 2 + noise["point"] ** 2 * inflate / np.mean(f["points"])
                              for f in folds])) if folds else 0.0  # fmt: skip
    if len(folds) < MIN_DOF:
        return {"sd": 0.0, "dof": float(len(folds)), "folds": folds, "expected_sd": math.sqrt(expected),
                "note": f"{len(folds)} sizes could be left out; the model error needs {MIN_DOF}", "track": tracked}  # fmt: skip
    mse = float(np.mean([f["error"] ** 2 for f in folds]))
    ref = float(np.mean([f["distance"] for f in folds]))
    dist = float(min(abs(math.log(target.n / m)) for m in sizes))
    # never 0 where the law missed a left-out end rung: at least the rms of those misses (the noise's
    # share of them cannot be told apart with so few folds; the band errs wide, not narrow)
    ends = [f["error"] for f in folds if f["extrapolation"]]
    sd = max(math.sqrt(max(mse - expected, 0.0)), math.sqrt(float(np.mean(np.square(ends)))) if ends else 0.0)
    return {"sd": sd, "dof": float(len(folds)), "folds": folds,
            "rms": math.sqrt(mse), "expected_sd": math.sqrt(expected), "distance_ref": ref, "target_distance": dist,
            "scale": max(1.0, dist / ref) if ref > 0 else 1.0, "track": tracked}  # fmt: skip


def joint_band(
    fit: L.LawFit,
    runs: list[L.Run],
    target: L.Run,
    noise: dict,
    n_boot: int = 200,
    level: float = LEVEL,
    seed: int = 0,
    model: dict | None = None,
    params: list | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The band (low, high) for the target's measured loss at its steps: see the module's docstring.
    ``noise`` is the corrected one (``corrected_noise``); ``model`` the model error (``model_error``),
    drawn as a Student t with its degrees of freedom; each refit's parameters go to ``params``."""
    rng = np.random.default_rng(seed)
    base = fit.predict(target)
    draws = []
    dof = max(noise["dof"], 1.0)
    m_sd = (model or {}).get("sd", 0.0) * (model or {}).get("scale", 1.0)
    for _ in range(n_boot):
        sd = noise["rung"] * math.sqrt(dof / rng.chisquare(dof))
        synth = draw_ladder(rng, fit, runs, noise, sd)
        try:
            refit = L.fit_law(synth, fit.law, start=[fit, *fit.alternatives], e_fixed=_fixed_e(fit))
        except L.LawError:
            continue
        dev = rng.normal(0.0, sd) + _ar1(rng, len(target.steps), noise["point"], noise["rho"])
        if m_sd > 0:
            dev = dev + m_sd * rng.standard_t(model["dof"])
        draws.append(refit.predict(target) * np.exp(dev))
        if params is not None:
            params.append(refit.params())
    if not draws:
        return base, base
    draws = np.array(draws)
    q = (1 - level) / 2
    return np.quantile(draws, q, axis=0), np.quantile(draws, 1 - q, axis=0)


def e_sensitivity(use: list[L.Run], fit: L.LawFit, target: L.Run, step: float = 0.5) -> dict:
    """How much the forecast's final loss moves when E is held away from its fitted value (by
    ``step`` nats either way, within [0, the smallest loss)), and how much worse the fit gets: a ladder
    that cannot tell E moves the forecast while barely changing the fit."""
    e0 = fit.linear[0]
    lo_loss = float(min(r.loss.min() for r in use))
    out = {"E": e0, "final": float(fit.predict(target)[-1]), "objective": fit.objective, "moves": []}
    for e in (e0 - step, e0 + step):
        if not 0.0 <= e < lo_loss:
            continue
        try:
            f = L.fit_law(use, fit.law, e_fixed=e)
        except L.LawError:
            continue
        final = float(f.predict(target)[-1])
        out["moves"].append({"E": e, "final": final, "final_change": final / out["final"] - 1,
                             "objective_ratio": f.objective / max(fit.objective, 1e-30)})  # fmt: skip
    if out["moves"]:
        out["final_change_per_nat"] = float(np.mean([abs(m["final_change"]) / step for m in out["moves"]]))
    return out


def forecast_joint(
    rungs: list[L.Run],
    target: L.Run,
    law: str = L.DEFAULT_LAW,
    n_boot: int = 200,
    level: float = LEVEL,
    min_fraction: float = MIN_FRACTION,
    curve_points: int = 100,
    correct: bool = True,
    e_fixed: float | None = None,
    floor: dict | None = None,
    model: bool = True,
    min_dof: float = MIN_DOF,
) -> dict:
    """The target's loss at its evaluation steps (and on a dense grid for plots), with the band.

    ``e_fixed`` holds E; ``floor`` ({"sd", "dof"}) pools a run-to-run spread measured apart with the
    lineages' own; ``model=False`` leaves out the model error (leave-one-size-out); ``correct=False``
    draws the band from the residuals' noise as read (too low; for comparison). A band whose spread
    of runs is known with fewer than ``min_dof`` degrees of freedom is refused (LawError)."""
    use = fitted(rungs, min_fraction)
    fit = L.fit_law(use, law, e_fixed=e_fixed)
    noise = estimate_noise(fit, use, floor)
    if noise["dof"] < min_dof:
        raise L.LawError(
            f"the run-to-run spread is known with {noise['dof']:g} degrees of freedom (independent runs, that is "
            f"seeds, minus two); the band needs {min_dof:g}: train a second seed of some rungs, or more sizes"
        )
    if correct:
        noise = corrected_noise(fit, use, noise, np.random.default_rng(1))
    merr = model_error(use, law, noise, target, e_fixed, min_fraction) if model else None
    first = float(target.steps.min())  # the law is not drawn before the first evaluation (warm-up)
    grid = np.unique(np.concatenate([np.linspace(first, target.total_steps, curve_points).round(), target.steps]))
    dense = target.blind(grid)
    draws: list = []
    low, high = joint_band(fit, use, dense, noise, n_boot, level, model=merr, params=draws)
    pred = fit.predict(dense)
    at = np.searchsorted(grid, target.steps)
    steps = [int(s) for s in target.steps]
    q = (1 - level) / 2
    intervals = {k: {"value": v, "low": float(np.quantile([d[k] for d in draws], q)),
                     "high": float(np.quantile([d[k] for d in draws], 1 - q))}
                 for k, v in fit.params().items()} if draws else {}  # fmt: skip
    warnings = [f"{p} ends on a bound of its range (the ladder does not pin it down)" for p in fit.at_bound]
    if not fit.converged:
        warnings.append("the fit stopped at its evaluation cap before its tolerance (not converged)")
    sens = e_sensitivity(use, fit, target) if e_fixed is None else None
    if sens and "E" in fit.at_bound and sens.get("moves"):
        warnings.append(f"E: the forecast's final loss moves {sens['final_change_per_nat']:.1%} per nat of E")
    if merr and merr["dof"] < min_dof:
        warnings.append(f"model error not measured: {merr['note']}")
    return {
        "law": law,
        "fit": fit.to_dict(),
        "params": intervals,
        "e_fixed": e_fixed,
        "e_sensitivity": sens,
        "noise": noise,
        "model_error": merr,
        "warnings": warnings,
        "band": {
            "level": level,
            "n_boot": n_boot,
            "dof": {"rung": noise["dof"], "model": (merr or {}).get("dof")},
            "method": "parametric bootstrap: lineage offsets, AR(1) noise, leave-one-size-out model error",
        },  # fmt: skip
        "min_fraction": min_fraction,
        # what the health check's forecast_track is held to (monitor/health.py): None without a model error
        "track": (merr or {}).get("track"),
        "fractions": [s / target.total_steps for s in steps],
        "steps": steps,
        "loss": [float(x) for x in pred[at]],
        "low": [float(x) for x in low[at]],
        "high": [float(x) for x in high[at]],
        "curve": {"steps": [int(s) for s in grid], "loss": pred.tolist(), "low": low.tolist(), "high": high.tolist()},
    }


# --------------------------------------------------------------------------------- one entry


def forecast(
    rung_dirs: list,
    target_cfg: Config,
    law: str = L.DEFAULT_LAW,
    e: float | None = None,
    n_boot: int = 200,
    target_name: str | None = None,
    log=None,
    agg: str = AGG,
    floor: dict | None = None,
    prior: dict | None = None,
) -> dict:
    """forecast.json for ``target_cfg`` from the rungs' run directories, by ``law``, of the held-out
    loss ``agg`` (mix or macro); ``e`` holds the law's E at that value; ``prior`` (a prior file's
    content, moelab.ladder.prior) is what the prior laws take from it; ``log(text)`` hears what it is
    doing once the rungs are read."""
    if law not in LAW_CHOICES:
        raise ForecastError(f"--law: unknown law {law!r} (known: {', '.join(LAW_CHOICES)})")
    target = target_run(target_cfg, target_name)
    flops = target.flops_per_token * target.tokens_per_step * target.total_steps
    if law == "per-fraction":
        curves = [rung_curve(d, agg=agg) for d in rung_dirs]
        if log:
            log(f"fitting {law} at every 5% across {len(curves)} rungs, with a bootstrap band ...")
        fc = forecast_per_fraction(curves, flops, target.total_steps, e=e, n_boot=n_boot)
        if not fc["fractions"]:
            raise ForecastError("--ladder: fewer than two rungs have evaluations at the same fractions")
        fc["law"] = law
    elif law in L.PRIOR_LAWS:
        from moelab.ladder import prior as P

        if prior is None:
            raise ForecastError(f"--law {law}: no prior given; it needs the recipe's prior file (--prior)")
        pr = P.Prior.from_dict(prior) if isinstance(prior, dict) else prior
        curves = [rung_curve(d, agg=agg) for d in rung_dirs]
        if log:
            log(f"fitting {law} at every 5% across {len(curves)} rungs (prior {pr.key}), with its band ...")
        chain = P.forward_chain(curves, pr)  # the score kept with every forecast
        use = chain["chosen"] if law == "prior" and chain["chosen"] else ("prior-alpha" if law == "prior" else law)
        fc = P.forecast_prior(curves, flops, target.total_steps, pr, use, n_boot=max(n_boot, 400))
        fc.update(law=law, fitted_by=use, forward_chain=chain)
        fc["prior"] = {"key": pr.key, "version": pr.version, "corpora": pr.corpora, "created": pr.created}
    else:
        runs = shared_prefixes_once([rung_run(d, agg=agg) for d in rung_dirs])
        try:
            L.check(fitted(runs), law)
        except L.LawError as exc:
            raise ForecastError(f"--ladder: {exc}") from None
        if log:
            log(
                f"fitting {law} to {sum(len(r.steps) for r in runs)} evaluations of {len(runs)} rungs and drawing its band ..."
            )
        try:
            fc = forecast_joint(runs, target, law, n_boot=n_boot, e_fixed=e, floor=floor)
        except L.LawError as exc:
            raise ForecastError(f"--ladder: {exc}") from None
    fc.update(target=target.name, target_flops=flops, target_steps=target.total_steps,
              rungs=[str(d) for d in rung_dirs], e=e, metric=agg)  # fmt: skip
    return fc


def backtest(
    rungs: list[L.Run], target: L.Run, law: str = L.DEFAULT_LAW, n_boot: int = 100, e: float | None = None, **joint
) -> dict:
    """Fit on ``rungs`` only and predict ``target``'s measured curve: the error at each evaluation,
    the mean and largest past 20% of the run, the final one, and how often the band held the truth.
    ``e`` holds E (Marin's form, or a joint law's)."""
    if law == "per-fraction":
        curves = [_curve_of(r) for r in rungs]
        tc = _curve_of(target)
        fc = forecast_per_fraction(curves, tc["flops"], target.total_steps, e=e, n_boot=n_boot)
    else:
        fc = forecast_joint(rungs, target.blind(), law, n_boot=n_boot, e_fixed=e, **joint)  # never sees the losses
    rows = scored(fc, target)
    return {"law": law, "target": target.name, "curve": rows, **summarize(rows), "forecast": fc}


def scored(fc: dict, target: L.Run) -> list[dict]:
    """A forecast's points (``steps``, ``loss``, ``low``, ``high``) at the steps ``target`` measured:
    the error of each, and whether the band held what the run measured."""
    actual = dict(zip(target.steps.astype(int).tolist(), target.loss, strict=True))
    return [
        {"step": s, "fraction": s / target.total_steps, "predicted": p, "low": lo, "high": hi, "actual": actual[s],
         "error": p / actual[s] - 1, "inside": bool(lo <= actual[s] <= hi)}
        for s, p, lo, hi in zip(fc["steps"], fc["loss"], fc["low"], fc["high"], strict=True) if s in actual
    ]  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """Mean and largest |error| past 20% of the run, the final error, and the band's coverage."""
    late = [r for r in rows if r["fraction"] > 0.2 + 1e-9]
    return {
        "mean_abs_error_past_20": float(np.mean([abs(r["error"]) for r in late])) if late else math.nan,
        "max_abs_error_past_20": float(np.max([abs(r["error"]) for r in late])) if late else math.nan,
        "final_error": rows[-1]["error"] if rows else math.nan,
        "final_band": [rows[-1]["low"], rows[-1]["high"]] if rows else None,
        "coverage": float(np.mean([r["inside"] for r in rows])) if rows else math.nan,
    }


def ends(rungs: list[dict], e: float | None = None) -> list[dict]:
    """Marin's check: each rung's end extrapolated from its own 60-80% window (per-fraction curves)."""
    out = []
    for r in rungs:
        window = [(f, v) for f, v in r["fractions"].items() if 0.6 <= f <= 0.8 + 1e-9]
        if len(window) >= 3 and 1.0 in r["fractions"]:
            c = np.array([r["flops"] * f for f, _ in window])
            fit = fit_power(c, np.array([v for _, v in window]), e=e, n_boot=0)
            pred = float(fit.predict(r["flops"]))
            out.append({"rung": r["name"], "predicted_end": pred, "actual_end": r["fractions"][1.0],
                        "error": pred / r["fractions"][1.0] - 1})  # fmt: skip
    return out


# ----------------------------------------------------------------------------- updates in a run


def update_forecast(registered: dict, prefix: L.Run, rungs: list[L.Run], n_boot: int = 40) -> dict | None:
    """The registered forecast refitted with the target's own evaluations so far (``prefix``, a
    run with the target's schedule and the losses measured up to now) added to the rungs': the
    same law, started from the registered fit. An update is recorded beside the registered forecast
    and never replaces it; None when the prefix has no evaluation the law is fitted to yet."""
    law = registered.get("law")
    if law not in L.LAWS:
        return None
    min_fraction = registered.get("min_fraction", MIN_FRACTION)
    own = fitted([prefix], min_fraction)
    if not own:
        return None
    use = fitted(rungs, min_fraction) + own
    start = L.LawFit.from_dict(registered["fit"])
    fit = L.fit_law(use, law, start=start, e_fixed=_fixed_e(start))
    noise = corrected_noise(fit, use, estimate_noise(fit, use), np.random.default_rng(1), draws=15)
    target = prefix.blind(registered["steps"])
    low, high = joint_band(fit, use, target, noise, n_boot, registered.get("band", {}).get("level", LEVEL))
    pred = fit.predict(target)
    return {
        "at_step": int(prefix.steps[-1]),
        "points_of_target": len(own[0].steps),
        "law": law,
        "fit": fit.to_dict(),
        "noise": noise,
        "steps": registered["steps"],
        "loss": pred.tolist(),
        "low": low.tolist(),
        "high": high.tolist(),
        "final": {"loss": float(pred[-1]), "low": float(low[-1]), "high": float(high[-1])},
    }


# ------------------------------------------------------------------------------- calibration


def calibration(
    truth: L.LawFit,
    rungs: list[L.Run],
    target: L.Run,
    noise: dict,
    n_ladders: int = 200,
    n_boot: int = 50,
    level: float = LEVEL,
    law: str | None = None,
    seed: int = 0,
    progress=None,
    correct: bool = True,
) -> dict:
    """How often the band holds the truth, on synthetic ladders: every run (rungs and target) is
    ``truth``'s curve at its own points, off by an offset of its own and noisy from point to point
    (``noise``: rung and point sd, rho). Each synthetic ladder is forecast exactly as a real one is
    (the same law, fit and band), and each of the synthetic target's points is in the band or not.
    ``progress(i)`` is called after each ladder."""
    law = law or truth.law
    inside, errors, finals = [], [], []
    for i in range(n_ladders):
        rng = np.random.default_rng([seed, i])
        *synth, truth_t = draw_ladder(rng, truth, [*rungs, target], noise)
        blind = target.blind()
        try:
            fc = forecast_joint(synth, blind, law, n_boot=n_boot, level=level, correct=correct, model=False, min_dof=1)
        except L.LawError:
            continue
        pred, lo, hi = (np.asarray(fc[k]) for k in ("loss", "low", "high"))
        inside.append((lo <= truth_t.loss) & (truth_t.loss <= hi))
        errors.append(pred / truth_t.loss - 1)
        finals.append(hi[-1] / pred[-1] - 1)
        if progress:
            progress(i)
    inside, errors = np.array(inside), np.array(errors)
    fractions = target.steps / target.total_steps
    return {
        "law": law,
        "level": level,
        "ladders": len(inside),
        "coverage": float(inside.mean()),
        "coverage_by_fraction": {f"{f:.2f}": float(c) for f, c in zip(fractions, inside.mean(axis=0), strict=True)},
        "coverage_per_ladder": [float(x) for x in inside.mean(axis=1)],
        "mean_abs_error_past_20": float(np.mean(np.abs(errors[:, fractions > 0.2 + 1e-9]))),
        "final_half_width": float(np.median(finals)),
        # what the band's width should match: the forecasts' own errors at the last point
        "final_error_rms": float(np.sqrt(np.mean(errors[:, -1] ** 2))) if len(errors) else float("nan"),
        "noise": {k: noise[k] for k in ("rung", "point", "rho", "dof")},
    }
