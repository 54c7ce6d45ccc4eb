"""Stopping and resuming (issue 43): Ctrl-C and SIGTERM save a checkpoint at the next step boundary and
exit 130; --resume says where it continues and refuses to start over silently (--restart); an edited
config.json is refused by its hash, naming the fields; a checkpoint of other shapes is a config
mismatch, never called damaged."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from conftest import MICRO, ROOT
from moelab.config import changed_fields, load_config, to_dict
from moelab.runs import read_jsonl
from moelab.train import checkpoint
from test_train import _train_cli, _trajectory

STEPS = 12
NO_PERIODIC = ("--set", "train.checkpoint_every=100")  # the run's only checkpoints: the interrupt's and the last


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _wait_stopped(pid: int, proc: subprocess.Popen, limit: float = 300) -> None:
    """Until ``pid`` is frozen by its stop@ fault (SIGSTOP, at the step boundary it names)."""
    t0 = time.time()
    while _state(pid) != "T":
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < limit, "the run never reached its stop@ step"
        time.sleep(0.1)


def _popen(corpus, out, *extra, env=None, supervise=False):
    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--out", str(out), "--steps", str(STEPS), "--quiet",
           "--data", corpus["code"], "--data", corpus["prose"], *(a for o in MICRO for a in ("--set", o)), *extra]  # fmt: skip
    if supervise:
        cmd += ["--max-restarts", "2"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    res = _train_cli(corpus, out, *NO_PERIODIC, steps=STEPS)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_ctrl_c_saves_at_the_step_boundary_and_resume_equals_the_uninterrupted_run(corpus, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = _popen(corpus, out, *NO_PERIODIC, env={"MOELAB_TEST_FAULTS": "stop@7"})
    _wait_stopped(proc.pid, proc)  # frozen before step 7 (a real SIGINT then reaches it there, deterministically)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"moelab: stopped by SIGINT at step 7 of {STEPS}: checkpoint ") and "--resume" in last, err
    assert checkpoint.steps(out / "ckpt") == [7]  # saved there and complete (checkpoint_every 100 saved none before)
    events = [e for e in read_jsonl(out / "events.jsonl") if e["event"] in ("interrupted", "failure")]
    assert [(e["event"], e["step"], e["saved"]) for e in events] == [("interrupted", 7, True)]

    # an edited config.json (another width) is refused by its hash, naming the field; the checkpoint is untouched
    good = (out / "config.json").read_text()
    edited = json.loads(good)
    edited["config"]["model"]["d_model"] = 96
    (out / "config.json").write_text(json.dumps(edited))
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    res = subprocess.run([sys.executable, "-m", "moelab", "train", "--resume", "--out", str(out), "--quiet"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert "model.d_model" in res.stderr and "step 7" in res.stderr, res.stderr
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before  # nothing renamed .damaged

    (out / "config.json").write_text(good)
    res = _train_cli(corpus, out, *NO_PERIODIC, "--resume", steps=STEPS)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _trajectory(out) == _trajectory(uninterrupted)


@pytest.mark.slow  # a supervised run stopped by SIGTERM (~25 s)
def test_sigterm_to_a_supervised_run_stops_it_without_a_restart(corpus, tmp_path):
    out = tmp_path / "run"
    sup = _popen(corpus, out, *NO_PERIODIC, env={"MOELAB_TEST_FAULTS": "stop@5"}, supervise=True)
    t0 = time.time()
    while not (children := open(f"/proc/{sup.pid}/task/{sup.pid}/children").read().split()):
        assert sup.poll() is None and time.time() - t0 < 60, "the supervisor started no child"
        time.sleep(0.1)
    child = int(children[0])
    _wait_stopped(child, sup)
    os.kill(sup.pid, signal.SIGTERM)  # to the supervisor alone: it passes it on
    time.sleep(1.0)
    os.kill(child, signal.SIGCONT)
    _, err = sup.communicate(timeout=300)
    assert sup.returncode == 130, err[-3000:]
    assert "stopped by SIGTERM at step 5" in err and "Traceback" not in err, err[-3000:]
    assert checkpoint.steps(out / "ckpt") == [5]
    assert not [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "restart"]


@pytest.mark.slow  # over 8 s: `make test-all` (CI) runs it; make test measured 18:52 with it
def test_resume_refuses_to_start_over_silently_and_restart_does_it_on_purpose(corpus, tmp_path):
    out = tmp_path / "run"
    every2 = ("--set", "train.checkpoint_every=2")
    res = _train_cli(corpus, out, *every2, env={"MOELAB_TEST_FAULTS": "kill@3"}, steps=6)
    assert res.returncode == -9 and checkpoint.steps(out / "ckpt") == [2]
    # its only checkpoint damaged (the arrays' files gone): said, with the way on, and set aside
    shutil.rmtree(out / "ckpt" / "step_00000002" / "state")
    (out / "ckpt" / "step_00000002" / "state").mkdir()
    res = _train_cli(corpus, out, *every2, "--resume", steps=6)
    assert res.returncode == 3 and "--restart" in res.stderr.strip().splitlines()[-1], res.stderr[-3000:]
    assert (out / "ckpt" / "step_00000002.damaged").is_dir() and not checkpoint.steps(out / "ckpt")
    metrics = (out / "metrics.jsonl").read_text()
    assert metrics  # records of steps 0-2, no checkpoint: a second --resume would start over silently
    res = _train_cli(corpus, out, *every2, "--resume", steps=6)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--restart" in res.stderr, res.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == metrics  # refused before anything was written
    res = _train_cli(corpus, out, *every2, "--restart", steps=6)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "from step 0" in res.stderr
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(6)) or steps == list(range(1, 7)), steps  # once each: the records were cut back
    res = _train_cli(corpus, out, *every2, "--restart", steps=6)  # now it has checkpoints
    assert res.returncode == 2 and "--resume" in res.stderr and res.stderr.count("\n") == 1, res.stderr[-3000:]


def test_a_checkpoint_of_other_shapes_is_a_config_mismatch_not_damage(tmp_path):
    root = tmp_path / "ckpt"
    state = {"params": {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}, "step": jnp.int32(3)}
    checkpoint.save(root, 3, state, {"step": 3}, keep_last=2, keep_every=0)
    heard = []
    wider = {"params": {"w": jnp.ones((4, 16)), "b": jnp.zeros((16,))}, "step": jnp.int32(0)}
    with pytest.raises(checkpoint.ShapeMismatch, match=r"2 arrays differ in shape .*params/b \[8\] there, \[16\] here"):
        checkpoint.restore_newest(root, wider, lambda step, why: heard.append(step))
    assert heard == [] and checkpoint.steps(root) == [3]
    restored, meta, step = checkpoint.restore_newest(root, state, lambda step, why: heard.append(step))
    assert step == 3 and meta["step"] == 3 and float(restored["params"]["w"].sum()) == 32.0
    # its arrays' files gone is damage: heard of, skipped
    shutil.rmtree(root / "step_00000003" / "state")
    (root / "step_00000003" / "state").mkdir()
    assert checkpoint.restore_newest(root, state, lambda step, why: heard.append(step)) is None and heard == [3]


def test_changed_fields_names_hashed_fields_and_takes_a_missing_one_at_its_neutral_value():
    base = to_dict(load_config("tiny"))
    other = to_dict(load_config("tiny", ["model.d_model=96", "train.failure_hours=3"]))  # the latter never hashed
    assert changed_fields(base, other) == ["model.d_model"]
    old = json.loads(json.dumps(base))
    del old["train"]["data_seed"]  # written before the field existed: at its neutral value -1
    assert changed_fields(old, base) == []
    assert changed_fields(old, to_dict(load_config("tiny", ["train.data_seed=5"]))) == ["train.data_seed"]
    assert changed_fields({**base, "name": "a"}, {**base, "name": "b"}) == ["name"]
