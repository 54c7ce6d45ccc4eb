"""Laws for whole loss curves across a ladder's rungs: one fit over every evaluation of every rung.

A law gives the held-out loss of a run of size N (active parameters) after t updates of its
learning-rate schedule, so one set of parameters spans the rungs and forecasts runs, schedules
and horizons the rungs never ran. With lr(s) the schedule as a multiple of its peak and tau the
tokens per step, the data term reads the tokens seen weighted by the rate, D(t) = tau * sum_{s<t} lr(s),
and each decrease of the rate after its peak, lr(k-1) - lr(k), buys a loss reduction that arrives
as training goes on after it:

    lr-annealing (Tissue et al. 2024, with a size term):
        L = E + A N^-alpha + B D(t)^-beta - K sum_k (lr(k-1) - lr(k)) (1 - exp(-tau (t - k) / T))
    chinchilla (Hoffmann et al. 2022 over tokens seen, blind to the schedule):
        L = E + A N^-alpha + B (tau t)^-beta

Fitted with a Huber loss on log-loss, from several starts found by variable projection (for
fixed exponents the law is linear in E, A, B, K: non-negative least squares gives them), within
bounds that keep it physical (E > 0, exponents in [0.02, 2]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares, nnls

from moelab.errors import LawError
from moelab.ladder import DEFAULT_LAW, LAW_CHOICES, LAWS, PRIOR_LAWS  # noqa: F401 - kept light for the command line

BINS = 192  # the rate's decreases are summed in at most this many groups per run (eval steps are edges)
# on log-loss: residuals past 1% count linearly. At the measured noise (issue 37: point noise 0.55-1.0%,
# seed offsets 0.6-1.5%); the 0.2% it was made every fit an L1 fit
HUBER_DELTA = 1e-2


@dataclass
class Run:
    """What a law needs of one run: its size, its schedule and, for a rung, its held-out loss."""

    name: str
    n: float  # active parameters (Marin's definition)
    tokens_per_step: float
    lr: np.ndarray  # [steps] the rate applied by update s, as a multiple of the peak
    steps: np.ndarray  # [points] evaluation steps (after that many updates), > 0
    loss: np.ndarray | None = None  # [points] held-out loss at those steps; None for a target
    flops_per_token: float = 0.0  # training FLOPs per token without the LM head (for the per-fraction form)
    dir: str = ""
    _feat: dict = field(default_factory=dict, repr=False)
    peak_lr: float = 1.0  # the peak rate in absolute terms (the ``-peak`` laws scale the annealing by it)
    group: str = ""  # runs of one lineage (a run and its branches share their seed's offset); "" = its own

    @property
    def total_steps(self) -> int:
        return len(self.lr)

    def with_loss(self, steps, loss) -> Run:
        """The same run with other losses (at other steps); the schedule's features are shared
        when the steps are the same."""
        steps = np.asarray(steps, float)
        same = len(steps) == len(self.steps) and np.array_equal(steps, self.steps)
        return Run(self.name, self.n, self.tokens_per_step, self.lr, steps, np.asarray(loss, float),
                   self.flops_per_token, self.dir, self._feat if same else {}, self.peak_lr, self.group)  # fmt: skip

    def blind(self, steps=None) -> Run:
        """The same run without its losses (at other ``steps`` if given): a target to forecast."""
        if steps is None:
            return Run(self.name, self.n, self.tokens_per_step, self.lr, self.steps, None, self.flops_per_token,
                       self.dir, self._feat, self.peak_lr, self.group)  # fmt: skip
        return Run(self.name, self.n, self.tokens_per_step, self.lr, np.asarray(steps, float), None,
                   self.flops_per_token, self.dir, {}, self.peak_lr, self.group)  # fmt: skip

    @property
    def lineage(self) -> str:
        return self.group or self.dir or self.name

    def features(self) -> dict:
        """Tokens seen, rate-weighted tokens, and the rate's decreases grouped for the annealing sums."""
        if self._feat:
            return self._feat
        lr, tau = np.asarray(self.lr, float), float(self.tokens_per_step)
        t = np.asarray(self.steps, float).astype(int)
        if np.any(t < 1) or np.any(t > len(lr)):
            raise LawError(f"{self.name}: evaluation steps must lie in 1..{len(lr)}")
        cum = np.concatenate([[0.0], np.cumsum(lr)])  # cum[t] = sum_{s<t} lr(s)
        peak = int(np.argmax(lr))
        delta = np.zeros(len(lr))
        delta[peak + 1 :] = lr[peak:-1] - lr[peak + 1 :]  # delta[k] = lr(k-1) - lr(k), after the peak
        # groups of consecutive updates with the evaluation steps as edges: a group is wholly before
        # or wholly after every evaluation; each is summarised by its summed decrease and the
        # decrease-weighted mean of its start area and start step
        edges = np.unique(np.concatenate([np.linspace(peak + 1, len(lr), BINS + 1).round(), t, [peak + 1, len(lr)]]))
        edges = edges[(edges >= peak + 1) & (edges <= len(lr))].astype(int)
        g_delta, g_area, g_step = [], [], []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            d = delta[a:b]
            w = float(d.sum())
            if w == 0.0:
                continue
            ks = np.arange(a, b)
            wt = d / w if np.all(d >= 0) or np.all(d <= 0) else np.full(len(d), 1.0 / len(d))
            g_delta.append(w)
            g_area.append(float(np.sum(wt * cum[ks])))
            g_step.append(float(np.sum(wt * ks)))
        g_delta, g_area, g_step = np.array(g_delta), np.array(g_area), np.array(g_step)
        # [points, groups]: the area and steps since each decrease, zero where it comes after the point
        before = g_step[None, :] < t[:, None]
        self._feat = {
            "tokens": tau * t,
            "d_eff": tau * cum[t],
            "delta": np.where(before, g_delta[None, :], 0.0),
            "area_since": np.where(before, tau * (cum[t][:, None] - g_area[None, :]), 0.0),
            "tokens_since": np.where(before, tau * (t[:, None] - g_step[None, :]), 0.0),
        }
        return self._feat


