"""Branching a run from a checkpoint with a new schedule: the shared prefix is one run, the branch
follows the schedule asked for, and the record (and the lab's step graph) names the parent."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moelab.config import load_config
from moelab.errors import RunRefused
from moelab.lab.graph import Step, output_of
from moelab.lab.steps import branch_step, train_step
from moelab.runs import branch_point, read_jsonl
from moelab.schedule import hyper, lr_factor
from moelab.train.branch import branch_config, start_branch
from moelab.train.loop import train
from test_train import _micro

WSD = ["train.schedule=wsd", "train.decay_frac=0.2", "train.warmup_frac=0.1", "train.min_lr_ratio=0.05"]


def rates(cfg, n):
    h = hyper(cfg)
    return h.peak_lr * np.asarray(lr_factor(np.arange(n), h), np.float64)


def test_the_branch_schedule_is_the_parents_then_the_new_horizon():
    parent = load_config("tiny", [*WSD, "train.steps=100", "train.lr=0.01"])  # warmup 10, stable to 80, decay to 99
    # from the stable phase at step 40 to 60 steps: WSD over 60 (decay from round(0.8 * 60) = 48) by hand
    b = branch_config(parent, 40, 60)
    assert b.train.replans == ("40:100->60",) and b.train.steps == 60
    got = rates(b, 60)
    np.testing.assert_array_equal(got[:40], rates(parent, 40))
    assert np.all(got[9:48] == 0.01)
    want = 0.01 * (1 - (np.arange(48, 60) - 47) / (59 - 47) * 0.95)
    np.testing.assert_allclose(got[48:], want, rtol=1e-6)
    # a horizon whose WSD decay would have started already: a linear decay from the branch step (no jump)
    short = rates(branch_config(parent, 40, 45), 45)
    assert short[40] == pytest.approx(0.01) and short[44] == pytest.approx(0.0005, rel=1e-6)
    np.testing.assert_allclose(np.diff(short[40:]), np.full(4, -0.0095 / 4), rtol=1e-5)
    # a later decay start is a change after the branch point: allowed
    later = branch_config(parent, 40, 60, ["train.decay_frac=0.1"])
    assert np.all(rates(later, 60)[9:54] == 0.01)


@pytest.mark.parametrize(
    "sets,why",
    [
        (["model.d_model=96"], "model.d_model"),
        (["train.seed=3"], "train.seed"),
        (["train.batch_size=32"], "train.batch_size"),
        (["train.decay_frac=0.7"], "learning rate before step 40"),  # decay from 30: the prefix would change
    ],
)
def test_a_branch_that_would_change_its_prefix_is_refused(sets, why):
    parent = load_config("tiny", [*WSD, "train.steps=100", "train.lr=0.01"])
    with pytest.raises(RunRefused, match=why):
        branch_config(parent, 40, 60, sets)
    with pytest.raises(RunRefused, match="--at"):
        branch_config(parent, 100, 160)
    with pytest.raises(RunRefused, match="--steps"):
        branch_config(parent, 40, 40)


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_branch_from_a_checkpoint_equals_the_branch_trained_from_scratch(corpus, tmp_path):
    parent_cfg = _micro(corpus, *WSD, "train.steps=30", "train.keep_steps=[12]", "train.eval_every=3")
    train(parent_cfg, tmp_path / "parent", progress=False)
    b = branch_config(parent_cfg, 12, 18)
    start_branch(tmp_path / "parent", 12, tmp_path / "branch", b)
    train(b, tmp_path / "branch", resume=True, progress=False)
    train(b, tmp_path / "scratch", progress=False)  # the branch's config run from step 0

    def recs(name, kind="train"):
        return [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == kind]

    parent, branch, scratch = recs("parent"), recs("branch"), recs("scratch")
    # the shared prefix: the branch holds the parent's records up to step 12, and they are the scratch run's too
    assert [r for r in branch if r["step"] <= 12] == [r for r in parent if r["step"] <= 12]
    assert [(r["step"], r["loss"]) for r in branch if r["step"] <= 12] == [
        (r["step"], r["loss"]) for r in scratch if r["step"] <= 12
    ]
    # after it, what the branch computes from the copied checkpoint is the scratch run's, step for step
    assert [(r["step"], r["loss"], r["lr"]) for r in branch] == [(r["step"], r["loss"], r["lr"]) for r in scratch]
    # and it follows the schedule asked for, not the parent's: stable to step 14, then the decay to 0.05x
    lr = {r["step"]: r["lr"] for r in branch}
    peak = hyper(parent_cfg).peak_lr
    assert lr[14] == pytest.approx(peak) and lr[18] == pytest.approx(0.05 * peak, rel=1e-5)
    assert {r["step"]: r["lr"] for r in parent}[18] == pytest.approx(peak)  # the parent was still stable there
    assert [r["step"] for r in recs("branch", "eval")] == [r["step"] for r in recs("scratch", "eval")]
    ev = branch_point(tmp_path / "branch")
    assert ev["step"] == 12 and ev["parent"] == str((tmp_path / "parent").resolve()) and ev["steps"] == 18
    saved = json.loads((tmp_path / "parent" / "config.json").read_text())["hash"]
    assert ev["parent_config_hash"] == saved
    assert sorted(p.name for p in (tmp_path / "parent" / "ckpt").iterdir()) == [
        "step_00000012", "step_00000020", "step_00000030"]  # fmt: skip  # keep_steps survives keep_last=2

    # a fit over parent and branch counts the shared prefix once; the branch alone keeps its whole curve
    from moelab.ladder.forecast import rung_run, shared_prefixes_once

    p_run, b_run = rung_run(tmp_path / "parent"), rung_run(tmp_path / "branch")
    assert b_run.steps.min() <= 12
    _, cut = shared_prefixes_once([p_run, b_run])
    assert cut.steps.min() == 15 and list(cut.steps) == [s for s in b_run.steps if s > 12]
    assert shared_prefixes_once([b_run])[0].steps.min() == b_run.steps.min()

    # refused: no checkpoint at that step (nothing written); a folder that already holds a branch
    with pytest.raises(RunRefused, match="no checkpoint at step 7"):
        start_branch(tmp_path / "parent", 7, tmp_path / "b2", branch_config(parent_cfg, 7, 20))
    assert not (tmp_path / "b2").exists()
    with pytest.raises(RunRefused, match="already holds a branch"):
        start_branch(tmp_path / "parent", 12, tmp_path / "branch", b)


def test_the_step_graph_records_the_parent():
    parent = train_step("rung", "tiny", ["train.steps=100", "train.keep_steps=[40]", *WSD])
    other = train_step("rung", "tiny", ["train.steps=100", "train.keep_steps=[40]", "train.seed=1", *WSD])
    b = branch_step("rung-40-60", output_of(parent), 40, 60)
    assert b.deps() == [parent]
    assert b.identity() != branch_step("rung-40-60", output_of(other), 40, 60).identity()
    assert b.identity() != branch_step("rung-40-60", output_of(parent), 40, 70).identity()
    assert isinstance(b, Step)


def test_a_branch_may_try_another_rope_scaling_only_before_a_longer_context():
    parent = load_config("tiny", [*WSD, "train.steps=100", "train.lr=0.01", "data.phase_starts=[0.0,0.8]",
                                  "data.phase_seq_lens=[32,128]"])  # fmt: skip
    assert branch_config(parent, 80, 120, ["model.rope_scaling=pi"]).model.rope_scaling == "pi"
    with pytest.raises(RunRefused, match="model.rope_scaling"):  # step 80 already ran at 128 tokens
        branch_config(parent, 81, 120, ["model.rope_scaling=pi"])
    with pytest.raises(RunRefused, match="model.rope_theta"):  # RoPE itself is no such field
        branch_config(parent, 80, 120, ["model.rope_theta=500.0"])
