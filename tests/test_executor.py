"""The lab's runner: step identities, reuse, failures, leases, concurrent runners, verdicts, the journal, Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, write_experiment
from moelab.cli import main
from moelab.lab import Prediction, Step, output_of, verdict, versioned
from moelab.lab.commands import load_experiment
from moelab.lab.executor import Runner, read_status
from moelab.lab.journal import Journal


def _noop(cfg, out):
    return {"value": 1.0}


def test_identity_follows_versioned_fields_and_dependencies():
    def graph(x=1, log=5, y=2):
        a = Step("a", _noop, {"x": versioned(x), "log_every": log})
        b = Step("b", _noop, {"input": output_of(a), "y": versioned(y)})
        return a, b

    a, b = graph()
    a2, b2 = graph(x=3)
    assert a2.identity() != a.identity() and b2.identity() != b.identity()  # upstream change moves both
    a3, b3 = graph(log=100)
    assert (a3.identity(), b3.identity()) == (a.identity(), b.identity())  # unversioned: same paths
    a4, b4 = graph(y=7)
    assert a4.identity() == a.identity() and b4.identity() != b.identity()
    assert b.dirname() == f"b-{b.identity()}" and b.deps() == [a]


def runs(counts: Path) -> dict:
    return {p.name: len(p.read_text().splitlines()) for p in counts.iterdir() if not p.name.startswith("hang")}


def test_a_config_field_added_at_its_neutral_value_leaves_a_train_steps_identity_as_recorded():
    """A finished step is found again after moelab adds a config field: the identity below was computed
    by the lab before train.data_seed existed (commit 42971e4); a non-neutral value is a new step."""
    from moelab.config import load_config
    from moelab.lab.steps import train_step

    assert train_step("pin", load_config("tiny", ["train.steps=7"])).dirname() == "pin-c2e74a2b4bab"
    moved = train_step("pin", load_config("tiny", ["train.steps=7", "train.data_seed=3"]))
    assert moved.dirname() != "pin-c2e74a2b4bab"


def test_second_run_runs_nothing(lab):
    exp = load_experiment(lab["exp"])
    first = Runner(exp, lab["prefix"], log=lambda *_: None).run()
    assert first["steps"] == {"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"}
    assert first["verdict"]["verdict"] == "CONFIRMED"  # c: 2 + len("b") = 3
    Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    assert runs(lab["counts"]) == {"a": 1, "b": 1, "c": 1}
    events = Journal(lab["prefix"] / "experiments" / "exp9_chain" / "journal.jsonl").read()
    assert [e["event"] for e in events].count("verdict") == 1  # the same outcome is judged once
    for s in exp.all_steps():
        prov = json.loads((lab["prefix"] / s.dirname() / "provenance.json").read_text())
        assert {"config", "git", "versions", "host", "start", "end"} <= set(prov)
    # a versioned change upstream reruns everything downstream of it
    write_experiment(lab["exp"], value=2)
    Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    assert runs(lab["counts"]) == {"a": 2, "b": 2, "c": 2}


def test_failed_step_blocks_dependents_and_rerun_resumes(lab, monkeypatch):
    monkeypatch.setenv("LAB_FAIL", "b")
    exp = load_experiment(lab["exp"])
    res = Runner(exp, lab["prefix"], log=lambda *_: None).run()
    assert res["steps"] == {"a": "SUCCESS", "b": "FAILED", "c": "BLOCKED"} and res["verdict"] is None
    journal = Journal(lab["prefix"] / "experiments" / "exp9_chain" / "journal.jsonl")
    (failed,) = [e for e in journal.read() if e["event"] == "step_failed"]
    assert "RuntimeError: boom in b" in failed["traceback"] and failed["step"] == "b"
    assert "c" not in runs(lab["counts"])
    monkeypatch.delenv("LAB_FAIL")
    res = Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    assert res["steps"] == {"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"}
    assert runs(lab["counts"]) == {"a": 1, "b": 2, "c": 1}
    assert any(e["event"] == "step_resumed" and e["step"] == "b" for e in journal.read())


def _run_cli(exp: Path, prefix: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moelab", "run", str(exp), "--prefix", str(prefix)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_killed_runner_leaves_a_stale_lease_that_the_next_takes_over(lab):
    exp = load_experiment(lab["exp"])
    proc = _run_cli(lab["exp"], lab["prefix"], {"LAB_HANG": "b"})
    deadline = time.time() + 60
    while not (lab["counts"] / "hang-b").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    b = exp.all_steps()[1]
    lease = lab["prefix"] / f"{b.dirname()}.lease"
    assert lease.exists() and read_status(lab["prefix"], b) == "RUNNING"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lease.exists() and read_status(lab["prefix"], b) == "RUNNING"  # never SUCCESS while incomplete
    assert not (lab["prefix"] / b.dirname() / "outcome.json").exists()
    res = Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    assert res["steps"]["b"] == "SUCCESS" and not lease.exists()
    events = Journal(lab["prefix"] / "experiments" / "exp9_chain" / "journal.jsonl").read()
    assert any(e["event"] == "lease_taken_over" and e["step"] == "b" for e in events)
    assert any(e["event"] == "step_resumed" and e["step"] == "b" for e in events)


def test_two_runners_run_each_step_once(lab):
    procs = [_run_cli(lab["exp"], lab["prefix"], {"LAB_SLEEP": "1"}) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    assert runs(lab["counts"]) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize(
    "outcome,expected",
    [
        (2.05, "CONFIRMED"),
        (1.9, "CONFIRMED"),
        (2.5, "FALSIFIED"),
        (1.7, "FALSIFIED"),
        (2.15, "INCONCLUSIVE"),
        (None, "INCONCLUSIVE"),
        (float("nan"), "INCONCLUSIVE"),
    ],
)
def test_verdicts_on_hand_made_outcomes(outcome, expected):
    pred = Prediction(metric="s:x", value=2.0, low=1.9, high=2.1, falsify_low=1.8, falsify_high=2.2)
    v = verdict(pred, outcome)
    assert v["verdict"] == expected and v["predicted"] == 2.0


def test_changed_declaration_is_a_new_version_and_the_old_stays(lab):
    Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    write_experiment(lab["exp"], hypothesis="a sharper hypothesis")
    Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    events = Journal(lab["prefix"] / "experiments" / "exp9_chain" / "journal.jsonl").read()
    declared = [e for e in events if e["event"] == "declared"]
    assert [d["version"] for d in declared] == [1, 2]
    assert [d["hypothesis"] for d in declared] == ["h", "a sharper hypothesis"]
    assert len([e for e in events if e["event"] == "prediction_registered"]) == 1
    assert runs(lab["counts"]) == {"a": 1, "b": 1, "c": 1}  # prose changes rerun nothing


def test_dry_run_runs_nothing(lab, capsys):
    assert main(["run", str(lab["exp"]), "--prefix", str(lab["prefix"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "PENDING" in out and "a-" in out and "c-" in out
    assert runs(lab["counts"]) == {}
    assert not list(lab["prefix"].glob("*.status")) and not list(lab["prefix"].glob("*-*/outcome.json"))
    assert main(["run", str(tmp := lab["exp"].with_name("missing.py"))]) == 2
    assert str(tmp) in capsys.readouterr().err


RAY_EXPERIMENT = """
import os
from moelab.lab import Experiment, Prediction, Step, versioned