# ---------------------------------------------------------------------------------------- laws
# a law's parameters: the linear ones (E, A, B[, K]) and the nonlinear ones (alpha, beta[, T, gamma]);
# N, D and T are measured in units fixed per fit (n_ref, d_ref) so that the numbers stay near 1


@dataclass(frozen=True)
class LawSpec:
    name: str
    nonlinear: tuple[str, ...]
    bounds: dict  # nonlinear name -> (low, high), in the fitted coordinates
    grid: dict  # nonlinear name -> starting values
    # the annealing term in absolute rates: a decrease buys in proportion to the run's peak rate (and the
    # area since it is counted in absolute rate), instead of the same for every run's peak
    peak_scaled: bool = False


SPECS = {
    "lr-annealing": LawSpec(
        "lr-annealing",
        ("alpha", "beta", "log_t"),
        {"alpha": (0.02, 2.0), "beta": (0.02, 2.0), "log_t": (-9.0, 5.0)},
        {"alpha": (0.15, 0.4, 0.8), "beta": (0.15, 0.4, 0.8), "log_t": (-5.0, -3.0, -1.0)},
    ),
    "lr-annealing-peak": LawSpec(
        "lr-annealing-peak",
        ("alpha", "beta", "log_t"),
        {"alpha": (0.02, 2.0), "beta": (0.02, 2.0), "log_t": (-9.0, 5.0)},
        {"alpha": (0.15, 0.4, 0.8), "beta": (0.15, 0.4, 0.8), "log_t": (-5.0, -3.0, -1.0)},
        peak_scaled=True,
    ),
    "chinchilla": LawSpec(
        "chinchilla",
        ("alpha", "beta"),
        {"alpha": (0.02, 2.0), "beta": (0.02, 2.0)},
        {"alpha": (0.1, 0.2, 0.4, 0.6, 0.9), "beta": (0.1, 0.2, 0.4, 0.6, 0.9)},
    ),
}


def _stack(runs: list[Run], lr_ref: float = 0.0) -> dict:
    """Every run's points in one set of arrays (groups padded with zeros), so a law is a few numpy
    operations over all points at once. With ``lr_ref`` the rate's decreases and areas are in units
    of that absolute rate (each run's relative schedule times its peak over ``lr_ref``)."""
    feats = [r.features() for r in runs]
    width = max(f["delta"].shape[1] for f in feats) or 1
    scale = [r.peak_lr / lr_ref if lr_ref else 1.0 for r in runs]

    def pad(a):
        return np.pad(a, ((0, 0), (0, width - a.shape[1])))

    return {
        "n": np.concatenate([np.full(len(r.steps), float(r.n)) for r in runs]),
        "tokens": np.concatenate([f["tokens"] for f in feats]),
        "d_eff": np.concatenate([f["d_eff"] for f in feats]),
        "delta": np.concatenate([pad(f["delta"]) * c for f, c in zip(feats, scale, strict=True)]),
        "area_since": np.concatenate([pad(f["area_since"]) * c for f, c in zip(feats, scale, strict=True)]),
        "tokens_since": np.concatenate([pad(f["tokens_since"]) for f in feats]),
    }


