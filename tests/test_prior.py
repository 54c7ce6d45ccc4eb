"""The prior law (moelab.ladder.prior, issue 37): two free parameters per fraction, the size
exponent from a prior fitted across corpora; planted basins, the prior file, forward chaining."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moelab.errors import ForecastError
from moelab.ladder import prior as P

ROOT = Path(__file__).resolve().parents[1]
SIZES = np.array([1.0, 1.8, 2.9, 4.3, 6.0, 8.0]) * 1e11  # six rungs' compute in a 2x width range
TARGET = 8e11 * 12  # 12x the top rung


def curves_from(law, sizes=SIZES, seeds=2, noise=0.0, seed=0, fractions=(1.0,)) -> list[dict]:
    """Rung curves (the form rung_curve returns) with loss law(c, f) at each fraction's compute."""
    rng = np.random.default_rng(seed)
    out = []
    for c in sizes:
        for k in range(seeds):
            fr = {f: float(law(c * f, f) * math.exp(rng.normal(0, noise))) for f in fractions}
            out.append(
                {"dir": f"r{c:.3g}-{k}", "name": f"r{c:.3g}-{k}", "steps": 100, "flops": float(c), "fractions": fr}
            )
    return out


def prior_of(alpha, alpha_sd=0.02, e_share=0.5, e_share_sd=0.05, fractions=(1.0,), corpora=6) -> P.Prior:
    n = len(fractions)
    return P.Prior("tiny-test", list(fractions), [alpha] * n, [alpha_sd] * n, [e_share] * n, [e_share_sd] * n,
                   [f"c{i}" for i in range(corpora)], method="by hand")  # fmt: skip


C_REF = float(np.exp(np.mean(np.log(np.repeat(SIZES, 2)))))


def law1(c, f=1.0):
    return 2.0 + 2.5 * (c / C_REF) ** -0.30


def test_a_planted_second_basin_is_reported_and_the_forecast_stays_with_the_prior():
    rungs = curves_from(law1, noise=0.01)  # 1% noise: alpha 0.21 fits these rungs as well as 0.30 does
    truth = law1(TARGET)
    c = np.array([r["flops"] for r in rungs])
    loss = np.array([r["fractions"][1.0] for r in rungs])
    e2, a2 = P.fit_alpha_held(c, loss, 0.21, C_REF)
    other = e2 + a2 * (TARGET / C_REF) ** -0.21  # the second basin's forecast, 9% below the truth
    free = P.fit_free(c, loss, C_REF)
    s2 = free["sse"] / (len(loss) - 3)
    assert P._sse(c, loss, e2, a2, 0.21, C_REF) - free["sse"] < 2.71 * s2  # as good as the best, within noise
    assert other < 0.93 * truth
    fc = P.forecast_prior(rungs, TARGET, 1000, prior_of(0.30), n_boot=200)
    assert fc["loss"][-1] == pytest.approx(truth, rel=0.02)  # the prior's basin
    b = fc["basins"]
    assert b["prior_inside"] and b["equally_good"]["final"][0] <= other <= b["equally_good"]["final"][1]
    assert b["farthest"]["final"] < 0.93 * truth  # the other basin, named
    # the same rungs with the prior in the other basin: the forecast follows the prior, not the fit's whim
    fc2 = P.forecast_prior(rungs, TARGET, 1000, prior_of(0.21), n_boot=200)
    assert fc2["loss"][-1] == pytest.approx(other, rel=1e-6)


def test_the_band_draws_the_exponent_from_several_points_and_without_them_misses_the_planted_basin():
    rungs = curves_from(law1, noise=0.01)
    truth = law1(TARGET)
    # the prior sits in the wrong basin (0.21) but knows its spread across corpora (0.06)
    wide = P.forecast_prior(rungs, TARGET, 1000, prior_of(0.21, alpha_sd=0.06), n_boot=400)
    assert wide["low"][-1] <= truth <= wide["high"][-1]
    # refits that all start at the prior's one exponent: the band cannot see the other basin
    one = P.forecast_prior(rungs, TARGET, 1000, prior_of(0.21, alpha_sd=1e-6), n_boot=400)
    assert not one["low"][-1] <= truth <= one["high"][-1]


