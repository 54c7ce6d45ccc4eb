"""Ladder plans: Marin's rungs reproduced, the rules of a ladder file, bad files refused."""

from __future__ import annotations

import pytest

from conftest import ROOT, run_cli
from moelab.ladder.plan import load_ladder, plan


def test_marin_ladder_plan_reproduces_marins_rungs(marin):
    rows = plan(load_ladder(ROOT / "ladders" / "marin.yaml"))
    for row, ref in zip(rows, marin["ladder"], strict=True):
        assert row["rung"] == ref["name"]
        assert (row["kv_heads_local"], row["kv_heads_global"]) == (ref["kv_heads_local"], ref["kv_heads_global"])
        assert row["steps"] == pytest.approx(ref["steps"], rel=1e-3)  # 791 tokens per active parameter
        assert row["active_params"] == pytest.approx(ref["expected_active"], rel=0.005)
        assert row["train_flops"] == pytest.approx(ref["expected_train_flops_with_lm_head"], rel=0.005)


def test_tiny_ladder_follows_its_rules():
    rows = plan(load_ladder(ROOT / "ladders" / "tiny.yaml"))
    assert [r["n_heads"] for r in rows] == [2, 3, 4]  # d / head_dim
    assert [r["n_layers"] for r in rows] == [2, 3, 4]  # d / 32
    for r in rows:
        assert 20 <= r["tokens_per_active_param"] < 20 + 16 * 128 / r["active_params"] + 1e-9  # one step's rounding
    assert rows[0]["train_flops"] < rows[1]["train_flops"] < rows[2]["train_flops"]


def test_bad_ladder_file_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "recipe: tiny\nwidths: [64, 100]\nhead_dim: 32\nlayers: [2]\nbatch: 4\ntokens_per_active_param: 20\n"
    )
    res = run_cli("ladder", "plan", str(bad))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert any("batch: unknown key" in x for x in lines)
    res = run_cli("ladder", "plan", str(bad).replace("bad", "missing"))
    assert res.returncode == 2 and "no such ladder file" in res.stderr


def test_seeds_give_each_rung_several_runs_and_the_target_one(tmp_path):
    from moelab.lab.steps import ladder_steps
    from moelab.ladder.plan import rung_config, rung_runs

    two = tmp_path / "demo.yaml"  # the demo's ladder with two runs of every rung, the widest too
    two.write_text((ROOT / "ladders" / "demo.yaml").read_text().replace("top_seeds: 3", "top_seeds: 0"))
    lad = load_ladder(two)
    assert lad.seeds == 2 and lad.top_seeds == 0
    runs = rung_runs(lad)
    assert [name for name, _ in runs] == [f"demo-d{d}{s}" for d in lad.widths for s in ("", "-s1")]
    for (_, a), (_, b) in zip(runs[::2], runs[1::2], strict=True):
        assert (a.train.seed, b.train.seed) == (0, 1) and a.name == b.name  # one size, one name: the law's rung
        assert a.model == b.model and a.train.steps == b.train.steps and a.train.lr_scale == b.train.lr_scale == 4
    steps, target = ladder_steps(str(two))
    assert len(steps) == 2 * len(lad.widths) and len({s.identity() for s in steps}) == 2 * len(lad.widths)
    assert target == rung_config(lad, len(lad.widths)) and target.train.seed == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "ladders" / "demo.yaml").read_text().replace("seeds: 2", "seeds: 0"))
    res = run_cli("ladder", "plan", str(bad))
    assert res.returncode == 2 and "seeds: runs per rung must be >= 1" in res.stderr


def test_top_seeds_give_the_widest_rung_more_runs(tmp_path):
    from moelab.ladder.plan import rung_runs

    lad = tmp_path / "lad.yaml"
    text = (ROOT / "ladders" / "demo.yaml").read_text()
    text = text.replace("top_seeds: 3", "top_seeds: 0")
    lad.write_text(text.replace("top_seeds: 0", "top_seeds: 3"))
    ladder = load_ladder(lad)
    names = [name for name, _ in rung_runs(ladder)]
    top = ladder.widths[-1]
    assert (
        names.count(f"demo-d{top}") == 1 and f"demo-d{top}-s2" in names and f"demo-d{ladder.widths[0]}-s2" not in names
    )
    assert len(names) == 2 * len(ladder.widths) + 1
    lad.write_text(text.replace("top_seeds: 0", "top_seeds: 1"))
    res = run_cli("ladder", "plan", str(lad))
    assert res.returncode == 2 and "top_seeds" in res.stderr and res.stderr.count("\n") == 1
