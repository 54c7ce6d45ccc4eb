"""Training: schedules, optimisers, exact resume after SIGKILL, supervision, the NaN guard, evals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO, MOE_SET, ROOT
from moelab.cli import main
from moelab.config import load_config
from moelab.runs import RunDir, read_jsonl
from moelab.train import checkpoint, optim
from moelab.train.loop import train


def test_linear_schedule_warms_up_to_peak_and_ends_at_min():
    cfg = load_config("tiny", ["train.steps=1000", "train.warmup_frac=0.01", "train.min_lr_ratio=0.05"])
    h = optim.hyper(cfg)
    lr = np.array([float(optim.lr_factor(s, h)) for s in range(1000)])
    assert h.warmup_steps == 10
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert np.all(np.diff(lr[:10]) > 0) and np.all(np.diff(lr[9:]) < 0)
    assert lr[-1] == pytest.approx(0.05)
    assert lr[9 + (999 - 9) // 2] == pytest.approx(1 - 0.5 * 0.95, rel=1e-3)  # halfway down the line


def test_wsd_schedule_shape():
    cfg = load_config(
        "tiny",
        [
            "train.steps=100",
            "train.schedule=wsd",
            "train.warmup_frac=0.1",
            "train.decay_frac=0.2",
            "train.min_lr_ratio=0.0",
        ],
    )
    h = optim.hyper(cfg)
    lr = np.array([float(optim.lr_factor(s, h)) for s in range(100)])
    assert lr[9] == pytest.approx(1.0) and np.all(lr[9:80] == 1.0)
    assert np.all(np.diff(lr[79:]) < 0) and lr[-1] == pytest.approx(0.0, abs=1e-7)


def test_lr_auto_is_marin_heuristic(marin):
    cfg = load_config("marin-535b-a23b")
    h = optim.hyper(cfg)
    ref = marin["lr_heuristic"]["hero_values"]
    assert h.peak_lr == pytest.approx(ref["adam_lr"], rel=1e-3)
    assert h.muon_lr == pytest.approx(ref["muon_lr"], rel=1e-3)
    assert h.beta2 == 0.95  # clip(0.999^(46137344/131072), 0.95, 0.9999)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_weight_decay_is_what_the_mask_says_in_the_updates(name):
    """With zero gradients an update is the decoupled weight decay alone: -rate * decay * weight on
    the decayed parameters (Muon's rate on its matrices, Adam's on the rest), nothing on norms and
    embeddings; under Muon too (optax's muon alone would decay its Adam branch without the mask)."""
    from moelab.train.step import init_train_state

    cfg = load_config("tiny", MICRO + [f"train.optimizer={name}", "train.lr=0.01", "train.weight_decay=0.1",
                                       "train.muon_lr_ratio=3.0", "train.warmup_frac=0.0"])  # fmt: skip
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    params = state["params"]
    opt_state, _ = optim.set_lr(state["opt_state"], 0, h)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.update)(zeros, opt_state, params)
    muon_rate = 0.03 if name == "muon" else 0.01
    for leaf, rate in (("embed", 0.0), ("final_norm", 0.0), ("head", 0.01)):
        np.testing.assert_allclose(updates[leaf], -rate * 0.1 * params[leaf], rtol=1e-5, atol=1e-9)
    for leaf, rate in (
        ("attn_norm", 0.0),
        ("mlp_norm", 0.0),
        ("router", 0.01),
        ("wq", muon_rate),
        ("w_gate", muon_rate),
    ):
        np.testing.assert_allclose(updates["layers"][leaf], -rate * 0.1 * params["layers"][leaf], rtol=1e-5, atol=1e-9)