def test_forward_chaining_picks_the_law_that_made_the_ladder():
    fr = (0.25, 0.5, 0.75, 1.0)
    prior = prior_of(0.30, e_share=0.1, fractions=fr)

    def marin_like(c, f):  # E at Marin's 1.5, an exponent the prior does not hold
        return 1.5 + (3.0 - f) * (c / C_REF) ** -0.6

    def prior_like(c, f):  # the prior's exponent, an E far from the prior's share
        return 3.0 + (2.0 - f) * (c / C_REF) ** -0.30

    def share_like(c, f):  # E at the prior's share (0.1) of the largest fitted rung's loss, a third exponent
        a = 2.0 - f
        e = 0.1 / 0.9 * a * (SIZES[-2] * f / C_REF) ** -0.8  # E = 0.1 (E + a x_top): the top rung forward chaining fits
        return e + a * (c / C_REF) ** -0.8

    for law, want in ((marin_like, "marin"), (prior_like, "prior-alpha"), (share_like, "prior-e")):
        got = P.forward_chain(curves_from(law, fractions=fr), prior)
        assert got["chosen"] == want, got["scores"]
        assert got["scores"][want]["mean_abs_past_20"] < 1e-6


def test_the_prior_file_round_trips_and_a_recipe_without_one_is_refused_in_one_line(tmp_path):
    per_corpus = {f"c{i}": {"fractions": [0.5, 1.0], "alpha": [0.2 + 0.01 * i, 0.25 + 0.02 * i],
                            "e_share": [0.4, 0.5 + 0.01 * i]} for i in range(4)}  # fmt: skip
    prior = P.fit_prior(per_corpus, "tiny-abc", recipe={"recipe": "tiny"}, created="2026-12-05")
    assert prior.alpha == pytest.approx([0.215, 0.28]) and prior.alpha_sd[1] == pytest.approx(
        np.std([0.25, 0.27, 0.29, 0.31], ddof=1)
    )
    loo = P.fit_prior(per_corpus, "tiny-abc", leave_out="c3")
    assert loo.corpora == ["c0", "c1", "c2"] and loo.alpha[1] == pytest.approx(0.27)
    P.save_prior(prior, P.prior_path("tiny-abc", tmp_path))
    assert P.load_prior("tiny-abc", tmp_path) == prior
    with pytest.raises(ForecastError) as err:
        P.load_prior("tiny-zzz", tmp_path)
    assert "tiny-zzz" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "tiny-old.json").write_text(json.dumps({**prior.to_dict(), "version": 0}))
    with pytest.raises(ForecastError, match="version"):
        P.load_prior("tiny-old", tmp_path)


