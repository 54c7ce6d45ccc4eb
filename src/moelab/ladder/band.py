"""The band of a joint law's forecast (moelab.ladder.forecast.forecast_joint), and the noise it is
drawn with.

The band of a joint law is a parametric bootstrap from the fit's own residuals: each rung's curve
sits off the law by an offset of its own (a seed, a shape) plus noise from point to point, both
measured from the residuals. Synthetic ladders are drawn from the fitted law with that noise, the
law refitted to each, and the target read with an offset and noise of its own; the band is the
5th-95th percentile of those readings. Four rungs measure the offsets' spread with few degrees of
freedom, so each draw first draws that spread from its sampling distribution (a scaled inverse
chi-square): the band widens as a Student t does, instead of trusting a spread seen in four numbers.

The residuals read that noise low (a law of several parameters absorbs part of it): ``corrected_noise``
measures by how much on ladders drawn with it. ``model_error`` adds what the law misses beyond noise,
measured by leaving each size out.
"""

from __future__ import annotations

import math

import numpy as np

from moelab.ladder import law as L
from moelab.monitor.health import departures

MIN_FRACTION = 0.1  # a joint law is fitted to evaluations from this fraction of each run on
LEVEL = 0.9  # the band's nominal coverage


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