def _basis(law: str, nl: dict, st: dict, n_ref: float, d_ref: float) -> np.ndarray:
    """[points, linear terms]: the law is basis @ (E, A, B[, K]) for fixed nonlinear parameters."""
    law = law.removesuffix("-peak")
    cols = [np.ones(len(st["n"])), (st["n"] / n_ref) ** -nl["alpha"]]
    if law == "chinchilla":
        cols.append((st["tokens"] / d_ref) ** -nl["beta"])
        return np.stack(cols, axis=1)
    cols.append((st["d_eff"] / d_ref) ** -nl["beta"])
    t_scale = d_ref * math.exp(nl["log_t"])
    g = -np.expm1(-st["tokens_since"] / t_scale)
    cols.append(-np.sum(st["delta"] * g, axis=1))
    return np.stack(cols, axis=1)


def _jacobian(law: str, lin: np.ndarray, nl: dict, st: dict, n_ref: float, d_ref: float) -> np.ndarray:
    """[points, parameters]: d prediction / d (E, log A, log B[, log K], nonlinear ones)."""
    law = law.removesuffix("-peak")
    n = st["n"] / n_ref
    d = (st["tokens"] if law == "chinchilla" else st["d_eff"]) / d_ref
    size, data = lin[1] * n ** -nl["alpha"], lin[2] * d ** -nl["beta"]
    cols = [np.ones(len(n)), size, data]
    if law == "chinchilla":
        return np.stack(cols + [-size * np.log(n), -data * np.log(d)], axis=1)
    t_scale = d_ref * math.exp(nl["log_t"])
    k = lin[3]
    x = st["tokens_since"] / t_scale
    e = np.exp(-x)
    g = 1.0 - e
    extra = [-k * np.sum(st["delta"] * (-e * x), axis=1)]
    cols.append(-k * np.sum(st["delta"] * g, axis=1))
    return np.stack(cols + [-size * np.log(n), -data * np.log(d)] + extra, axis=1)


@dataclass(frozen=True)
class LawFit:
    """A fitted law: its parameters (linear E, A, B[, K]; nonlinear exponents and scales), the
    units N and D were measured in, and the fit's summed Huber objective."""

    law: str
    linear: tuple[float, ...]
    nonlinear: dict
    n_ref: float
    d_ref: float
    objective: float = 0.0
    lr_ref: float = 0.0  # the absolute rate the ``-peak`` laws' annealing is counted in (0: relative)
    at_bound: tuple[str, ...] = ()  # parameters the fit left on a bound of their range
    fixed: tuple[str, ...] = ()  # parameters held, not fitted ("E")
    converged: bool = True  # the optimiser met its tolerance at the best start (not its evaluation cap)
    alternatives: tuple = ()  # other local optima the starts found (LawFit each): the band's refits start there too

    def predict(self, run: Run) -> np.ndarray:
        st = _stack([run], self.lr_ref)
        return _basis(self.law, self.nonlinear, st, self.n_ref, self.d_ref) @ np.asarray(self.linear)

    def params(self) -> dict:
        """The parameters in the law's own units (N in parameters, D and T in tokens)."""
        names = ("E", "A", "B", "K")[: len(self.linear)]
        out = dict(zip(names, self.linear, strict=False))
        out["A"] = self.linear[1] * self.n_ref ** self.nonlinear["alpha"]
        out["B"] = self.linear[2] * self.d_ref ** self.nonlinear["beta"]
        out["alpha"], out["beta"] = self.nonlinear["alpha"], self.nonlinear["beta"]
        if "log_t" in self.nonlinear:
            out["T"] = self.d_ref * math.exp(self.nonlinear["log_t"])
        if "gamma" in self.nonlinear:
            out["gamma"] = self.nonlinear["gamma"]
        return {k: float(v) for k, v in out.items()}

    def to_dict(self) -> dict:
        return {"law": self.law, "linear": list(self.linear), "nonlinear": dict(self.nonlinear),
                "n_ref": self.n_ref, "d_ref": self.d_ref, "lr_ref": self.lr_ref, "objective": self.objective,
                "params": self.params(), "at_bound": list(self.at_bound), "fixed": list(self.fixed),
                "converged": self.converged, "alternatives": len(self.alternatives)}  # fmt: skip

    @staticmethod
    def from_dict(d: dict) -> LawFit:
        return LawFit(d["law"], tuple(d["linear"]), dict(d["nonlinear"]), d["n_ref"], d["d_ref"],
                      d.get("objective", 0.0), d.get("lr_ref", 0.0), tuple(d.get("at_bound", ())),
                      tuple(d.get("fixed", ())), d.get("converged", True))  # fmt: skip