def test_muon_ratio_holds_under_lr_auto():
    cfg = load_config("tiny", ["train.lr=auto", "train.optimizer=muon", "train.muon_lr_ratio=2.5"])
    h = optim.hyper(cfg)
    assert h.muon_lr == pytest.approx(2.5 * h.peak_lr)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizers_train_and_skip_decay_on_norms_and_embeddings(name):
    from moelab.model import loss_fn
    from moelab.train.step import init_train_state, make_train_step

    cfg = load_config("tiny", MICRO + [f"train.optimizer={name}", "train.steps=30", "train.lr=0.01"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    mask = optim.decay_mask(state["params"])
    assert mask["embed"] is False and mask["layers"]["attn_norm"] is False and mask["head"] is True
    assert mask["layers"]["w_gate"] is True
    batch = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 512)
    first = float(
        jax.jit(loss_fn, static_argnums=4)(
            state["params"], state["model_state"], batch[:, :-1], batch[:, 1:], cfg.model
        )[0]
    )
    step = make_train_step(cfg, opt, h)
    for s in range(30):
        state, metrics = step(state, batch, np.int32(s))
    assert bool(metrics["finite"]) and float(metrics["loss"]) < first - 1.0
    assert float(metrics["lr"]) == pytest.approx(h.peak_lr * float(optim.lr_factor(29, h)), rel=1e-6)


def _train_cli(corpus, out, *extra, env=None, steps=30):
    cmd = [
        sys.executable,
        "-m",
        "moelab",
        "train",
        "tiny",
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--quiet",
        "--data",
        corpus["code"],
        "--data",
        corpus["prose"],
    ]
    for o in MICRO:
        cmd += ["--set", o]
    cmd += list(extra)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=600)


def _trajectory(run_dir) -> list[tuple]:
    recs = read_jsonl(RunDir(run_dir).metrics)
    return [
        (r["kind"], r["step"], r.get("loss"), r.get("grad_norm"), json.dumps(r.get("grad_norm_groups"))) for r in recs
    ]


