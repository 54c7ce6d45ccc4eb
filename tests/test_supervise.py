"""`moelab train --max-restarts N`: the supervisor restarts the process itself, with its own arguments
(in a multi-process job its own --coordinator and --process-id), and joins no job of its own."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import MICRO, ROOT
from moelab.cli import build_parser
from moelab.cli.train import _child_args
from moelab.runs import read_jsonl
from moelab.train import supervise as sv

JOB = ["--coordinator", "127.0.0.1:4567", "--num-processes", "2", "--process-id", "1"]


@pytest.mark.parametrize("form", [["--max-restarts", "2"], ["--max-restarts=2"]], ids=["apart", "joined"])
def test_the_child_is_the_process_own_command_without_max_restarts(form):
    argv = ["train", "tiny", "--out", "o", "--set", "train.steps=3", "--set", "train.lr=-1", *form,
            "--data", "a", "--data", "web=b", *JOB, "--devices", "4", "--inject", "lr_spike@2", "--quiet"]  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(argv)
    child = _child_args(args)
    assert not any(a.startswith("--max-restarts") for a in child)
    assert child[0] == "tiny" and child.count("--quiet") == 1 and "--resume" not in child
    for flag in ("--coordinator=127.0.0.1:4567", "--num-processes=2", "--process-id=1", "--set=train.lr=-1"):
        assert flag in child, child
    again = parser.parse_args(["train", *child])  # the same command: every option as given, in its order
    assert vars(again) == {**vars(args), "max_restarts": 0}
    resumed = _child_args(parser.parse_args([*argv, "--resume"]))  # a --resume given is kept, once
    assert resumed.count("--resume") == 1
    assert vars(parser.parse_args(["train", *resumed])) == {**vars(args), "resume": True, "max_restarts": 0}


def test_a_resume_without_a_config_stays_without_one():
    args = build_parser().parse_args(["train", "--resume", "--out", "o", "--max-restarts", "1", *JOB])
    assert _child_args(args) == ["--out=o", "--resume", "--coordinator=127.0.0.1:4567", "--num-processes=2",
                                 "--process-id=1"]  # fmt: skip


def test_the_supervisor_joins_no_job_and_loads_no_jax(tmp_path):
    """Up to the hand-off the supervisor imports no JAX (it could not share the devices with its child)
    and joins nothing; process 1's restarts are recorded in its own records, out/.process-1."""
    out = tmp_path / "run"
    code = f"""if True:
        import sys
        import moelab.cli.train as t
        t.supervise = lambda child, out, n, records: print(repr((child, str(records), n, "jax" in sys.modules))) or 0
        from moelab.cli import main
        sys.exit(main(["train", "tiny", "--out", {str(out)!r}, "--max-restarts", "2", "--devices", "4", *{JOB!r}]))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    child, records, n, jax_loaded = ast.literal_eval(res.stdout.strip().splitlines()[-1])
    assert not jax_loaded and n == 2 and records == str(out / ".process-1")
    assert child == ["tiny", f"--out={out}", "--coordinator=127.0.0.1:4567", "--num-processes=2", "--process-id=1",
                     "--devices=4"]  # fmt: skip


class _Child:
    """A stand-in for the training process: it ends with the next of ``codes``."""

    def __init__(self, argv, codes, seen):
        seen.append(argv)
        self.code, self.stderr = codes.pop(0), iter(["moelab: something\n"])

    def wait(self):
        return self.code


@pytest.mark.parametrize("given", [[], ["--resume"]], ids=["started", "resumed"])
def test_each_restart_resumes_the_same_command(tmp_path, monkeypatch, given):
    seen, codes = [], [-9, 1, 0]
    monkeypatch.setattr(sv.subprocess, "Popen", lambda argv, **kw: _Child(argv, codes, seen))
    own = ["tiny", "--out=o", *given, "--process-id=1"]
    assert sv.supervise(own, str(tmp_path), 2, records=tmp_path / ".process-1") == 0
    head = [sys.executable, "-m", "moelab", "train"]
    # from the newest checkpoint, or from step 0 when the child died before its first (--restart)
    assert seen == [head + own] + [head + own + ([] if given else ["--resume"]) + ["--restart"]] * 2
    restarts = read_jsonl(tmp_path / ".process-1" / "events.jsonl")
    assert [(e["restart"], e["of"], e["exit_code"]) for e in restarts] == [(1, 2, -9), (2, 2, 1)]
    assert "SIGKILL" in restarts[0]["cause"] and restarts[1]["cause"] == "exit code 1: moelab: something"
    assert not (tmp_path / "events.jsonl").exists()


def test_restarts_used_up_and_refusals(tmp_path, monkeypatch):
    for codes, want, events in (([-9, -9], 1, ["restart", "gave_up"]), ([2], 2, []), ([3], 3, []), ([130], 130, [])):
        (tmp_path / "events.jsonl").unlink(missing_ok=True)
        seen = []
        monkeypatch.setattr(sv.subprocess, "Popen", lambda argv, c=codes, s=seen, **kw: _Child(argv, c, s))
        assert sv.supervise(["tiny", "--out=o"], str(tmp_path), 1) == want
        assert [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")] == events


def _losses(out):
    return np.array([r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"])


@pytest.mark.slow  # about 2 minutes on 2 cores: a two-process job started twice, and its reference
def test_a_supervised_job_restarts_its_killed_process_as_itself(corpus, tmp_path):
    """Two supervised processes of one job (a coordinator on this machine, four devices each); process 1
    kills itself before step 3 (MOELAB_TEST_FAULTS; the checkpoint is step 2's). Its supervisor restarts
    it with its own --process-id and --resume. Process 0, left alone in the job, fails at its next
    collective and its supervisor restarts it too: the two meet at the coordinator again and resume from
    step 2. Both supervisors end with 0, and the losses equal one uninterrupted process of eight devices."""
    from moelab.config import load_config
    from moelab.train.loop import train

    sets = [*MICRO, "train.batch_size=8", "model.capacity_factor=4.0", "train.checkpoint_every=2",
            "train.eval_every=100", "mesh.expert=8"]  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "moelab", "train", "tiny", "--out", str(out), "--steps", "4", "--quiet",
           "--data", corpus["code"], "--data", corpus["prose"], "--devices", "4", "--max-restarts", "2",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]  # fmt: skip
    for o in sets:
        cmd += ["--set", o]
    # (a multi-process CPU job does not use the persistent compile cache: train.loop says why)
    env = dict(os.environ)
    started = time.time()
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True,  # the supervisor and its child: one group, ended together
                         env={**env, **({"MOELAB_TEST_FAULTS": "kill@3"} if i else {})})
        for i, log in enumerate(logs)
    ]  # fmt: skip
    try:
        codes = [p.wait(timeout=max(1.0, started + 400 - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    print(f"the job took {time.time() - started:.1f} s")
    tails = "".join(f"--- process {i}\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
    assert codes == [0, 0], tails
    ours = read_jsonl(out / ".process-1" / "events.jsonl")
    restarts = [e for e in ours if e["event"] == "restart"]
    assert len(restarts) == 1 and "SIGKILL" in restarts[0]["cause"], tails
    launches = [e for e in ours if e["event"] == "launch"]
    assert [e["batch_rows"] for e in launches] == [[4, 8], [4, 8]]  # process 1, both times
    assert [e["step"] for e in ours if e["event"] == "resume"] == [2] and ours[-1]["event"] == "end"
    theirs = read_jsonl(out / "events.jsonl")
    assert [e["batch_rows"] for e in theirs if e["event"] == "launch"] == [[0, 4], [0, 4]]  # process 0
    assert [e["restart"] for e in theirs if e["event"] == "restart"] == [1]  # taken down with it
    assert [e["step"] for e in theirs if e["event"] == "resume"] == [2] and theirs[-1]["event"] == "end"
    train(load_config("tiny", [*sets, "train.steps=4", f"data.sources=[{corpus['code']}, {corpus['prose']}]"]),
          tmp_path / "one", progress=False)  # fmt: skip
    assert len(_losses(out)) == 4
    np.testing.assert_allclose(_losses(out), _losses(tmp_path / "one"), rtol=0, atol=1e-5)