def _huber(r: np.ndarray, delta: float) -> float:
    a = np.abs(r)
    return float(np.sum(np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))))


def _refs(runs: list[Run]) -> tuple[float, float]:
    n_ref = float(np.exp(np.mean([np.log(r.n) for r in runs])))
    d_ref = float(np.exp(np.mean([np.log(r.tokens_per_step * r.total_steps) for r in runs])))
    return n_ref, d_ref


def check(runs: list[Run], law: str) -> list[Run]:
    """The evaluated runs, or LawError when they cannot carry the law."""
    if law not in SPECS:
        raise LawError(f"law: unknown law {law!r} (known: {', '.join(LAWS)})")
    runs = [r for r in runs if r.loss is not None and len(r.steps)]
    if len({r.n for r in runs}) < 2:
        raise LawError("a joint fit needs evaluated runs of at least two sizes")
    n_points = sum(len(r.steps) for r in runs)
    n_params = 3 + (law.removesuffix("-peak") != "chinchilla") + len(SPECS[law].nonlinear)
    if n_points < 2 * n_params:
        raise LawError(f"{n_points} evaluations for a law of {n_params} parameters; evaluate the rungs more often")
    return runs


def fit_law(
    runs: list[Run],
    law: str = DEFAULT_LAW,
    delta: float = HUBER_DELTA,
    start: LawFit | list[LawFit] | None = None,
    weights: list[np.ndarray] | None = None,
    e_fixed: float | None = None,
) -> LawFit:
    """One law through every evaluation of every run given (each needs ``loss``).

    ``start``: a previous fit (or several: its alternatives) to start from alone (a bootstrap refit),
    instead of the starts found by variable projection; the best optimum of them is kept. ``weights``: per run, a weight per point (a bootstrap may drop points).
    ``e_fixed``: E held at this value (Marin fixes it; the data of a ladder may not tell it).
    The fit names every parameter it left on a bound of its range (``at_bound``).

    The residuals, their Jacobian and the packing of parameters are closures over the fit's arrays,
    bounds and held E."""
    # long (118 lines): those closures share the fit's arrays; apart, each would take a dozen of them
    runs = check(runs, law)
    spec = SPECS[law]
    starts_given = [start] if isinstance(start, LawFit) else list(start or [])
    start = starts_given[0] if starts_given else None
    n_ref, d_ref = (start.n_ref, start.d_ref) if start else _refs(runs)
    if start is not None:
        lr_ref = start.lr_ref
    else:
        lr_ref = float(np.exp(np.mean([np.log(r.peak_lr) for r in runs]))) if spec.peak_scaled else 0.0
    loss = np.concatenate([r.loss for r in runs])
    if np.any(~np.isfinite(loss)) or np.any(loss <= 0):
        raise LawError("held-out losses must be finite and positive")
    log_l = np.log(loss)
    w = np.sqrt(np.concatenate(weights)) if weights is not None else np.ones_like(loss)
    n_lin = 3 + (law.removesuffix("-peak") != "chinchilla")
    e_hi = max(0.999 * float(loss.min()), 2e-3)
    if e_fixed is not None and not 0.0 <= e_fixed < float(loss.min()):
        raise LawError(f"E fixed at {e_fixed:g} must lie in [0, {float(loss.min()):.4g}), below every loss")

    st = _stack(runs, lr_ref)

    def design(nl: dict) -> np.ndarray:
        return _basis(law, nl, st, n_ref, d_ref)

    # parameters for the optimiser: E (unless fixed), log A, log B[, log K], then the nonlinear ones
    free = slice(1, None) if e_fixed is not None else slice(None)

    def full(x: np.ndarray) -> np.ndarray:
        return np.concatenate([[e_fixed], x]) if e_fixed is not None else x

    def unpack(x: np.ndarray) -> tuple[np.ndarray, dict]:
        x = full(x)
        lin = np.concatenate([[x[0]], np.exp(x[1:n_lin])])
        return lin, dict(zip(spec.nonlinear, x[n_lin:], strict=True))

    def residuals(x: np.ndarray) -> np.ndarray:
        lin, nl = unpack(x)
        pred = design(nl) @ lin
        return w * (np.log(np.maximum(pred, 1e-9)) - log_l)

    def jac(x: np.ndarray) -> np.ndarray:
        lin, nl = unpack(x)
        pred = np.maximum(design(nl) @ lin, 1e-9)
        return ((w / pred)[:, None] * _jacobian(law, lin, nl, st, n_ref, d_ref))[:, free]

    lo = np.array([1e-3] + [-30.0] * (n_lin - 1) + [spec.bounds[k][0] for k in spec.nonlinear])
    hi = np.array([e_hi] + [30.0] * (n_lin - 1) + [spec.bounds[k][1] for k in spec.nonlinear])

    def pack(lin: np.ndarray, nl: dict) -> np.ndarray:
        lin = np.maximum(lin, 1e-12)
        x = np.concatenate([[min(max(lin[0], lo[0]), hi[0])], np.log(lin[1:]), [nl[k] for k in spec.nonlinear]])
        return np.clip(x, lo + 1e-9, hi - 1e-9)[free]

    if start is not None:
        starts = [pack(np.asarray(s.linear), s.nonlinear) for s in starts_given]
    else:
        scored = []
        keys = list(spec.grid)
        for values in _product([spec.grid[k] for k in keys]):
            nl = dict(zip(keys, values, strict=True))
            m = design(nl)
            if e_fixed is not None:  # the rest of the loss after E, in the same relative terms
                rest, _ = nnls(m[:, 1:] * w[:, None] / loss[:, None], w * (1 - e_fixed / loss))
                lin = np.concatenate([[e_fixed], rest])
            else:
                lin, _ = nnls(m * w[:, None] / loss[:, None], w)  # least squares on relative error
                if lin[0] > e_hi:
                    continue
            x = pack(lin, nl)
            scored.append((float(np.sum(residuals(x) ** 2)), x))
        scored.sort(key=lambda s: s[0])
        starts = [x for _, x in scored[:6]]
        if not starts:
            raise LawError("no starting point keeps E below the smallest loss; are the losses sensible?")
    found = []
    for x0 in starts:
        res = least_squares(residuals, x0, jac=jac, bounds=(lo[free], hi[free]), loss="huber", f_scale=delta,
                            x_scale="jac", max_nfev=400 if start is None else 150, xtol=1e-10, ftol=1e-10)  # fmt: skip
        found.append((_huber(res.fun, delta), res.x, res.status > 0))
    found.sort(key=lambda t: t[0])
    names = ["E", "A", "B", "K"][:n_lin] + ["T" if k == "log_t" else k for k in spec.nonlinear]
    tol = 1e-4 * (hi - lo)
    span = (hi - lo)[free]

    def made(item, alternatives=()) -> LawFit:
        lin, nl = unpack(item[1])
        x = full(item[1])
        edge = [n for i, n in enumerate(names) if (x[i] - lo[i] < tol[i] or hi[i] - x[i] < tol[i]) and not (i == 0 and e_fixed is not None)]  # fmt: skip
        return LawFit(law, tuple(float(v) for v in lin), {k: float(v) for k, v in nl.items()}, n_ref, d_ref, item[0],
                      lr_ref, tuple(edge), ("E",) if e_fixed is not None else (), bool(item[2]), alternatives)  # fmt: skip

    # other optima nearly as good (objective within 1.5x the best), apart from the best by more than 5%
    # of a parameter's range, each kept once: where a refit of a slightly different ladder may land
    others = []
    for item in found[1:]:
        if item[0] <= 1.5 * found[0][0] and all(
            np.max(np.abs(item[1] - o[1]) / span) > 0.05 for o in [found[0], *others]
        ):
            others.append(item)
    return made(found[0], tuple(made(o) for o in others[:3]))


def _product(lists):
    if not lists:
        yield ()
        return
    for v in lists[0]:
        for rest in _product(lists[1:]):
            yield (v, *rest)
