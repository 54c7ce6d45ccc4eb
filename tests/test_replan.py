"""Re-planning a run's horizon: the learning rate, the mixture's phases, the forecast, the record,
and a resumed run that follows the new plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import MICRO, run_cli
from moelab.config import ConfigError, load_config
from moelab.runs import read_jsonl
from moelab.schedule import hyper, lr_factor, phase_boundaries
from test_forecast import synthetic_rung
from test_train import _train_cli


def lrs(cfg, n):
    h = hyper(cfg)
    return np.array([float(lr_factor(s, h)) for s in range(n)])


def test_linear_decay_is_re_timed_from_the_current_rate_to_the_new_end():
    base = ["train.warmup_frac=0.01", "train.min_lr_ratio=0.05"]  # 300 steps: warmup 3, linear from step 2
    old = lrs(load_config("tiny", base), 300)
    new = lrs(load_config("tiny", base + ["train.steps=450", "train.replans=[150:300->450]"]), 450)
    # by hand: the planned line from 1 at step 2 to 0.05 at step 299; from 150 a line to 0.05 at 449
    anchor = 1 - (150 - 2) / (299 - 2) * 0.95
    assert old[150] == pytest.approx(anchor, rel=1e-6)
    np.testing.assert_allclose(new[:150], old[:150], rtol=0, atol=0)  # the past is untouched
    assert new[150] == pytest.approx(anchor, rel=1e-6)  # no jump
    want = anchor + (np.arange(150, 450) - 150) / (449 - 150) * (0.05 - anchor)
    np.testing.assert_allclose(new[150:], want, rtol=1e-5)
    assert new[449] == pytest.approx(0.05, rel=1e-6)
    # a shorter horizon: steeper, still continuous, ends at the floor on the new last step
    short = lrs(load_config("tiny", base + ["train.steps=200", "train.replans=[150:300->200]"]), 200)
    assert short[150] == pytest.approx(anchor, rel=1e-6) and short[199] == pytest.approx(0.05, rel=1e-6)
    # and again: two re-plans chain
    twice = lrs(load_config("tiny", base + ["train.steps=400", "train.replans=[150:300->450, 300:450->400]"]), 400)
    np.testing.assert_allclose(twice[:300], new[:300], rtol=1e-6)
    assert twice[399] == pytest.approx(0.05, rel=1e-6)
    assert np.all(np.abs(np.diff(twice[2:])) < 0.01)  # nowhere a jump


def test_wsd_at_its_peak_keeps_its_shape_over_the_new_horizon():
    base = ["train.schedule=wsd", "train.warmup_frac=0.1", "train.decay_frac=0.2", "train.min_lr_ratio=0.0"]
    new = lrs(load_config("tiny", base + ["train.steps=100", "train.steps=150", "train.replans=[50:100->150]"]), 150)
    # still stable at step 50: the decay now starts at 150 * 0.8 = 120 instead of 80
    assert np.all(new[9:120] == 1.0) and np.all(np.diff(new[119:]) < 0) and new[149] == pytest.approx(0.0, abs=1e-7)


def test_phase_boundaries_ahead_move_and_passed_ones_stay():
    cfg = load_config("tiny", ["data.phase_starts=[0.0, 0.5, 0.8]"])  # 300 steps: phases at 0, 150, 240
    assert phase_boundaries(cfg.data.phase_starts, cfg.train) == (0, 150, 240)
    later = load_config(cfg, ["train.steps=400", "train.replans=[200:300->400]"])
    assert phase_boundaries(later.data.phase_starts, later.train) == (0, 150, 320)
    with pytest.raises(ConfigError, match="train.replans"):  # step 230 is past the new end of 220
        load_config(cfg, ["train.steps=220", "train.replans=[230:300->220]"])
    shorter = load_config(cfg, ["train.steps=250", "train.replans=[230:300->250]"])
    assert phase_boundaries(shorter.data.phase_starts, shorter.train) == (0, 150, 230)  # never into the past


@pytest.mark.parametrize(
    "spec,why",
    [("150-300", "AT:OLD->NEW"), ("150:300->400", "ends at 400"), ("350:300->300", "within both horizons")],
)
def test_bad_replans_are_refused(spec, why):
    with pytest.raises(ConfigError, match=why):
        load_config("tiny", [f"train.replans=[{spec}]"])


@pytest.mark.slow  # a killed 40-step run, re-planned and resumed (~65 s); the schedule's hand cases stay
def test_replan_a_real_run_then_resume_follows_the_new_plan(corpus, tmp_path):
    out = tmp_path / "run"
    res = _train_cli(corpus, out, steps=40, env={"MOELAB_TEST_FAULTS": "kill@25"})  # checkpoints at 10 and 20
    assert res.returncode == -9
    # a forecast from three (synthetic) rungs, as `moelab ladder forecast` writes it into the run
    rungs = [str(synthetic_rung(tmp_path, d)[0]) for d in (64, 96, 128, 160, 192)]  # five runs: a band's 3 dof
    micro = [a for o in MICRO for a in ("--set", o)]
    res = run_cli("ladder", "forecast", "--ladder", *rungs, "--target", "tiny", *micro, "--set", "train.steps=40",
                  "--out", str(out / "forecast.json"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    before = json.loads((out / "forecast.json").read_text())
    config_before = (out / "config.json").read_text()

    per_step = 4 * 32
    res = run_cli("replan", str(out), "--tokens", str(10 * per_step), "--reason", "x")  # not beyond step 20
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--tokens" in res.stderr, res.stderr
    assert (out / "config.json").read_text() == config_before  # nothing half-written

    res = run_cli("replan", str(out), "--tokens", str(60 * per_step), "--reason", "the cluster was late")
    assert res.returncode == 0, res.stderr
    assert "no longer covers the plan" in res.stderr  # +50% is past the ladder's 25%
    cfg = json.loads((out / "config.json").read_text())["config"]
    assert cfg["train"]["steps"] == 60 and cfg["train"]["replans"] == ["20:40->60"]
    ev = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "replan"]
    assert len(ev) == 1 and ev[0]["reason"] == "the cluster was late" and ev[0]["at_step"] == 20
    assert ev[0]["phase_starts"] == {"before": [0, 32], "after": [0, 48]}  # phase_starts [0, 0.8]
    after = json.loads((out / "forecast.json").read_text())
    assert after["steps"][-1] == 60 and after["target_flops"] == pytest.approx(1.5 * before["target_flops"], rel=1e-9)
    assert json.loads((out / "forecast.v1.json").read_text()) == before  # the version it launched with stays

    res = run_cli("train", "--resume", "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == list(range(1, 61))
    # the rate each step applied, against the schedule worked out by hand (warmup 0: a line from step 0)
    peak = 3e-3
    planned = lambda s: peak * (1 - s / 39 * 0.95)  # noqa: E731
    anchor = planned(20)
    for r in recs:
        s = r["step"] - 1
        want = planned(s) if s < 20 else anchor + (s - 20) / (59 - 20) * (0.05 * peak - anchor)
        assert r["lr"] == pytest.approx(want, rel=1e-5), s
    assert recs[-1]["lr"] == pytest.approx(0.05 * peak, rel=1e-5)
    assert [r["phase"] for r in recs] == [0] * 48 + [1] * 12  # the switch moved from step 32 to 48
    evals = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[-1] == 60 and 57 in evals  # evaluations at every 5% of the new horizon