def test_the_demo_recipe_ships_a_prior_and_others_are_refused_by_the_command_line(tmp_path):
    from moelab.ladder.plan import load_ladder

    demo, calib = (load_ladder(ROOT / "ladders" / n) for n in ("demo.yaml", "calib.yaml"))
    assert P.recipe_key(demo) == P.recipe_key(calib)  # one recipe, one prior, whatever the widths
    shipped = P.load_prior(P.recipe_key(demo))
    assert len(shipped.corpora) >= 5 and shipped.fractions[-1] == 1.0 and all(s > 0 for s in shipped.alpha_sd)
    other = dataclasses.replace(demo, head_dim=16)
    assert P.recipe_key(other) != P.recipe_key(demo)
    base = [sys.executable, "-m", "moelab", "ladder", "forecast", "--ladder", str(tmp_path), "--target", "tiny",
            "--law", "prior", "--out", str(tmp_path / "fc.json")]  # fmt: skip
    for extra, says in (
        ([], "no prior given"),
        (["--prior", str(ROOT / "ladders" / "tiny.yaml")], "no prior for recipe"),
    ):
        res = subprocess.run(base + extra, capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 2 and says in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert not (tmp_path / "fc.json").exists()


def test_the_map_exponent_lies_between_the_prior_and_the_rungs_as_their_noise_and_its_spread_weigh():
    rungs = curves_from(law1, noise=0.003, seed=1)  # the rungs say 0.30, within their noise
    c = np.array([r["flops"] for r in rungs])
    loss = np.array([r["fractions"][1.0] for r in rungs])
    size = np.round(c, -3)
    p = {"alpha": 0.21, "e_share": 0.5}
    tight = P.fit_at(c, loss, size, C_REF, {**p, "alpha_sd": 0.002}, "map")
    loose = P.fit_at(c, loss, size, C_REF, {**p, "alpha_sd": 0.2}, "map")
    mid = P.fit_at(c, loss, size, C_REF, {**p, "alpha_sd": 0.03}, "map")
    assert abs(tight["alpha"] - 0.21) < 0.01  # a sure prior holds
    assert abs(loose["alpha"] - 0.30) < 0.04  # a vague one lets the rungs speak
    assert tight["alpha"] < mid["alpha"] < loose["alpha"]


# ------------------------------------------------------------------ the production band's coverage (issue 39)

RUNG_SIZES = np.array([1.0, 1.9, 3.1, 4.6]) * 1e11  # four rungs, as the demo's ladder
TARGET_12 = 4.6e11 * 12.8  # the demo's extrapolation: 12.8x the top rung
BAND_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def misspecified_world(k: int):
    """Corpus ``k``'s truth: E + A c^-a + B c^-b, two power laws (a law of one power, the forecast's, cannot
    take it exactly), each corpus its own exponents and E, the rate of learning along the run its own."""
    rng = np.random.default_rng([39, k])
    e, a, b = rng.uniform(1.0, 2.5), rng.uniform(0.12, 0.4), rng.uniform(0.5, 0.9)
    amp_a, amp_b, lag = rng.uniform(1.5, 3.0), rng.uniform(0.3, 1.0), rng.uniform(0.05, 0.25)

    def law(c, f):
        return (e + amp_a * (c / C_REF) ** -a + amp_b * (c / C_REF) ** -b) * (1 + lag * (1 - f) ** 2)

    return law


def noisy_ladder(law, rng, offset_sd=0.008, point_sd=0.004) -> tuple[list[dict], dict]:
    """The rungs (two seeds each, three on the top rung) and the target, each run off by an offset of its
    own (a seed) and noisy from point to point."""

    def run(c, name):
        off = rng.normal(0, offset_sd)
        fr = {f: float(law(c * f, f) * math.exp(off + rng.normal(0, point_sd))) for f in BAND_FRACTIONS}
        return {"dir": name, "name": name, "steps": 100, "flops": float(c), "fractions": fr}

    rungs = [run(c, f"r{i}-{s}") for i, c in enumerate(RUNG_SIZES) for s in range(3 if i == 3 else 2)]
    return rungs, run(TARGET_12, "target")


def production_band_coverage(scale: float = 1.0, corpora: int = 20, draws: int = 3) -> dict:
    """The band `law: prior-alpha` forecasts carry, on ladders of a law it does not contain: the prior
    fitted leave-one-corpus-out on the other synthetic corpora (as benchmarks/forecast_calibration.py
    fits the shipped one) from one draw of each, each corpus's target forecast from the rungs of its
    other draws (seeds and noise of their own); ``scale`` widens the band
    around the forecast (1: as shipped)."""
    rng = np.random.default_rng(0)
    worlds = [misspecified_world(k) for k in range(corpora)]
    ladders = [[noisy_ladder(w, rng) for _ in range(draws)] for w in worlds]
    params = {f"c{k}": P.corpus_params(*ladders[k][0]) for k in range(corpora)}  # what each corpus teaches
    inside, finals, half = [], [], []
    for k in range(corpora):
        prior = P.fit_prior(params, "synthetic", leave_out=f"c{k}")
        for rungs, target in ladders[k][1:]:  # other draws than the one the prior learnt from
            fc = P.forecast_prior(rungs, TARGET_12, 100, prior, "prior-alpha", n_boot=200, seed=k)
            for f, mid, lo, hi in zip(fc["fractions"], fc["loss"], fc["low"], fc["high"], strict=True):
                lo, hi = mid + scale * (lo - mid), mid + scale * (hi - mid)
                inside.append(lo <= target["fractions"][f] <= hi)
            finals.append(fc["loss"][-1] / target["fractions"][1.0] - 1)
            half.append(scale * (fc["high"][-1] - fc["low"][-1]) / 2 / fc["loss"][-1])
    return {"coverage": float(np.mean(inside)), "final_error_rms": float(np.sqrt(np.mean(np.square(finals)))),
            "final_half_width": float(np.mean(half)), "forecasts": len(finals)}  # fmt: skip


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_the_production_band_covers_a_law_it_does_not_contain():
    """The band real forecasts use (law prior-alpha: the exponent drawn from the prior's spread across
    corpora, the sizes resampled, the target's seed noise), with the prior fitted leave-one-corpus-out,
    on ladders whose truth is two power laws: it holds the targets' points as often as it says, and is
    as wide as its forecasts' errors call for, by the criteria the joint band's synthetic check uses
    (tests/test_forecast.py: 75-98% inside, a final half-width 0.5-2.5x of 1.645 x the final errors' rms).
    Measured when it was written: 97.5% of 160 points inside, a final half-width of 11.8% against final
    errors of 5.9% rms (on the real corpora the same band held 82%: benchmarks/results/forecast_calibration.json).
    The same check fails for the band narrowed and widened fivefold."""
    from test_forecast import _band_problems

    res = production_band_coverage()
    assert res["forecasts"] == 40
    assert _band_problems(res) == [], res
    for scale in (0.2, 5.0):
        broken = production_band_coverage(scale)
        assert _band_problems(broken), (scale, broken)
