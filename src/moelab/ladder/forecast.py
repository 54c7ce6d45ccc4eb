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

The band of a joint law: moelab.ladder.band; the rungs' and the target's curves as a forecast reads
them: moelab.ladder.curves (both importable from here as before). Here: the forecasts, the backtests
that check them, the updates of a registered forecast in a run, and the band's calibration.
"""

from __future__ import annotations

import math

import numpy as np

from moelab.config import Config
from moelab.errors import ForecastError
from moelab.ladder import law as L
from moelab.ladder import prior as P
from moelab.ladder.band import (  # noqa: F401 - the band's parts, importable from here
    LEVEL,
    MIN_DOF,
    MIN_FRACTION,
    _fixed_e,
    corrected_noise,
    draw_ladder,
    e_sensitivity,
    estimate_noise,
    fitted,
    joint_band,
    model_error,
)
from moelab.ladder.curves import (  # noqa: F401 - the curves' readers, importable from here
    AGG,
    _curve_of,
    _run_config,
    held_out,
    lr_schedule,
    rung_curve,
    rung_run,
    shared_prefixes_once,
    target_run,
)
from moelab.ladder.fits import fit_power

FRACTIONS = [k / 20 for k in range(1, 21)]
LAW_CHOICES = L.LAW_CHOICES


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
