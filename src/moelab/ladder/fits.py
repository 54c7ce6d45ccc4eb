"""Scaling-law fits: Marin's L(C) = E + A * C^-alpha per fraction of training, and Chinchilla's
L(N, D) = E + A / N^alpha + B / D^beta fitted with a Huber loss on log-loss (Hoffmann et al.;
Epoch AI's replication).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp


def huber(r: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _chinchilla_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float):
    """Summed Huber of log L_hat - log L, and its gradient; theta = (a, b, e, alpha, beta), A = e^a."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    pred = logsumexp(terms, axis=0)
    r = pred - log_l
    w = np.exp(terms - pred)  # softmax weights: d pred / d term
    dh = np.clip(r, -delta, delta)  # Huber's derivative
    grad = np.array([
        np.sum(dh * w[0]),
        np.sum(dh * w[1]),
        np.sum(dh * w[2]),
        np.sum(dh * w[0] * -log_n),
        np.sum(dh * w[1] * -log_d),
    ])  # fmt: skip
    return float(np.sum(huber(r, delta))), grad


@dataclass(frozen=True)
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float

    def predict(self, n, d):
        return self.E + self.A / np.asarray(n, float) ** self.alpha + self.B / np.asarray(d, float) ** self.beta


def _projection_starts(n, d, loss, log_l, delta: float, keep: int) -> list[np.ndarray]:
    """Variable projection: for each (alpha, beta) on a grid the model is linear in (E, A, B), so
    non-negative least squares gives them; the best few by the Huber objective seed L-BFGS."""
    from scipy.optimize import nnls

    scored = []
    for alpha in np.arange(0.05, 1.01, 0.05):
        x = n**-alpha
        for beta in np.arange(0.05, 1.01, 0.05):
            y = d**-beta
            coef, _ = nnls(np.stack([np.ones_like(x), x, y], axis=1), loss)
            e, a, b = np.maximum(coef, 1e-8)
            theta = np.array([np.log(a), np.log(b), np.log(e), alpha, beta])
            scored.append((_chinchilla_objective(theta, np.log(n), np.log(d), log_l, delta)[0], theta))
    scored.sort(key=lambda t: t[0])
    return [t for _, t in scored[:keep]]


def fit_chinchilla(
    n, d, loss, delta: float = 1e-3, method: str = "projection", grid: dict | None = None
) -> ChinchillaFit:
    """Huber (delta) on log-loss, minimised by L-BFGS from several starts; the best objective wins.

    method="projection": 40 starts from variable projection over (alpha, beta) (a few seconds);
    method="grid": Hoffmann et al.'s grid of 4,500 starting points (about a minute).
    """
    n, d, loss = np.asarray(n, float), np.asarray(d, float), np.asarray(loss, float)
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    if method == "projection":
        starts = _projection_starts(n, d, loss, log_l, delta, keep=40)
    else:
        starts = _grid_starts(grid)
    best = None
    for start in starts:
        # the Huber objective is flat near its minimum: tight tolerances, or L-BFGS stops short
        res = minimize(
            _chinchilla_objective,
            np.array(start, float),
            args=(log_n, log_d, log_l, delta),
            jac=True,
            method="L-BFGS-B",
            options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 15000},
        )
        if best is None or res.fun < best.fun:
            best = res
    a, b, e, alpha, beta = best.x
    return ChinchillaFit(
        float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), float(alpha), float(beta), float(best.fun)
    )


def _grid_starts(grid: dict | None) -> list:
    grid = grid or {
        "a": np.arange(0, 30, 5.0),
        "b": np.arange(0, 30, 5.0),
        "e": np.arange(-1, 1.5, 0.5),
        "alpha": np.arange(0, 2.5, 0.5),
        "beta": np.arange(0, 2.5, 0.5),
    }
    return list(itertools.product(grid["a"], grid["b"], grid["e"], grid["alpha"], grid["beta"]))


@dataclass(frozen=True)
class PowerFit:
    """L(C) = E + A * C^-alpha, with bootstrap intervals (5th, 95th percentiles) on each."""

    E: float
    A: float
    alpha: float
    intervals: dict

    def predict(self, c):
        return self.E + self.A * np.asarray(c, float) ** -self.alpha


def _fit_line(c: np.ndarray, loss: np.ndarray, e: float) -> tuple[float, float]:
    """log(L - E) = log A - alpha log C, by least squares."""
    y = np.log(np.maximum(loss - e, 1e-12))
    slope, intercept = np.polyfit(np.log(c), y, 1)
    return float(np.exp(intercept)), float(-slope)


def fit_power(c, loss, e: float | None = None, n_boot: int = 200, seed: int = 0) -> PowerFit:
    """Marin's form. With E given (Marin: 1.5) a straight line in log-log; otherwise E is fitted too."""
    c, loss = np.asarray(c, float), np.asarray(loss, float)

    def one(cc, ll):
        if e is not None:
            a, alpha = _fit_line(cc, ll, e)
            return e, a, alpha
        best = None
        for e0 in np.linspace(0.0, 0.99 * ll.min(), 12):
            a, alpha = _fit_line(cc, ll, e0)
            err = np.sum((np.log(e0 + a * cc**-alpha) - np.log(ll)) ** 2)
            if best is None or err < best[0]:
                best = (err, e0, a, alpha)

        def obj(t):
            return np.sum((np.log(np.maximum(t[0] + np.exp(t[1]) * cc ** -t[2], 1e-12)) - np.log(ll)) ** 2)

        res = minimize(
            obj,
            np.array([best[1], np.log(best[2]), best[3]]),
            method="Nelder-Mead",
            options={"xatol": 1e-8, "fatol": 1e-12, "maxiter": 4000},
        )
        return float(res.x[0]), float(np.exp(res.x[1])), float(res.x[2])

    E, A, alpha = one(c, loss)
    if n_boot == 0:
        return PowerFit(E, A, alpha, {})
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(c), len(c))
        if len(set(c[idx])) < 2:
            continue
        boots.append(one(c[idx], loss[idx]))
    boots = np.array(boots)
    intervals = {
        k: (float(np.percentile(boots[:, i], 5)), float(np.percentile(boots[:, i], 95)))
        for i, k in enumerate(("E", "A", "alpha"))
    }
    return PowerFit(E, A, alpha, intervals)
