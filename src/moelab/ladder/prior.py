"""A law the ladder can pin down: two free parameters per fraction, the third from a prior.

At every 5% of the run (fraction f) the rungs' held-out losses against their compute so far,
C = f x the run's training FLOPs, follow L_f(C) = E_f + A_f (C / C_ref)^-alpha_f. Four to six sizes in
a 2-4x width range cannot tell E_f from alpha_f (moving E by half a nat barely changes the fit and
moves the forecast by percents), so one of them comes from the recipe's prior:

- ``prior-alpha`` (alpha from the prior): E_f and A_f by least squares on relative error, a linear fit
  with one optimum; E outside [0, the smallest loss) or A <= 0 falls back to E from the prior (as a
  share of the top rung's loss), and the forecast says so;
- ``prior-e`` (E from the prior, as that share): A_f and alpha_f, a straight line in log-log;
- ``prior-map``: alpha_f where the rungs and the prior agree best (the maximum a posteriori: the
  fit's squared relative residuals over the seed noise plus ((alpha - prior) / prior sd)^2), then
  E_f and A_f as in ``prior-alpha``; the ladder moves the exponent as far as its noise allows.

The prior (a JSON file per recipe in ``ladder/priors/``) holds, per fraction, alpha and the share
E / (the top rung's loss) fitted per development corpus on rungs and target together (three free
parameters: the target, 10x beyond, pins the curvature), their mean and spread across the corpora.
The band's draws take the exponent from that spread (Student t over the corpora), resample the
sizes (a size's seeds together) and add the target's own seed noise (the top rungs' seed spread).
The free three-parameter fit is kept beside it: the range of forecasts whose fit is as good as
the best (a profile over alpha) is reported, so a second basin is named, never silently taken.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moelab.errors import ForecastError
from moelab.ladder.plan import load_ladder

PRIOR_DIR = Path(__file__).with_name("priors")
PRIOR_VERSION = 1
MODES = {"prior-alpha": "alpha", "prior-e": "E", "marin": "marin", "prior-map": "map"}  # law name -> what is held
CHAINED = ("prior-alpha", "prior-e", "marin", "prior-map")  # what law "prior" chooses among, by forward chaining
ALPHA_GRID = np.concatenate([np.linspace(0.005, 0.2, 40), np.linspace(0.205, 1.5, 260)])
LEVEL = 0.9


def recipe_key(ladder) -> str:
    """The prior's key: the ladder's recipe and every rule that shapes its rungs, not their widths."""
    fields = recipe_fields(ladder)
    blob = json.dumps(fields, sort_keys=True).encode()
    return f"{ladder.recipe}-{hashlib.sha256(blob).hexdigest()[:8]}"


def recipe_fields(ladder) -> dict:
    return {"recipe": ladder.recipe, "overrides": sorted(ladder.overrides), "head_dim": ladder.head_dim,
            "layers": list(ladder.layers) if isinstance(ladder.layers, tuple) else ladder.layers,
            "expert_ratio": ladder.expert_ratio, "batch_size": ladder.batch_size,
            "tokens_per_active_param": ladder.tokens_per_active_param, "budget_flops": ladder.budget_flops,
            "kv": [ladder.kv_local_divisor, ladder.kv_global_divisor]}  # fmt: skip


@dataclass
class Prior:
    key: str
    fractions: list[float]
    alpha: list[float]  # the size exponent on compute, per fraction (mean over the corpora)
    alpha_sd: list[float]  # its spread across the corpora
    e_share: list[float]  # E / the top rung's loss, per fraction
    e_share_sd: list[float]
    corpora: list[str]  # what it was fitted on
    method: str = ""
    recipe: dict = field(default_factory=dict)
    per_corpus: dict = field(default_factory=dict)  # corpus -> {"alpha": [...], "e_share": [...]}
    created: str = ""
    version: int = PRIOR_VERSION

    @property
    def dof(self) -> int:
        return max(len(self.corpora) - 1, 1)

    def at(self, f: float) -> dict:
        i = int(np.argmin(np.abs(np.array(self.fractions) - f)))
        if abs(self.fractions[i] - f) > 1e-6:
            raise ForecastError(f"prior {self.key}: no entry at fraction {f:g} (it has {self.fractions})")
        return {"alpha": self.alpha[i], "alpha_sd": self.alpha_sd[i], "e_share": self.e_share[i],
                "e_share_sd": self.e_share_sd[i]}  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict, source: str = "prior") -> Prior:
        if d.get("version") != PRIOR_VERSION:
            raise ForecastError(f"{source}: prior version {d.get('version')!r}, this moelab reads {PRIOR_VERSION}")
        try:
            return Prior(**d)
        except TypeError as exc:
            raise ForecastError(f"{source}: not a prior file ({exc})") from None


def prior_path(key: str, root: Path | None = None) -> Path:
    return (root or PRIOR_DIR) / f"{key}.json"


def save_prior(prior: Prior, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(prior.to_dict(), indent=1) + "\n")
    tmp.replace(path)  # never a half-written prior
    return path


def load_prior(key: str, root: Path | None = None) -> Prior:
    """The recipe's prior, or ForecastError with one line saying what to do."""
    path = prior_path(key, root)
    if not path.exists():
        raise ForecastError(
            f"no prior for recipe {key} ({path} is missing): the prior law needs one fitted on this recipe's "
            "ladders (benchmarks/forecast_calibration.py), or choose --law per-fraction or lr-annealing"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ForecastError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return Prior.from_dict(data, str(path))


# ------------------------------------------------------------------------------------- fits


def _points(curves: list[dict], f: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute so far, loss and size (total FLOPs) of every curve with a point at ``f``."""
    have = [c for c in curves if f in c["fractions"]]
    return (np.array([c["flops"] * f for c in have]), np.array([c["fractions"][f] for c in have]),
            np.array([round(float(c["flops"]), -3) for c in have]))  # fmt: skip


def fit_alpha_held(c, loss, alpha: float, c_ref: float, w=None) -> tuple[float, float]:
    """E and A with alpha held: least squares on relative error (linear, one optimum)."""
    w = np.ones_like(loss) if w is None else w
    x = (c / c_ref) ** -alpha
    m = np.stack([np.ones_like(x), x], 1) / loss[:, None] * np.sqrt(w)[:, None]
    sol, *_ = np.linalg.lstsq(m, np.sqrt(w), rcond=None)
    return float(sol[0]), float(sol[1])


def fit_e_held(c, loss, e: float, c_ref: float, w=None) -> tuple[float, float]:
    """A and alpha with E held: a straight line through log(L - E) against log C."""
    w = np.ones_like(loss) if w is None else w
    y = np.log(np.maximum(loss - e, 1e-9))
    x = np.log(c / c_ref)
    m = np.stack([np.ones_like(x), -x], 1) * np.sqrt(w)[:, None]
    sol, *_ = np.linalg.lstsq(m, y * np.sqrt(w), rcond=None)
    return float(math.exp(sol[0])), float(sol[1])


def _sse(c, loss, e, a, alpha, c_ref, w=None) -> float:
    w = np.ones_like(loss) if w is None else w
    r = (e + a * (c / c_ref) ** -alpha) / loss - 1
    return float(np.sum(w * r * r))


def profile(c, loss, c_ref: float, w=None) -> list[tuple[float, float, float, float]]:
    """The three-parameter fit profiled over alpha: (alpha, E, A, sse) where E in [0, min loss), A > 0."""
    out = []
    lo = float(loss.min())
    for alpha in ALPHA_GRID:
        e, a = fit_alpha_held(c, loss, alpha, c_ref, w)
        if not (0.0 <= e < lo and a > 0):
            e = min(max(e, 0.0), 0.999 * lo)
            a = max(fit_e_held_a(c, loss, e, alpha, c_ref, w), 1e-12)
        out.append((float(alpha), e, a, _sse(c, loss, e, a, alpha, c_ref, w)))
    return out


def fit_e_held_a(c, loss, e, alpha, c_ref, w=None) -> float:
    """A alone with E and alpha held (relative least squares)."""
    w = np.ones_like(loss) if w is None else w
    x = (c / c_ref) ** -alpha / loss
    y = 1 - e / loss
    return float(np.sum(w * x * y) / max(np.sum(w * x * x), 1e-30))


def fit_free(c, loss, c_ref: float, w=None) -> dict:
    """The best three-parameter fit (profile over alpha, then the optimum of the grid)."""
    prof = profile(c, loss, c_ref, w)
    alpha, e, a, sse = min(prof, key=lambda p: p[3])
    return {"alpha": alpha, "E": e, "A": a, "sse": sse, "profile": prof}


def corpus_params(rungs: list[dict], target: dict) -> dict:
    """What one corpus teaches the prior: per fraction, the three-parameter fit's alpha and E's share
    of the top rung's loss, on the rungs and the target together."""
    out = {"fractions": [], "alpha": [], "e_share": []}
    top = max(r["flops"] for r in rungs)
    for f in sorted(target["fractions"]):
        c, loss, size = _points([*rungs, target], f)
        if len(set(size.tolist())) < 4:
            continue
        c_ref = float(np.exp(np.mean(np.log(c))))
        fit = fit_free(c, loss, c_ref)
        top_loss = float(np.exp(np.mean(np.log(loss[size == round(top, -3)]))))
        out["fractions"].append(f)
        out["alpha"].append(fit["alpha"])
        out["e_share"].append(fit["E"] / top_loss)
    return out


def fit_prior(per_corpus: dict[str, dict], key: str, leave_out: str | None = None, recipe: dict | None = None,
              created: str = "") -> Prior:  # fmt: skip
    """The prior from each corpus's parameters (``corpus_params``), ``leave_out`` left out: per
    fraction the mean and the spread (sample sd, at least a floor) across the corpora."""
    use = {k: v for k, v in per_corpus.items() if k != leave_out}
    if len(use) < 2:
        raise ForecastError(f"a prior needs at least two corpora, got {sorted(use)}")
    fr = sorted(set.intersection(*[set(v["fractions"]) for v in use.values()]))

    def col(name, f):
        return np.array([v[name][v["fractions"].index(f)] for v in use.values()])

    alpha = [float(np.mean(col("alpha", f))) for f in fr]
    alpha_sd = [max(float(np.std(col("alpha", f), ddof=1)), 0.005) for f in fr]
    share = [float(np.mean(col("e_share", f))) for f in fr]
    share_sd = [max(float(np.std(col("e_share", f), ddof=1)), 0.01) for f in fr]
    return Prior(key, fr, alpha, alpha_sd, share, share_sd, sorted(use),
                 method="per corpus, per fraction: E, A, alpha fitted on rungs and target (profile over alpha); "
                        "mean and sample sd across the corpora",
                 recipe=recipe or {}, per_corpus={k: dict(v) for k, v in use.items()}, created=created)  # fmt: skip


# -------------------------------------------------------------------------------- forecasts

FRACTIONS = [k / 20 for k in range(1, 21)]
MARIN_E = 1.5  # Marin's per-fraction fits hold E here


def _seed_sd(c_size: np.ndarray, loss: np.ndarray, top: int = 2) -> float:
    """The seed-to-seed spread of log-loss, pooled over the ``top`` largest sizes with two seeds or more."""
    sizes = sorted({s for s in c_size.tolist() if np.sum(c_size == s) > 1}, reverse=True)[:top]
    dev, dof = 0.0, 0
    for s in sizes:
        x = np.log(loss[c_size == s])
        dev += float(np.sum((x - x.mean()) ** 2))
        dof += len(x) - 1
    return math.sqrt(dev / dof) if dof else 0.0


def _top_loss(loss, size) -> float:
    return float(np.exp(np.mean(np.log(loss[size == size.max()]))))


def fit_at(c, loss, size, c_ref: float, p: dict, mode: str, w=None) -> dict:
    """One fraction's two-parameter fit: mode ``alpha`` (alpha held from the prior), ``E`` (E held at
    the prior's share of the top rung's loss) or ``marin`` (E held at 1.5). ``fallback`` names what
    came from the prior because the fit left its range."""
    lo = float(loss.min())
    fallback = None
    if mode == "map":
        s2 = max(_seed_sd(size, loss, top=len(loss)) ** 2, 1e-6)  # a point's relative noise variance
        best = None
        for alpha in ALPHA_GRID[np.abs(ALPHA_GRID - p["alpha"]) <= 4 * p["alpha_sd"]]:
            e, a = fit_alpha_held(c, loss, alpha, c_ref, w)
            if not (0.0 <= e < lo and a > 0):
                continue
            obj = _sse(c, loss, e, a, alpha, c_ref, w) / s2 + ((alpha - p["alpha"]) / p["alpha_sd"]) ** 2
            if best is None or obj < best[0]:
                best = (obj, alpha)
        mode, p = "alpha", dict(p, alpha=best[1] if best else p["alpha"])
    if mode == "alpha":
        alpha = p["alpha"]
        e, a = fit_alpha_held(c, loss, alpha, c_ref, w)
        if not (0.0 <= e < lo and a > 0):
            fallback = f"E {e:.3g} outside [0, {lo:.3g})" if a > 0 else "A <= 0"
            e = min(max(p["e_share"] * _top_loss(loss, size), 0.0), 0.999 * lo)
            a = fit_e_held_a(c, loss, e, alpha, c_ref, w)
    else:
        e = MARIN_E if mode == "marin" else p["e_share"] * _top_loss(loss, size)
        if not 0.0 <= e < lo:
            fallback = f"E {e:.3g} outside [0, {lo:.3g})"
            e = min(max(e, 0.0), 0.999 * lo)
        a, alpha = fit_e_held(c, loss, e, c_ref, w)
    return {"E": float(e), "A": float(a), "alpha": float(alpha), "c_ref": c_ref, "fallback": fallback}


def _predict(fit: dict, c: float) -> float:
    return fit["E"] + fit["A"] * (c / fit["c_ref"]) ** -fit["alpha"]


def forecast_prior(
    curves: list[dict],
    target_flops: float,
    target_steps: int,
    prior: Prior | None,
    law: str = "prior-alpha",
    n_boot: int = 400,
    level: float = LEVEL,
    seed: int = 0,
    size_weights: dict | None = None,
) -> dict:
    """The target's loss at every 5% from the rungs' points at that 5% (``curves``: per run, its
    ``fractions`` and total ``flops``), with alpha (``prior-alpha``) or E (``prior-e``) from ``prior``, or
    E at Marin's 1.5 (``marin``); the band from the prior's spread, the sizes resampled and the seed
    noise. ``size_weights``: a weight per size (total FLOPs, rounded to 1e3) for the fit (the smallest rung down-weighted)."""
    mode = MODES[law]
    if prior is None and mode != "marin":
        raise ForecastError(f"the {law} law needs the recipe's prior")
    sizes = sorted({round(float(c["flops"]), -3) for c in curves})
    if len(sizes) < 2:
        raise ForecastError("--ladder: the rungs have fewer than two sizes")
    rng = np.random.default_rng(seed)
    z = rng.standard_t(prior.dof, n_boot) * math.sqrt(1 + 1 / len(prior.corpora)) if prior else np.zeros(n_boot)
    picks = []
    while len(picks) < n_boot:
        pick = rng.choice(len(sizes), len(sizes))
        if len(set(pick.tolist())) >= 2:
            picks.append(np.bincount(pick, minlength=len(sizes)))
    noise_z = rng.standard_normal(n_boot)  # the target's own offset, one per draw and kept along the run
    out = {"law": law, "fractions": [], "steps": [], "loss": [], "low": [], "high": [], "fits": [], "warnings": []}
    q = (1 - level) / 2
    for f in FRACTIONS:
        c, loss, size = _points(curves, f)
        if len(set(size.tolist())) < 2:
            continue
        p = prior.at(f) if prior else {"alpha": 0.0, "alpha_sd": 0.0, "e_share": 0.0, "e_share_sd": 0.0}
        c_ref = float(np.exp(np.mean(np.log(c))))
        w0 = np.array([(size_weights or {}).get(s, 1.0) for s in size.tolist()])
        fit = fit_at(c, loss, size, c_ref, p, mode, w0)
        ct = target_flops * f
        pred = _predict(fit, ct)
        sd = _seed_sd(size, loss)
        draws = []
        for b in range(n_boot):
            pb = dict(
                p, alpha=max(p["alpha"] + z[b] * p["alpha_sd"], 1e-3), e_share=p["e_share"] + z[b] * p["e_share_sd"]
            )
            counts = picks[b][np.searchsorted(sizes, size)]
            keep = counts > 0
            fb = fit_at(c[keep], loss[keep], size[keep], c_ref, pb, mode, (w0 * counts)[keep])
            draws.append(_predict(fb, ct) * math.exp(noise_z[b] * sd))
        out["fractions"].append(f)
        out["steps"].append(round(f * target_steps))
        out["loss"].append(float(pred))
        out["low"].append(float(np.quantile(draws, q)))
        out["high"].append(float(np.quantile(draws, 1 - q)))
        out["fits"].append({"fraction": f, **fit, "rungs": int(len(c)), "seed_sd": sd, "prior": p})
        if fit["fallback"]:
            out["warnings"].append(f"at {f:.0%}: {fit['fallback']}; E from the prior instead")
    out["basins"] = basins(curves, target_flops, prior, out) if prior and out["fractions"] else None
    if out["basins"] and not out["basins"]["prior_inside"]:
        out["warnings"].append(
            f"the rungs alone prefer alpha {out['basins']['free']['alpha']:.3g} (final {out['basins']['free']['final']:.4g}); "
            f"the prior's {out['basins']['prior_alpha']:.3g} fits them worse than the noise allows"
        )
    return out


def basins(curves: list[dict], target_flops: float, prior: Prior, fc: dict) -> dict:
    """The free three-parameter fit at the last fraction, profiled over alpha: the best alpha, the
    range of final forecasts from every alpha that fits the rungs as well as the best within the
    noise (a 90% profile region), and whether the prior's alpha lies in it. A second basin shows
    here as forecasts far from the prior's inside that region."""
    f = fc["fractions"][-1]
    c, loss, size = _points(curves, f)
    c_ref = float(np.exp(np.mean(np.log(c))))
    free = fit_free(c, loss, c_ref)
    n = len(loss)
    s2 = free["sse"] / max(n - 3, 1)
    ok = [(a, e, aa) for a, e, aa, sse in free["profile"] if sse - free["sse"] <= 2.71 * max(s2, 1e-12)]
    finals = [e + aa * (target_flops * f / c_ref) ** -a for a, e, aa in ok]
    pa = prior.at(f)["alpha"]
    other = max(zip(finals, ok, strict=True), key=lambda t: abs(t[0] - fc["loss"][-1]))
    return {
        "fraction": f,
        "prior_alpha": pa,
        "free": {"alpha": free["alpha"], "E": free["E"], "final": free["E"] + free["A"] * (target_flops * f / c_ref) ** -free["alpha"]},
        "equally_good": {"alpha": [min(a for a, _, _ in ok), max(a for a, _, _ in ok)],
                         "final": [float(min(finals)), float(max(finals))]},
        "farthest": {"alpha": other[1][0], "final": float(other[0])},
        "prior_inside": bool(min(a for a, _, _ in ok) - 0.0051 <= pa <= max(a for a, _, _ in ok) + 0.0051),
    }  # fmt: skip


def forward_chain(curves: list[dict], prior: Prior | None, laws=CHAINED) -> dict:
    """Each law fitted on every size but the largest forecasts the largest (its seeds' mean): the
    mean |error| past 20% and the final error, per law, and the law with the smallest mean."""
    top = max(round(float(c["flops"]), -3) for c in curves)
    rest = [c for c in curves if round(float(c["flops"]), -3) != top]
    held = [c for c in curves if round(float(c["flops"]), -3) == top]
    scores = {}
    for law in laws:
        if law != "marin" and prior is None:
            continue
        try:
            fc = forecast_prior(rest, float(held[0]["flops"]), held[0]["steps"], prior, law, n_boot=1)
        except ForecastError:
            continue
        errs = []
        for f, pred in zip(fc["fractions"], fc["loss"], strict=True):
            vals = [h["fractions"][f] for h in held if f in h["fractions"]]
            if vals:
                errs.append((f, pred / float(np.exp(np.mean(np.log(vals)))) - 1))
        late = [abs(e) for f, e in errs if f > 0.2 + 1e-9]
        if late:
            scores[law] = {"mean_abs_past_20": float(np.mean(late)), "final": float(errs[-1][1])}
    best = min(scores, key=lambda k: scores[k]["mean_abs_past_20"]) if scores else None
    return {"held_out": f"{top:.4g} FLOPs", "scores": scores, "chosen": best}


def prior_for(source: str | Path) -> Prior:
    """The prior named on the command line: a prior file, or a ladder YAML whose recipe's prior is shipped."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        return load_prior(recipe_key(load_ladder(path)))
    if not path.is_file():
        raise ForecastError(f"--prior: {path} is not a file (give a prior JSON or the ladder's YAML)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ForecastError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return Prior.from_dict(data, str(path))
