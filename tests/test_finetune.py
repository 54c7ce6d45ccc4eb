"""Fine-tuning from a finished run (train.init_from, `moelab train --init-from`): it starts from the
parent's weights exactly, with its own optimizer, refuses a parent of other shapes before anything is
written, and a lab step records the parent in the step graph."""

from __future__ import annotations

import hashlib
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


@pytest.mark.slow  # 14 s: a parent run and its fine-tune (make test under 15 minutes; CI's make test-all runs it)
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

    # a Hugging Face folder that `moelab export hf` wrote: the same model, so the same held-out losses to
    # the bit (a global layer's averaged kv heads come back repeated over their group, which averages back)
    hf = tmp_path / "hf"
    assert main(["export", "hf", str(parent), "--out", str(hf)]) == 0
    out = tmp_path / "from-hf"
    argv = ["train", "tiny", "--init-from", str(hf), "--steps", "1", "--out", str(out), "--quiet"]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
    saved = json.loads((out / "config.json").read_text())["config"]
    assert saved["train"]["init_from"] == f"hf:{hf.resolve()}" and saved["data"]["tokenizer"] == str(hf.resolve())
    assert _evals(out)[0]["loss"] == _evals(parent)[-1]["loss"]
    event = next(e for e in read_jsonl(out / "events.jsonl") if e.get("event") == "init_from")
    assert event["format"] == "hf" and event["step"] == 3
    assert event["sha256"] == hashlib.sha256((hf / "model.safetensors").read_bytes()).hexdigest()
    with pytest.raises(RunRefused, match=r"differ in hidden_size \(64 there, 96 here\)"):
        train(load_config("tiny", [*sets, "model.d_model=96", f"train.init_from=hf:{hf}"]), wide, progress=False)
    other = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(other, model_type="qwen2_moe")))
    with pytest.raises(RunRefused, match="a 'qwen2_moe' model; moelab starts from its own layout only"):
        train(load_config("tiny", [*sets, f"train.init_from=hf:{hf}"]), wide, progress=False)
    assert not wide.exists()


def test_the_hugging_face_layout_reads_back_what_it_writes():
    """to_hf then from_hf: every weight as it was but a global layer's k and v, which come back as each
    used head repeated over its group, so the layer's averaged weights are the same to the bit; a tensor
    missing or of another shape is named."""
    import jax
    import numpy as np

    from moelab.model import init_params
    from moelab.model.hf_layout import from_hf, to_hf
    from moelab.model.layers import group_kv

    # two used heads over four allocated in a global layer: the order of the repeated heads matters
    sets = ["model.n_layers=4", "model.n_shared=1", "model.n_heads=4", "model.n_kv_heads=2", "model.n_kv_heads_local=4"]
    m = load_config("tiny", MICRO + sets).model
    assert m.kv_heads_alloc == 4 and min(m.layer_kv_heads(i) for i in range(4)) == 2
    params = jax.tree.map(np.asarray, init_params(m, jax.random.PRNGKey(0)))
    bias = np.random.default_rng(0).normal(size=(m.n_layers, m.n_routed)).astype(np.float32)
    tensors = {k: np.asarray(v) for k, v in to_hf(params, bias, m).items()}
    back, back_bias = from_hf(tensors, m)
    assert (back_bias == bias).all()
    assert jax.tree.structure(back) == jax.tree.structure(params)
    globals_ = [i for i in range(m.n_layers) if m.layer_kv_heads(i) < m.kv_heads_alloc]
    assert globals_ and len(globals_) < m.n_layers  # both kinds of layer in this model
    for name, w in params["layers"].items():
        for i in range(m.n_layers):
            if name in ("wk", "wv") and i in globals_:
                kv = m.layer_kv_heads(i)
                assert (back["layers"][name][i] != w[i]).any()  # the heads themselves are not kept...
                used = np.asarray(group_kv(back["layers"][name][i], m.kv_heads_alloc, kv))
                assert (used == np.asarray(group_kv(w[i], m.kv_heads_alloc, kv))).all()  # ...what the layer uses is
            else:
                assert (back["layers"][name][i] == w[i]).all(), (name, i)
    for name in ("embed", "head", "final_norm"):
        assert (back[name] == params[name]).all()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.w_up: missing"):
        from_hf({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.w_up"}, m)
    with pytest.raises(ValueError, match=r"lm_head.weight: shape \[64, 512\], this model's is \[512, 64\]"):
        from_hf(dict(tensors, **{"lm_head.weight": tensors["lm_head.weight"].T}), m)
    with pytest.raises(ValueError, match="model.layers.9.x: not a weight of this model"):
        from_hf(dict(tensors, **{"model.layers.9.x": np.zeros(1)}), m)


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