@pytest.fixture(scope="module")
def reference_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    res = _train_cli(corpus, out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow  # the supervisor test below kills twice, resumes and equals the same reference
def test_resume_after_sigkill_equals_uninterrupted(corpus, reference_run, tmp_path):
    out = tmp_path / "run"
    res = _train_cli(corpus, out, env={"MOELAB_TEST_FAULTS": "kill@15"})
    assert res.returncode == -9
    # step 10's save runs in the background: complete by step 15, or still in flight and not counted
    assert checkpoint.steps(out / "ckpt") in ([], [10])
    res = _train_cli(corpus, out, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert _trajectory(out) == _trajectory(reference_run)
    kinds = [e["event"] for e in read_jsonl(out / "events.jsonl")]
    assert kinds.count("launch") == 2 and "resume" in kinds and kinds[-1] == "end"


@pytest.mark.slow  # a save stopped at each of its stages, SIGKILL included: tests/test_checkpoint.py
def test_kill_during_checkpoint_save_is_ignored_on_resume(corpus, reference_run, tmp_path):
    out = tmp_path / "run"
    res = _train_cli(corpus, out, env={"MOELAB_TEST_FAULTS": "kill_in_save@20"})
    assert res.returncode == -9
    assert (out / "ckpt" / "step_00000020.orbax-checkpoint-tmp").exists()  # written, never named complete
    assert checkpoint.steps(out / "ckpt") == [10]  # the half-written one does not count
    res = _train_cli(corpus, out, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    resume = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "resume")
    assert resume["step"] == 10
    assert _trajectory(out) == _trajectory(reference_run)
    assert not list((out / "ckpt").glob("*.orbax-checkpoint-tmp*"))


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(corpus, reference_run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference_run, out)  # a finished run, made unfinished: its summary gone
    (out / "summary.json").unlink()
    newest = checkpoint.steps(out / "ckpt")[-1]
    # every file of its state cut short: where a restore reads the arrays from (data files, or the small
    # ones kept in the index itself) depends on how the save's threads laid them out (cutting only the
    # largest file, or only the data files, left a restore that read none of it: seen here, now and then)
    files = [p for p in (out / "ckpt" / f"step_{newest:08d}" / "state").rglob("*")
             if p.is_file() and p.name != "commit_success.txt"]  # complete on record, damaged in content  # fmt: skip
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = _train_cli(corpus, out, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if line.startswith("moelab:") and "is damaged" in line]
    assert len(said) == 1 and f"step_{newest:08d}: the checkpoint is damaged" in said[0]
    events = read_jsonl(out / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "checkpoint_damaged"] == [newest]
    previous = [e for e in events if e["event"] == "resume"][-1]["checkpoint"]
    assert previous < newest and (out / "ckpt" / f"step_{newest:08d}.damaged").exists()
    assert _trajectory(out) == _trajectory(reference_run)  # from the previous one again, to the same numbers


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_supervisor_restarts_a_killed_run(corpus, reference_run, tmp_path):
    out = tmp_path / "run"
    res = _train_cli(corpus, out, "--max-restarts", "3", env={"MOELAB_TEST_FAULTS": "kill@12,kill@25"})
    assert res.returncode == 0, res.stderr[-3000:]
    restarts = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "restart"]
    assert [r["restart"] for r in restarts] == [1, 2]
    assert all("SIGKILL" in r["cause"] for r in restarts)
    assert _trajectory(out) == _trajectory(reference_run)


def _micro(corpus, *more):
    return load_config("tiny", [*MICRO, f"data.sources=[{corpus['code']}, {corpus['prose']}]", *more])


@pytest.mark.slow  # two short runs (~40 s); the model-level ragged test stays in the default run
def test_training_through_ragged_dot_equals_the_default(corpus, tmp_path):
    """The train loop with model.moe_impl=ragged (the GPU and TPU default, run here on CPU) gives
    the CPU default's losses."""
    sets = ["train.steps=4", "train.eval_every=4", "model.dispatch=dropless", "model.eval_dispatch="]
    train(_micro(corpus, *sets), tmp_path / "auto", progress=False)
    train(_micro(corpus, *sets, "model.moe_impl=ragged"), tmp_path / "ragged", progress=False)

    def losses(d):
        return [r["loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r["kind"] == "train"]

    assert len(losses("ragged")) == 4
    np.testing.assert_allclose(losses("ragged"), losses("auto"), rtol=0, atol=1e-4)


def test_a_non_finite_step_changes_nothing():
    """A step whose loss is not finite (poisoned here) returns the state it was given, every leaf
    equal: parameters, optimiser state (its step count too) and router biases; a finite one moves them."""
    from moelab.train.step import init_train_state, make_train_step

    cfg = load_config("tiny", MICRO + ["train.lr=0.01"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    step = make_train_step(cfg, opt, h, faults=True)  # compiled with fault arguments: poison makes the loss NaN
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 512))
    none = {"lr_scale": np.float32(1), "logit_z_scale": np.float32(1), "freeze_bias": np.bool_(False)}
    state, _ = step(state, batch, np.int32(0), {**none, "poison": np.bool_(False)})  # nonzero moments and biases
    before = jax.tree.map(np.array, state)
    after, metrics = step(state, batch, np.int32(1), {**none, "poison": np.bool_(True)})
    assert not bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    moved, metrics = step(after, batch, np.int32(1), {**none, "poison": np.bool_(False)})
    assert bool(metrics["finite"])
    assert not np.array_equal(np.asarray(moved["params"]["head"]), before["params"]["head"])


def test_nan_step_is_skipped(corpus, tmp_path):
    cfg = _micro(corpus, "train.steps=12", "train.poison_steps=[5]", "train.eval_every=12")
    summary = train(cfg, tmp_path / "run", progress=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "nan_skip"] == [5]
    assert not any(e["event"] == "nan_restore" for e in events)
    steps = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"}
    assert np.isnan(steps[6]["loss"]) and np.isfinite(steps[7]["loss"]) and np.isfinite(summary["final_loss"])


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_nan_run_restores_the_checkpoint_and_skips_the_batches(corpus, tmp_path):
    cfg = _micro(corpus, "train.steps=24", "train.poison_steps=[12, 13, 14]", "train.eval_every=24")
    train(cfg, tmp_path / "run", progress=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    (restore,) = [e for e in events if e["event"] == "nan_restore"]
    assert restore["restored_step"] == 10 and restore["skipping"] == [12, 13, 14]
    assert events[-1]["event"] == "end"
    recs = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [s for s in range(1, 25) if s not in (13, 14, 15)]
    assert all(np.isfinite(r["loss"]) for r in recs)


def test_nan_guard_stops_when_restoring_does_not_help(corpus, tmp_path, capsys):
    poison = "train.poison_steps=[12, 13, 14, 15, 16, 17]"
    args = [
        "train",
        "tiny",
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "24",
        "--quiet",
        "--data",
        corpus["code"],
        "--data",
        corpus["prose"],
    ]
    for o in [*MICRO, poison, "train.eval_every=24"]:
        args += ["--set", o]
    assert main(args) == 3
    err = capsys.readouterr().err.strip().splitlines()
    stop = [line for line in err if "ALERT" not in line]  # health ALERTs are printed as they happen
    assert len(stop) == 1 and "NaN guard" in stop[0] and "again after a restore" in stop[0]
    assert all(line.startswith("moelab: ALERT at step") for line in err if line not in stop)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert events[-1]["event"] == "failure" and checkpoint.steps(tmp_path / "run" / "ckpt") == [10]


def test_metrics_and_eval_records(corpus, tmp_path):
    cfg = _micro(corpus, "train.steps=20", "train.log_every=5", "model.dispatch=capacity", "model.capacity_factor=1.0")
    train(cfg, tmp_path / "run", progress=False)
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    tr = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in tr] == [5, 10, 15, 20]
    assert [r["step"] for r in ev] == list(range(0, 21))  # every 5% of 20 steps
    r = tr[-1]
    for key in (
        "loss",
        "ce",
        "logit_z",
        "aux_loss",
        "router_z_loss",
        "lr",
        "grad_norm",
        "dropped_frac",
        "spilled_frac",
        "max_mean_load",
        "router_entropy",
        "bias_mean",
        "bias_std",
        "tokens_per_s",
        "step_time",
        "mfu",
        "tokens",
    ):
        assert key in r and np.isfinite(r[key]), key
    assert set(r["grad_norm_groups"]) >= {
        "embedding",
        "head",
        "attention",
        "router",
        "routed_experts",
        "shared_experts",
    }
    assert len(r["dropped_frac_per_layer"]) == 2 and np.array(r["expert_load"]).shape == (2, 8)
    assert r["tokens"] == 20 * 4 * 32
    gn = np.sqrt(sum(v**2 for v in r["grad_norm_groups"].values()))
    assert gn == pytest.approx(r["grad_norm"], rel=1e-4)  # the groups partition the parameters
    e = ev[-1]
    keys = {"code", "prose", "macro", "mix"}
    assert set(e["loss"]) == keys and set(e["bpb_dropless"]) == keys
    assert e["loss"]["macro"] == pytest.approx((e["loss"]["code"] + e["loss"]["prose"]) / 2)
    # mix: each domain by its share of the training rows; with no mixture given, its share of the training tokens
    from moelab.data.store import build_store

    store = build_store(cfg.data, cfg.model.vocab_size, progress=False)
    code, prose = (len(store.stream(d, "train")) for d in ("code", "prose"))
    w = code / (code + prose)
    assert 0.05 < w < 0.95
    assert e["loss"]["mix"] == pytest.approx(w * e["loss"]["code"] + (1 - w) * e["loss"]["prose"], rel=1e-9)
    # epochs counted exactly: every row read is one window of one domain's shuffled pass
    windows = {d: (len(store.stream(d, "train")) - 1) // 32 for d in ("code", "prose")}
    assert sum(r["epochs"][d] * windows[d] for d in windows) == pytest.approx(20 * 4)


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_eval_command_reproduces_the_final_eval(corpus, tmp_path, capsys):
    """Also a validation set (data.validation): evaluated in the loop, never trained on, outside
    macro and mix; `moelab eval --data` on the same source gives the same numbers."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": (lib / f"{n}.py").read_text()}) + "\n" for n in ("calendar", "csv")))
    cfg = _micro(corpus, "train.steps=10", "train.eval_every=10", f"data.validation=[paloma={val}]")
    train(cfg, tmp_path / "run", progress=False)
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    final = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert res["step"] == 10
    for d in ("code", "prose", "macro", "paloma"):
        assert res["loss"][d] == pytest.approx(final["loss"][d], rel=1e-6)
    assert final["loss"]["macro"] == pytest.approx((final["loss"]["code"] + final["loss"]["prose"]) / 2)
    assert main(["eval", str(tmp_path / "run"), "--data", f"paloma={val}", "--json"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert set(other["loss"]) == {"paloma"} and other["data"] == [f"paloma={val}"]
    assert other["loss"]["paloma"] == pytest.approx(final["loss"]["paloma"], rel=1e-6)
    assert other["bpb"]["paloma"] == pytest.approx(final["bpb"]["paloma"], rel=1e-6)
    assert main(["eval", str(tmp_path / "run"), "--checkpoint", "7"]) == 2


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_eval_noise_on_disjoint_windows(corpus, tmp_path, capsys):
    cfg = _micro(corpus, "train.steps=6", "train.eval_every=6", "train.eval_tokens=64")
    train(cfg, tmp_path / "run", progress=False)
    assert main(["eval", str(tmp_path / "run"), "--noise", "3", "--against", str(tmp_path / "run"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    final = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert res["sets"] == 3 and len(set(res["macro"])) == 3  # three different sets of windows
    assert res["macro"][0] == pytest.approx(final["loss_dropless"]["macro"], rel=1e-6)  # the first is the usual one
    assert res["relative_sd"] == pytest.approx(np.std(res["macro"], ddof=1) / np.mean(res["macro"]))
    assert res["paired_relative_sd"] == pytest.approx(0.0, abs=1e-9)  # a run against itself: nothing left
    cfg = _micro(corpus, "train.steps=2", "train.eval_every=2", "train.eval_tokens=100000")
    train(cfg, tmp_path / "big", progress=False)
    assert main(["eval", str(tmp_path / "big"), "--noise"]) == 2  # one set of windows only: refused


def test_refuses_to_overwrite_and_to_resume_with_another_config(corpus, tmp_path, capsys):
    cfg = _micro(corpus, "train.steps=2", "train.eval_every=2")
    train(cfg, tmp_path / "run", progress=False)
    base = [
        "train",
        "tiny",
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--quiet",
        "--data",
        corpus["code"],
        "--data",
        corpus["prose"],
    ]
    for o in [*MICRO, "train.eval_every=2"]:
        base += ["--set", o]
    assert main(base) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main([*base, "--resume", "--set", "model.top_k=1"]) == 2
    assert "model.top_k" in capsys.readouterr().err


@pytest.mark.slow  # ~30 s; training is checked by default by test_tiny_overfits_one_batch and the demo's test
def test_training_lowers_held_out_loss_on_every_domain(tmp_path):
    cfg = load_config(
        "tiny",
        MOE_SET
        + [
            "train.steps=120",
            "train.batch_size=8",
            "train.eval_every=120",
            "train.eval_tokens=2048",
            "data.max_bytes_per_domain=400000",
            "train.checkpoint_every=120",
        ],
    )
    summary = train(cfg, tmp_path / "run", progress=False)
    first, final = summary["first_eval"]["loss"], summary["final_eval"]["loss"]
    assert set(first) == {"stdlib-code", "stdlib-tests", "stdlib-docs", "macro", "mix"}
    for domain in first:
        assert final[domain] < first[domain] - 1.0, (domain, first[domain], final[domain])


def test_trackers_mirror_the_metrics(corpus, tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "tiny",
        "--out",
        str(out),
        "--steps",
        "4",
        "--quiet",
        "--data",
        corpus["code"],
        "--data",
        corpus["prose"],
        "--tracker",
        "wandb",
        "--tracker",
        "tensorboard",
    ]
    for o in [*MICRO, "train.eval_every=4"]:
        args += ["--set", o]
    assert main(args) == 0
    (tb,) = (out / "tensorboard").glob("events.out.tfevents.*")
    assert b"train/loss" in tb.read_bytes() and b"eval/loss/macro" in tb.read_bytes()
    (wb,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"train/loss" in wb.read_bytes()
    # per-layer series reach both trackers, one per layer
    assert b"train/dropped_frac_per_layer/layer_0" in tb.read_bytes()
    assert b"train/router_entropy_per_layer/layer_0" in wb.read_bytes()
    assert (out / "metrics.jsonl").exists()  # the local files are always written
    run_id = (out / "wandb_id").read_text()
    assert run_id in wb.name  # the W&B run is the one whose id the folder keeps


def test_wandb_settings_come_from_the_config_then_the_environment_and_a_resume_keeps_the_id(tmp_path):
    """Without a network: what wandb.init would be called with."""
    from moelab.config import load_config
    from moelab.train.trackers import _flat, wandb_settings

    cfg = load_config("tiny")
    s = wandb_settings(cfg, tmp_path / "a", env={})
    assert (s["mode"], s["project"], s["entity"], s["resume"]) == ("offline", "moelab", None, None)
    env = {"WANDB_MODE": "online", "WANDB_PROJECT": "lab", "WANDB_ENTITY": "team"}
    s = wandb_settings(cfg, tmp_path / "a", env=env, tags=["exp24_x", "demo-target"])
    assert (s["mode"], s["project"], s["entity"], s["tags"]) == ("online", "lab", "team", ["exp24_x", "demo-target"])
    mine = load_config("tiny", ["train.tracker_mode=disabled", "train.tracker_project=p", "train.tracker_entity=e"])
    s = wandb_settings(mine, tmp_path / "a", env=env)  # the config's own settings win over the environment
    assert (s["mode"], s["project"], s["entity"]) == ("disabled", "p", "e")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "wandb_id").write_text("abc123\n")
    s = wandb_settings(cfg, tmp_path / "b", env={})
    assert (s["id"], s["resume"]) == ("abc123", "allow")  # a resumed run continues the same W&B run
    assert wandb_settings(cfg, tmp_path / "c", env={})["id"] != wandb_settings(cfg, tmp_path / "d", env={})["id"]
    flat = _flat({"dropped_frac_per_layer": [0.1, 0.2], "expert_load": [[1.0, 2.0]], "loss": {"mix": 3.0}})
    assert flat == {"dropped_frac_per_layer/layer_0": 0.1, "dropped_frac_per_layer/layer_1": 0.2, "loss/mix": 3.0}


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_a_resumed_run_continues_its_wandb_run(corpus, tmp_path):
    """A run stopped after two steps and resumed: one W&B id, kept in the folder, for both launches."""
    from moelab.config import load_config
    from moelab.train.loop import RunError, train
    from moelab.train.trackers import make_trackers

    out = tmp_path / "run"
    cfg = load_config("tiny", [*MICRO, f"data.sources=[{corpus['code']}]", "train.steps=4", "train.eval_every=0",
                               "train.checkpoint_every=2"])  # fmt: skip
    calls = iter(range(100))
    with pytest.raises(RunError):
        train(cfg, out, progress=False, trackers=make_trackers(["wandb"], cfg, out), stop=lambda: next(calls) >= 2)
    first = (out / "wandb_id").read_text()
    train(None, out, resume=True, progress=False, trackers=make_trackers(["wandb"], cfg, out))
    assert (out / "wandb_id").read_text() == first
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(first in r.name for r in runs)  # both launches log to the one W&B run


@pytest.mark.slow  # ~35 s; the NaN restore-and-skip test stays in the default run
def test_nan_streak_across_a_checkpoint_resumes_exactly(corpus, tmp_path):
    poison = ("--set", "train.poison_steps=[8, 9, 10]", "--set", "train.eval_every=24")
    ref = _train_cli(corpus, tmp_path / "ref", *poison, steps=24)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _train_cli(corpus, tmp_path / "run", *poison, steps=24, env={"MOELAB_TEST_FAULTS": "kill@10"})
    assert killed.returncode == -9
    resumed = _train_cli(corpus, tmp_path / "run", *poison, "--resume", steps=24)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _trajectory(tmp_path / "run") == _trajectory(tmp_path / "ref")
    for run in ("ref", "run"):
        restores = [e for e in read_jsonl(tmp_path / run / "events.jsonl") if e["event"] == "nan_restore"]
        assert [r["skipping"] for r in restores] == [[8, 9, 10]], run


def test_skipped_steps_at_the_end_still_evaluate_and_checkpoint(corpus, tmp_path):
    cfg = _micro(corpus, "train.steps=24", "train.poison_steps=[21, 22, 23]", "train.eval_every=12")
    summary = train(cfg, tmp_path / "run", progress=False)
    evals = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [0, 12, 24] and 24 in checkpoint.steps(tmp_path / "run" / "ckpt")
    assert summary["final_eval"]["loss"]["macro"] < summary["first_eval"]["loss"]["macro"]


def test_health_runs_in_the_loop_and_offline(corpus, tmp_path, capsys):
    cfg = _micro(corpus, "train.steps=20", "train.eval_every=10", "train.poison_steps=[15]")
    train(cfg, tmp_path / "run", progress=False)
    health = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "health"]
    assert any(e["check"] == "non_finite" and e["level"] == "ALERT" and e["step"] == 16 for e in health)
    assert "ALERT at step 16: non_finite" in capsys.readouterr().err  # printed at once
    assert main(["health", str(tmp_path / "run"), "--json"]) == 0
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["non_finite"]["first_alert"] == 16 and rows["non_finite"]["level"] == "OK"  # recovered
    assert rows["lr_schedule"]["level"] == "OK"


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_an_injected_fault_is_caught_by_the_health_checks(corpus, tmp_path):
    cfg = _micro(corpus, "train.steps=40", "train.eval_every=40", "train.inject=[lr_spike@25:60]")
    train(cfg, tmp_path / "run", progress=False)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [(e["fault"], e["step"]) for e in events if e["event"] == "inject"] == [("lr_spike", 25)]
    alerts = [e for e in events if e["event"] == "health" and e["level"] == "ALERT"]
    assert alerts and all(e["step"] > 25 for e in alerts)
    assert alerts[0]["step"] <= 25 + 2 + 5  # caught within a few log steps (5% of 40 steps is 2)
    lrs = {r["step"]: r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"}
    assert 50 * lrs[25] < lrs[26] < 70 * lrs[25]  # metrics step 26 is data step 25, the first spiked one


def test_fault_arguments():
    from moelab.monitor.faults import Injector, parse

    assert parse("lr_spike@10").arg == 10.0 and parse("zloss_off@3").arg is None
    for bad, why in (("zloss_off@3:2", "takes no argument"), ("lr_spike@-1", ">= 0"), ("lr_high@4:0", "> 0")):
        with pytest.raises(ValueError, match=why):
            parse(bad)
    inj = Injector(["zloss_off@5", "router_collapse@8:3", "data_corruption@2:prose"], ["code", "prose"])
    args = inj.step_args(9)
    # each fault changes one thing: z-loss off leaves the learning rate alone
    assert float(args["lr_scale"]) == 1.0 and float(args["logit_z_scale"]) == 0.0 and bool(args["freeze_bias"])
    assert float(inj.step_args(4)["logit_z_scale"]) == 1.0
    batch = np.zeros((4, 8), np.int32)
    out = inj.corrupt(3, batch, np.array([0, 1, 0, 1]), ["code", "prose"], 512, 0)
    assert (out[[0, 2]] == 0).all() and (out[[1, 3]] != 0).any()
    with pytest.raises(ValueError, match="not a domain"):
        Injector(["data_corruption@2:poetry"], ["code"])
    # a wrong plan (lr_high) is in the plan and applied; a spike is applied only; a stuck loader repeats
    inj = Injector(["lr_high@0:3", "lr_spike@10:2", "data_stuck@20:4"], ["code"])
    assert inj.plan_scale(5) == 3.0 and float(inj.step_args(5)["lr_scale"]) == 3.0
    assert inj.plan_scale(12) == 3.0 and float(inj.step_args(12)["lr_scale"]) == 6.0
    assert [inj.data_step(s) for s in (19, 20, 23, 24, 29)] == [19, 20, 23, 20, 21]


@pytest.mark.slow  # 11 s: two runs and a restore (make test under 15 minutes; CI's make test-all runs it)
def test_a_run_resumed_after_a_restore_restores_again_as_the_uninterrupted_one(corpus, tmp_path):
    """Two NaN streaks with a checkpoint between them: the uninterrupted run restores twice; a run
    resumed from the checkpoint written after the first restore must do the same, not stop."""
    import shutil

    cfg = _micro(corpus, "train.steps=30", "train.poison_steps=[12, 13, 14, 22, 23, 24]", "train.eval_every=30")
    train(cfg, tmp_path / "ref", progress=False)
    restores = [e for e in read_jsonl(tmp_path / "ref" / "events.jsonl") if e["event"] == "nan_restore"]
    assert [e["restored_step"] for e in restores] == [10, 20]
    meta = checkpoint.read_meta(tmp_path / "ref" / "ckpt" / "step_00000020")
    assert meta["nan_guard"]["restored"] is False  # written after the first restore: a fresh place to restore to
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "ckpt" / "step_00000030")  # as if it had died before step 30's checkpoint
    train(cfg, tmp_path / "run", resume=True, progress=False)
    ref = [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl") if r["kind"] == "train"]
    got = [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert got == ref


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_mfu_is_per_device_against_the_compute_dtype_peak(corpus, tmp_path):
    from moelab import accounting
    from moelab.cache import matmul_peak

    cfg = _micro(
        corpus, "train.steps=6", "train.eval_every=6", "mesh.data=8", "train.batch_size=8", "train.log_every=2"
    )
    train(cfg, tmp_path / "run", progress=False)
    per_token = 3 * accounting.count(cfg).forward_flops_per_token
    recs = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    for r in recs[1:]:  # the first log step timed nothing (it compiled)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / (1e11 * 8), rel=1e-9)  # eight devices
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8, rel=1e-12)
        assert r["flops_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8 * per_token, rel=1e-12)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["devices"] == 8 and summary["peak_flops"] == 1e11 and summary["peak_source"] == "train.peak_flops"
    assert summary["flops_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 8 * per_token, rel=1e-12)
    assert matmul_peak(sizes=(256,), repeats=1, dtype="bfloat16") > 0  # the compute dtype's own peak is measured


def test_the_published_peaks_by_device_kind():
    from moelab import devices
    from moelab.config import load_config
    from moelab.train.loop import device_peak

    assert devices.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert devices.peak_flops("NVIDIA GB200", "bfloat16") == 2.5e15
    assert devices.peak_flops("TPU v5p", "float32") is None  # TPUs publish no fp32 matmul peak
    assert devices.peak_flops("TPU v5 lite", "bfloat16") is None  # v5e is not v5p
    assert devices.lookup("tpu-v6e").memory_gb == 32 and devices.lookup("gb200").memory_gb == 192
    peak, source = device_peak(load_config("tiny", ["train.peak_flops=2e11"]))
    assert (peak, source) == (2e11, "train.peak_flops")


def test_the_matmul_peak_is_measured_once_a_week_per_machine(tmp_path, monkeypatch):
    from moelab import cache as record

    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(record, "matmul_peak", lambda dtype="float32": calls.append(dtype) or 1e11 * len(calls))
    assert record.cached_matmul_peak("float32") == 1e11 and record.cached_matmul_peak("float32") == 1e11
    assert record.cached_matmul_peak("bfloat16") == 2e11 and calls == ["float32", "bfloat16"]
    known = json.loads((tmp_path / "peaks.json").read_text())
    for v in known.values():
        v["time"] -= record.PEAK_MAX_AGE_S + 1  # a week later: measured again
    (tmp_path / "peaks.json").write_text(json.dumps(known))
    assert record.cached_matmul_peak("float32") == 3e11 and len(calls) == 3


def test_a_run_whose_every_step_compiled_reports_no_speed(tmp_path, recwarn):
    """One step: it compiled, so it is not timed; the summary leaves tokens/s and MFU out (no nan, no
    numpy warning) and the printed summary says so."""
    import io
    from contextlib import redirect_stdout

    from moelab.cli.common import print_summary
    from moelab.config import load_config
    from moelab.runs import RunDir
    from moelab.train.loop import summarize

    run = RunDir(tmp_path)
    rec = {"kind": "train", "step": 1, "loss": 6.8, "dropped_frac": 0.01, "spilled_frac": 0.0,
           "tokens_per_s": float("nan"), "mfu": float("nan")}  # fmt: skip
    run.metrics.write_text(json.dumps(rec) + "\n")
    out = summarize(run, load_config("tiny", ["train.steps=1"]))
    assert "tokens_per_s" not in out and "mfu" not in out and out["final_loss"] == 6.8
    assert not [w for w in recwarn if "NaN" in str(w.message)]
    text = io.StringIO()
    with redirect_stdout(text):
        print_summary(out)
    assert "speed not measured" in text.getvalue() and "nan" not in text.getvalue()
    rec2 = {**rec, "step": 2, "tokens_per_s": 1000.0, "mfu": 0.1}
    run.metrics.write_text(json.dumps(rec) + "\n" + json.dumps(rec2) + "\n")
    assert summarize(run, load_config("tiny", ["train.steps=2"]))["tokens_per_s"] == 1000.0


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_a_run_compiled_at_xlas_default_level_resumes_exactly(corpus, tmp_path):
    """Every other equality test compiles with LLVM's optimisation off (tests/conftest.py, for speed);
    real runs do not. One end to end at XLA's default level: a run killed at step 5 (SIGKILL, after
    its checkpoint at step 2 or 4) and resumed equals the uninterrupted run, loss and gradient norms alike."""
    default = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}  # no backend optimisation flag
    ref, out = tmp_path / "ref", tmp_path / "run"
    every = ("--set", "train.checkpoint_every=2")
    res = _train_cli(corpus, ref, *every, env=default, steps=8)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _train_cli(corpus, out, *every, env={**default, "MOELAB_TEST_FAULTS": "kill@5"}, steps=8)
    assert res.returncode == -9 and checkpoint.steps(out / "ckpt") == [2, 4]  # kill@ lets the save in flight finish
    res = _train_cli(corpus, out, *every, "--resume", env=default, steps=8)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _trajectory(out) == _trajectory(ref)
