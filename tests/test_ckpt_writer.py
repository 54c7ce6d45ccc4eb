"""train.checkpoint_writer: process (moelab.train.ckpt_writer): a process at idle priority writes each
save from a copy of the state in shared memory. It writes what the thread writer writes (the same
arrays, meta, files and retention), replaces a step saved again, brings its errors back to the
training process, dies with it, and a run trained with it is the run trained without it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MICRO
from moelab.config import config_hash, load_config
from moelab.errors import ConfigError
from moelab.runs import read_jsonl
from moelab.train import checkpoint
from moelab.train.checkpoint import Checkpoints
from moelab.train.ckpt_writer import layout
from moelab.train.loop import train


def _state(seed: int) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "params": {"w": jax.random.normal(k[0], (64, 96)), "b": jax.random.normal(k[1], (97,)).astype(jnp.bfloat16)},
        "opt": {"count": jnp.int32(seed), "mu": jax.random.normal(k[2], (3, 5, 7))},
    }


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def test_the_layout_packs_every_array_aligned_without_overlap():
    arrays = [np.zeros((3, 5), np.float32), np.zeros((0,), np.int8), np.zeros((7,), np.uint8), np.zeros((2, 2))]
    specs, size = layout(arrays)
    spans = [(off, off + a.nbytes) for (_, _, off), a in zip(specs, arrays, strict=True)]
    assert [off for off, _ in spans] == [0, 64, 64, 128]  # 60 bytes, 0, 7 (rounded to 64 each), then 32
    assert all(off % 64 == 0 for off, _ in spans) and size == 192
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_the_writer_process_saves_what_the_thread_writer_saves(tmp_path):
    done = {}
    for w in ("thread", "process"):
        done[w] = []
        ck = Checkpoints(tmp_path / w, keep_last=2, writer=w, on_complete=done[w].append)
        for step in (3, 7, 9):
            ck.save(step, _state(step), {"step": step})
            ck.poll()
        ck.close()
        assert checkpoint.steps(tmp_path / w) == [7, 9]  # retention: the newest 2, pruned in the writer
    assert [d["step"] for d in done["process"]] == [3, 7, 9] and all(d["background"] for d in done["process"])
    for step in (7, 9):
        a, meta_a = checkpoint.restore(tmp_path / "thread", step, _state(0))
        b, meta_b = checkpoint.restore(tmp_path / "process", step, _state(0))
        assert _equal(b, _state(step)) and _equal(a, b) and meta_a == meta_b == {"step": step}
    names = sorted(p.name for p in (tmp_path / "process" / "step_00000009").iterdir())
    assert names == ["_CHECKPOINT_METADATA", "commit_success.txt", "meta", "state"]
    assert sorted(p.name for p in (tmp_path / "process").iterdir()) == ["step_00000007", "step_00000009"]


def test_a_step_saved_again_through_the_writer_process_replaces_the_old_one(tmp_path):
    ck = Checkpoints(tmp_path / "ck", keep_last=3, writer="process", background=False)
    ck.save(5, _state(5), {"step": 5})
    ck.save(5, _state(6), {"step": 5, "again": True})
    ck.close()
    state, meta = checkpoint.restore(tmp_path / "ck", 5, _state(0))
    assert _equal(state, _state(6)) and meta == {"step": 5, "again": True}
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000005"]  # no .replaced left


def test_the_writer_process_error_is_raised_in_the_training_process(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpoints(root, writer="process")
    ck.save(1, _state(1), {"step": 1})
    ck.wait()
    for p in root.iterdir():  # the folder becomes a file: the writer's next save cannot be made
        checkpoint._rmtree(p)
    root.rmdir()
    root.write_text("not a folder")
    ck.save(2, _state(2), {"step": 2})
    with pytest.raises(RuntimeError, match="the checkpoint writer process: .*"):
        ck.wait()
    ck.close()
    assert ck.writer.proc is None  # ended


def test_the_writer_process_dies_with_the_training_process_even_inside_a_save(tmp_path):
    """Killed with its parent (not only at the pipe's end, which it reads between saves): a save under
    way never goes on writing after the run that asked for it died."""
    (tmp_path / "slowsave.py").write_text(
        "import pathlib, time\n"
        "class Slow:  # a save that takes two minutes, saying when it started\n"
        "    def save(self, step, state, meta):\n"
        f"        pathlib.Path({str(tmp_path / 'started')!r}).write_text('yes')\n"
        "        time.sleep(120)\n"
        "    def close(self):\n"
        "        pass\n"
    )
    code = (
        "import os, pathlib, sys, time, numpy as np\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from slowsave import Slow\n"
        "from moelab.train.ckpt_writer import ProcessWriter\n"
        "w = ProcessWriter(Slow)\n"
        "w.send(1, {'w': np.ones((8, 8), np.float32)}, {'step': 1})\n"
        f"while not pathlib.Path({str(tmp_path / 'started')!r}).exists(): time.sleep(0.05)\n"
        "print(w.block.name, w.proc.pid, flush=True)\n"
        "os._exit(0)  # dies inside the save, as a killed run would\n"
    )
    with open(tmp_path / "out", "w") as out:  # a file, not a pipe: the writer inherits it, and a pipe would wait
        subprocess.run([sys.executable, "-c", code], stdout=out, timeout=300, check=True)
    block, pid = (tmp_path / "out").read_text().split()
    pid = int(pid)
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("gone", "Z", "X"):
            break
        time.sleep(0.1)
    assert state in ("gone", "Z", "X"), f"the writer {pid} outlived its parent (state {state})"
    assert not (Path("/dev/shm") / block).exists()  # the copy of the state: nothing left behind


def test_checkpoint_writer_is_checked_and_never_hashed():
    base = load_config("tiny", MICRO)
    assert config_hash(load_config(base, ["train.checkpoint_writer=process"])) == config_hash(base)
    with pytest.raises(ConfigError, match=r"train.checkpoint_writer: must be thread or process, got 'fast'"):
        load_config("tiny", [*MICRO, "train.checkpoint_writer=fast"])


@pytest.mark.slow  # 19 s: three short runs (CI's make test-all runs it)
def test_a_run_with_the_writer_process_is_the_run_with_the_thread_writer_and_resumes(corpus, tmp_path):
    sets = [*MICRO, f"data.sources=[{corpus['code']}]", "train.steps=4", "train.checkpoint_every=2",
            "train.keep_last=2"]  # fmt: skip
    train(load_config("tiny", sets), tmp_path / "thread", progress=False)
    cfg = load_config("tiny", [*sets, "train.checkpoint_writer=process"])
    train(cfg, tmp_path / "process", progress=False)

    def losses(run):
        return [r["loss"] for r in read_jsonl(tmp_path / run / "metrics.jsonl") if r["kind"] == "train"]

    assert losses("process") == losses("thread")
    assert checkpoint.steps(tmp_path / "process" / "ckpt") == [2, 4]
    a, _ = checkpoint.restore(tmp_path / "thread" / "ckpt", 4, _template(cfg))
    b, _ = checkpoint.restore(tmp_path / "process" / "ckpt", 4, _template(cfg))
    assert _equal(a, b)
    events = [e["event"] for e in read_jsonl(tmp_path / "process" / "events.jsonl")]
    assert events.count("checkpoint") == 2
    # a resume from the process writer's step 2 (the newest removed) ends where the run ended
    checkpoint._rmtree(tmp_path / "process" / "ckpt" / "step_00000004")
    train(None, tmp_path / "process", resume=True, progress=False)
    assert losses("process") == losses("thread")


def _template(cfg):
    """The run's train state as built from its config (shapes, dtypes), for a restore."""
    from moelab.train import optim
    from moelab.train.step import init_train_state

    return init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg)))


def test_the_process_writer_refuses_a_fault_inside_a_save(corpus, tmp_path, monkeypatch):
    from moelab.errors import RunRefused

    monkeypatch.setenv("MOELAB_TEST_FAULTS", "kill_in_save@2")
    cfg = load_config("tiny", [*MICRO, f"data.sources=[{corpus['code']}]", "train.steps=2",
                               "train.checkpoint_writer=process"])  # fmt: skip
    with pytest.raises(RunRefused, match="a fault inside a save needs train.checkpoint_writer: thread"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