def where(cfg, out):
    (out / "pid").write_text(str(os.getpid()))
    return {"pid": os.getpid(), "value": cfg["value"]}

left = Step("left", where, {"value": versioned(1.0)}, resources={"num_cpus": 1})
right = Step("right", where, {"value": versioned(2.0)}, resources={"num_cpus": 1})
experiment = Experiment(issue=8, slug="ray", title="two rungs", goal="g", hypothesis="h",
    prediction=Prediction(metric="right:value", value=2.0, low=1.5, high=2.5), steps=[left, right])
"""


@pytest.mark.slow
def test_ray_backend_runs_independent_steps_as_tasks(tmp_path):
    pytest.importorskip("ray", reason="pip install 'moelab[ray]' (make test-all does)")
    exp = tmp_path / "exp8_ray.py"
    exp.write_text(RAY_EXPERIMENT)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "moelab",
            "run",
            str(exp),
            "--prefix",
            str(tmp_path / "p"),
            "--backend",
            "ray",
            "--max-concurrent",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "CONFIRMED" in res.stdout
    for out in (tmp_path / "p").glob("*/outcome.json"):
        runner_pid = json.loads((out.parent / "provenance.json").read_text())["host"]["pid"]
        assert json.loads(out.read_text())["pid"] != runner_pid  # the work ran in a Ray worker
    events = Journal(tmp_path / "p" / "experiments" / "exp8_ray" / "journal.jsonl").read()
    assert sorted(e["step"] for e in events if e["event"] == "step_finished") == ["left", "right"]


def test_force_reruns_the_step_and_what_depends_on_it(lab):
    Runner(load_experiment(lab["exp"]), lab["prefix"], log=lambda *_: None).run()
    exp = load_experiment(lab["exp"])
    res = Runner(exp, lab["prefix"], force="^b$", log=lambda *_: None).run()
    assert res["steps"] == {"a": "SUCCESS", "b": "SUCCESS", "c": "SUCCESS"}
    assert runs(lab["counts"]) == {"a": 1, "b": 2, "c": 2}
    b = exp.all_steps()[1]
    assert list(lab["prefix"].glob(f"{b.dirname()}.replaced-*"))  # the old output is kept


def test_a_lease_left_empty_by_a_crash_is_taken_over(lab):
    exp = load_experiment(lab["exp"])
    a = exp.all_steps()[0]
    lab["prefix"].mkdir(parents=True)
    lease = lab["prefix"] / f"{a.dirname()}.lease"
    lease.write_text("")
    os.utime(lease, (time.time() - 60, time.time() - 60))
    res = Runner(exp, lab["prefix"], log=lambda *_: None).run()
    assert res["steps"]["a"] == "SUCCESS" and not lease.exists()


def test_a_live_lease_is_not_taken_and_a_lost_lease_is_not_released(tmp_path, monkeypatch):
    from moelab.lab.executor import Lease

    monkeypatch.setenv("MOELAB_LEASE_TIMEOUT", "30")
    path = tmp_path / "x.lease"
    first = Lease(path, "first")
    assert first.try_acquire()
    assert not Lease(path, "second").try_acquire()  # live: the second waits
    path.write_text(json.dumps({"owner": "third", "heartbeat": time.time()}))  # taken over elsewhere
    first.release()
    assert json.loads(path.read_text())["owner"] == "third"  # release leaves the new owner's lease alone


def test_a_config_file_is_part_of_its_train_steps_identity(tmp_path):
    """A step names its config file by path; editing the file (or its base) makes it a new step."""
    from moelab.lab.steps import train_step

    base = tmp_path / "base.yaml"
    base.write_text("base: tiny\nmodel: {top_k: 2}\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"base: {base}\ntrain: {{steps: 20}}\n")
    first = train_step("t", str(cfg)).identity()
    assert train_step("t", str(cfg)).identity() == first  # the same contents: the same step
    cfg.write_text(f"base: {base}\ntrain: {{steps: 30}}\n")
    edited = train_step("t", str(cfg)).identity()
    base.write_text("base: tiny\nmodel: {top_k: 4}\n")
    rebased = train_step("t", str(cfg)).identity()
    assert len({first, edited, rebased}) == 3
    # a preset is named by its name, as before (finished steps of existing labs are kept)
    assert "config_hash" not in train_step("t", "tiny").config
