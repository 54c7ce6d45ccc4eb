"""Fine-tuning from a finished run (train.init_from, `moelab train --init-from`): it starts from the
parent's weights exactly, with its own optimizer, refuses a parent of other shapes before anything is
written, and a lab step records the parent in the step graph."""

from __future__ import annotations

import json

import pytest

from conftest import MICRO
from moelab.cli import main
from moelab.config import config_hash, load_config
from moelab.errors import RunRefused
from moelab.lab.graph import Step, output_of
from moelab.lab.steps import finetune_step, train_step
from moelab.runs import load_run_config, read_jsonl
from moelab.train.loop import train


def _evals(run) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]


def test_a_fine_tune_starts_from_the_parent_s_weights(corpus, tmp_path):
    sets = MICRO + [f"data.sources=[{corpus['code']}]", "train.eval_every=3", "train.checkpoint_every=3"]
    parent = tmp_path / "parent"
    pcfg = load_config("tiny", [*sets, "train.steps=3"])
    train(pcfg, parent, progress=False)
    # the child: another schedule and seed, the same held-out windows; from the parent's step 3
    child = tmp_path / "child"
    ccfg = load_config("tiny", [*sets, "train.steps=2", "train.lr=0.0005", "train.seed=7",
                                f"train.init_from={parent}:3"])  # fmt: skip
    train(ccfg, child, progress=False)
    # its model at step 0 is the parent's at step 3: the same held-out losses, to the bit
    assert _evals(child)[0]["loss"] == _evals(parent)[-1]["loss"]
    seeded = tmp_path / "seeded"  # the same config from its seed starts elsewhere
    train(load_config("tiny", [*sets, "train.steps=1", "train.seed=7"]), seeded, progress=False)
    assert _evals(seeded)[0]["loss"] != _evals(parent)[-1]["loss"]
    event = next(e for e in read_jsonl(child / "events.jsonl") if e.get("event") == "init_from")
    assert (event["parent"], event["step"], event["parent_config_hash"]) == (
        str(parent),
        3,
        config_hash(load_run_config(parent)),
    )
    assert config_hash(ccfg) != config_hash(load_config("tiny", [*sets, "train.steps=2", "train.lr=0.0005",
                                                                 "train.seed=7"]))  # fmt: skip

    # refused before anything is written: a parent of other shapes, a step it never saved
    wide = tmp_path / "wide"
    with pytest.raises(RunRefused, match=r"differ in model.d_model \(64 there, 96 here\)"):
        train(load_config("tiny", [*sets, "model.d_model=96", f"train.init_from={parent}:3"]), wide, progress=False)
    with pytest.raises(RunRefused, match="has no checkpoint at step 2"):
        train(load_config("tiny", [*sets, f"train.init_from={parent}:2"]), wide, progress=False)
    assert not wide.exists()

    # the command line: the newest checkpoint by default, the parent's tokenizer
    out = tmp_path / "cli"
    argv = ["train", "tiny", "--init-from", str(parent), "--steps", "1", "--out", str(out), "--quiet"]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    saved = json.loads((out / "config.json").read_text())["config"]
    assert saved["train"]["init_from"] == f"{parent.resolve()}:3" and saved["data"]["tokenizer"] == str(
        parent.resolve()
    )
    assert _evals(out)[0]["loss"] == _evals(parent)[-1]["loss"]


def test_the_step_graph_records_the_fine_tune_s_parent():
    parent = train_step("pretrain", "tiny", ["train.steps=20"])
    other = train_step("pretrain", "tiny", ["train.steps=20", "train.seed=1"])
    ft = finetune_step("sft", output_of(parent), "tiny", ["train.steps=5"])
    assert isinstance(ft, Step) and ft.deps() == [parent]
    assert ft.identity() != finetune_step("sft", output_of(other), "tiny", ["train.steps=5"]).identity()
    assert ft.identity() != finetune_step("sft", output_of(parent), "tiny", ["train.steps=5"], at=10).identity()


def test_init_from_must_name_a_step():
    from moelab.errors import ConfigError

    with pytest.raises(ConfigError, match='train.init_from: "runs/a"; give RUN:STEP'):
        load_config("tiny", ["train.init_from=runs/a"])


@pytest.mark.slow  # three training processes: `make test-all` (CI) runs it
def test_a_fine_tune_killed_and_resumed_equals_one_not_interrupted(corpus, tmp_path):
    """A fine-tune resumes from its own checkpoint (never from the parent again): killed at step 5 after
    its checkpoint at 4, then resumed, it gives the uninterrupted run's losses and gradient norms."""
    import os
    import subprocess
    import sys

    sets = MICRO + [
        f"data.sources=[{corpus['code']}]",
        "train.checkpoint_every=4",
        "train.eval_every=4",
        "train.async_checkpoint=false",
    ]  # the checkpoint at 4 complete before the kill
    parent = tmp_path / "parent"
    train(load_config("tiny", [*sets, "train.steps=4"]), parent, progress=False)

    def cli(out, *extra, env=None):
        cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--init-from", str(parent), "--steps", "8", "--quiet",
               "--out", str(out), *[x for s in sets for x in ("--set", s)], "--set", "train.lr=0.0005", *extra]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)

    def trajectory(run):
        return [(r["kind"], r["step"], r.get("loss"), r.get("grad_norm")) for r in read_jsonl(run / "metrics.jsonl")]

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli(whole).returncode == 0
    assert cli(cut, env={"MOELAB_TEST_FAULTS": "kill@6"}).returncode == -9
    res = cli(cut, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = [e for e in read_jsonl(cut / "events.jsonl") if e.get("event") == "resume"]
    assert resumed and resumed[-1]["step"] == 4
    assert [e["event"] for e in read_jsonl(cut / "events.jsonl")].count("init_from") == 1  # once, at the start
    assert trajectory(cut) == trajectory(whole)
