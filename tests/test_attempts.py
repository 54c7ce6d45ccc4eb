"""Records that cannot lie, part 3 (issue 38): a verdict cannot be re-rolled, a genuine forecast is not
called post hoc, and a runner that lost its lease is silent.

Every run of an experiment is an attempt at its registered prediction; the first attempt's verdict is
the one every view shows, and a later one that differs is written beside it ("CONFIRMED on attempt 2
after FALSIFIED on attempt 1"), never as a bare CONFIRMED. An outcome is known once the step the metric
reads (or what it reads, not through a forecast) has started."""

from __future__ import annotations

import html
import json
import re
import threading
import time
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.lab.commands import issue_markdown, load_experiment
from moelab.lab.executor import Lease, Runner
from moelab.lab.journal import Journal, Running, record
from moelab.report.site import build_site

QUIET = {"log": lambda *_: None}

REROLL = """
import json, os
from pathlib import Path
from moelab.lab import Experiment, Prediction, Step, versioned

def measure(cfg, out):
    draws = Path(os.environ["LAB_DRAWS"])  # each call takes the next value: a step with randomness in it
    values = json.loads(draws.read_text())
    draws.write_text(json.dumps(values[1:]))
    return {"value": values[0]}

step = Step("measure", measure, {"seed": versioned(SEED)})
experiment = Experiment(issue=38, slug="reroll", title="a redrawn outcome", goal="g", hypothesis="h",
    prediction=Prediction(metric="measure:value", value=3.0, low=2.9, high=3.1), steps=[step])
"""


def bare_confirmed(text: str) -> list[str]:
    """Every CONFIRMED a reader sees that is neither post hoc nor placed on a later attempt."""
    text = re.sub(r"<style.*?</style>", " ", text, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return [m.group(0) for m in re.finditer(r"(?<!POST-HOC )CONFIRMED(?! on (a rerun of )?attempt \d)", text)]


@pytest.fixture
def draws(tmp_path, monkeypatch):
    path = tmp_path / "draws.json"
    path.write_text(json.dumps([7.0, 3.0, 3.0]))  # the first draw misses, the second would confirm
    monkeypatch.setenv("LAB_DRAWS", str(path))
    return path


def _views(prefix: Path, exp, tmp_path: Path, capsys) -> dict[str, str]:
    capsys.readouterr()
    assert main(["status", "--prefix", str(prefix)]) == 0
    status = capsys.readouterr().out
    site = tmp_path / "site"
    build_site(prefix, site)
    return {"status": status, "index": (site / "index.html").read_text(),
            "page": (site / f"{exp.name}.html").read_text(), "issue": issue_markdown(exp, prefix)}  # fmt: skip


def _check_rerolled(prefix: Path, exp, tmp_path: Path, capsys, why: str) -> None:
    events = Journal(prefix / "experiments" / exp.name / "journal.jsonl").read()
    attempts = [e for e in events if e["event"] == "attempt"]
    assert [a["number"] for a in attempts] == [1, 2] and why in attempts[1]["why"]
    rec = record(events)
    assert rec["verdict"]["verdict"] == "FALSIFIED" and rec["verdict"]["attempt"] == 1  # the headline stays
    assert [a["verdict"]["verdict"] for a in rec["attempts"]] == ["FALSIFIED", "CONFIRMED"]
    views = _views(prefix, exp, tmp_path, capsys)
    said = "CONFIRMED on attempt 2 after FALSIFIED on attempt 1"
    line = next(x for x in views["status"].splitlines() if x.startswith(exp.name))
    assert f"verdict: FALSIFIED; {said}" in line
    assert "attempt 2 (" in views["status"] and said in views["status"]  # each attempt, listed
    for name, text in views.items():
        assert said in text, name
        assert bare_confirmed(text) == [], (name, bare_confirmed(text))


def test_a_reroll_by_a_versioned_field_is_a_second_attempt_and_the_first_verdict_stays(tmp_path, draws, capsys):
    exp_path, prefix = tmp_path / "exp38_reroll.py", tmp_path / "lab"
    exp_path.write_text(REROLL.replace("SEED", "0"))
    first = Runner(load_experiment(exp_path), prefix, **QUIET).run()
    assert first["verdict"]["verdict"] == "FALSIFIED" and first["attempt"] == 1
    again = Runner(load_experiment(exp_path), prefix, **QUIET).run()  # nothing changed: the same attempt
    assert again["attempt"] == 1 and again["headline"] == "FALSIFIED"
    exp_path.write_text(REROLL.replace("SEED", "1"))  # another seed: a new step, drawn again
    exp = load_experiment(exp_path)
    second = Runner(exp, prefix, **QUIET).run()
    assert second["attempt"] == 2 and second["this_attempt"]["verdict"] == "CONFIRMED"
    assert second["verdict"]["verdict"] == "FALSIFIED"
    assert second["headline"] == "FALSIFIED; CONFIRMED on attempt 2 after FALSIFIED on attempt 1"
    _check_rerolled(prefix, exp, tmp_path, capsys, "steps changed: measure")
    # the declaration's identity holds the graph: a new version, which is an attempt, not a post-hoc text
    events = Journal(prefix / "experiments" / exp.name / "journal.jsonl").read()
    declared = [e for e in events if e["event"] == "declared"]
    assert len(declared) == 2 and declared[0]["graph"] != declared[1]["graph"]
    assert record(events)["post_hoc_declarations"] == []
    # status and the site list the current graph's steps
    (step,) = exp.all_steps()
    views = _views(prefix, exp, tmp_path, capsys)
    assert step.dirname() in views["status"] and step.dirname() in views["page"]


def test_a_reroll_by_force_is_a_second_attempt_and_the_first_verdict_stays(tmp_path, draws, capsys):
    exp_path, prefix = tmp_path / "exp38_reroll.py", tmp_path / "lab"
    exp_path.write_text(REROLL.replace("SEED", "0"))
    exp = load_experiment(exp_path)
    assert main(["run", str(exp_path), "--prefix", str(prefix)]) == 0
    assert "verdict: FALSIFIED" in capsys.readouterr().out
    assert main(["run", str(exp_path), "--prefix", str(prefix), "--force", "measure"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FALSIFIED; CONFIRMED on attempt 2 after FALSIFIED on attempt 1" in out
    assert bare_confirmed(out) == [], out
    _check_rerolled(prefix, exp, tmp_path, capsys, "forced: measure")


LADDER = """
import os, time
from pathlib import Path
from moelab.lab import Experiment, Prediction, Step, output_of, versioned

def rung(cfg, out):
    return {"loss": 5.0 - cfg["width"] / 100}

def fit(cfg, out):
    return {"final": 4.0}

def target(cfg, out):
    gate = os.environ.get("LAB_GATE")
    if gate:  # the test holds the target running until it says so
        Path(gate + ".started").write_text("")
        while not Path(gate).exists():
            time.sleep(0.05)
    return {"loss": 4.02}

def judge(cfg, out):
    return {"error": 0.5}

rungs = [Step(f"rung{w}", rung, {"width": versioned(w)}) for w in (16, 24)]
forecast = Step("forecast", fit, {"rungs": versioned([output_of(r) for r in rungs]), "width": versioned(TARGET)},
                forecast=True)
run = Step("target", target, {"forecast": versioned(output_of(forecast)), "width": versioned(TARGET)})
health = Step("health", judge, {"run": versioned(output_of(run))})
experiment = Experiment(issue=38, slug=SLUG, title="forecast from finished rungs", goal="g", hypothesis="h",
    prediction=Prediction(metric="health:error", value=0.0, low=-1.0, high=1.0), steps=[health])
"""

RUNGS = """
from moelab.lab import Experiment, Prediction, Step, versioned

def rung(cfg, out):
    return {"loss": 5.0 - cfg["width"] / 100}

rungs = [Step(f"rung{w}", rung, {"width": versioned(w)}) for w in (16, 24)]
experiment = Experiment(issue=38, slug="rungs", title="the rungs", goal="g", hypothesis="h",
    prediction=Prediction(metric="rung24:loss", value=4.76, low=4.7, high=4.8), steps=rungs)
"""


def ladder(path: Path, slug: str, target: int = 104) -> Path:
    path.write_text(LADDER.replace("SLUG", repr(slug)).replace("TARGET", str(target)))
    return path


def test_a_new_target_forecast_from_finished_rungs_is_pre_registered_and_its_copy_is_post_hoc(tmp_path):
    prefix = tmp_path / "lab"
    (tmp_path / "exp38_rungs.py").write_text(RUNGS)
    rungs = Runner(load_experiment(tmp_path / "exp38_rungs.py"), prefix, **QUIET).run()
    assert rungs["verdict"]["verdict"] == "CONFIRMED"
    time.sleep(0.01)
    # a new experiment reuses the finished rungs to forecast a target that has never trained
    new = Runner(load_experiment(ladder(tmp_path / "exp38_new.py", "new")), prefix, **QUIET).run()
    assert new["verdict"]["verdict"] == "CONFIRMED" and new["verdict"]["pre_registered"], new["verdict"]
    journal = Journal(prefix / "experiments" / "exp38_new" / "journal.jsonl").read()
    assert sorted(e["step"] for e in journal if e["event"] == "step_reused") == ["rung16", "rung24"]
    # the same experiment copied after its target finished: the outcome was known
    copy = Runner(load_experiment(ladder(tmp_path / "exp38_copy.py", "copy")), prefix, **QUIET).run()
    v = copy["verdict"]
    assert v["verdict"] == "POST-HOC CONFIRMED" and not v["pre_registered"], v
    assert set(v["known_before"]) == {"health", "target"}  # the rungs and the forecast are not what made it known
    assert "exp38_new" in v["why"]


def test_a_step_already_running_when_the_prediction_is_registered_makes_the_verdict_post_hoc(tmp_path, monkeypatch):
    prefix, gate = tmp_path / "lab", tmp_path / "gate"
    monkeypatch.setenv("LAB_GATE", str(gate))
    first = load_experiment(ladder(tmp_path / "exp38_first.py", "first"))
    results = {}
    worker = threading.Thread(target=lambda: results.update(first=Runner(first, prefix, **QUIET).run()))
    worker.start()
    deadline = time.time() + 60
    while not Path(str(gate) + ".started").exists():  # the first experiment's target is running
        assert time.time() < deadline and worker.is_alive()
        time.sleep(0.05)
    # a copy registers its prediction now, while the target runs; the target finishes only after that
    second = load_experiment(ladder(tmp_path / "exp38_second.py", "second"))
    waiter = threading.Thread(target=lambda: results.update(second=Runner(second, prefix, **QUIET).run()))
    waiter.start()
    journal = prefix / "experiments" / "exp38_second" / "journal.jsonl"
    while not journal.exists() or "prediction_registered" not in journal.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.05)
    gate.write_text("")  # now the target may finish: after the second prediction was on record
    worker.join(60)
    waiter.join(60)
    assert results["first"]["verdict"]["verdict"] == "CONFIRMED"
    registered = next(e for e in Journal(journal).read() if e["event"] == "prediction_registered")
    target = next(s for s in second.all_steps() if s.name == "target")
    provenance = json.loads((prefix / target.dirname() / "provenance.json").read_text())
    assert provenance["first_start"] < registered["time"] < provenance["end"]  # started before, finished after
    v = results["second"]["verdict"]
    assert v["verdict"] == "POST-HOC CONFIRMED" and "target" in v["known_before"], v


# ------------------------------------------------------------------ a lost lease writes nothing (item 3)


def _taken_over(tmp_path: Path, monkeypatch) -> Lease:
    """A lease that runner A held and runner B took over while A stalled."""
    monkeypatch.setenv("MOELAB_LEASE_TIMEOUT", "60")
    path = tmp_path / "step.lease"
    lease = Lease(path, "A")
    assert lease.try_acquire()
    path.write_text(json.dumps({"owner": "B", "heartbeat": time.time()}))  # B's now
    return lease


def test_a_running_step_that_lost_its_lease_writes_no_journal_line(tmp_path, monkeypatch):
    from moelab.lab.steps import forecast_update_writer

    journal = Journal(tmp_path / "journal.jsonl")
    held = Lease(tmp_path / "held.lease", "A")
    assert held.try_acquire()
    update = {"at_step": 10, "law": "prior-alpha", "final": {"loss": 3.0, "low": 2.9, "high": 3.1}}
    # while it holds the lease, a step writes its forecast updates and other lines
    forecast_update_writer(Running(journal, "t", "t-1", held))(update)
    assert Running(journal, "t", "t-1", held).write("note", x=1) is not None
    assert [e["event"] for e in journal.read()] == ["forecast_updated", "note"]
    held.release()
    lost = _taken_over(tmp_path, monkeypatch)
    before = journal.path.read_bytes()
    forecast_update_writer(Running(journal, "t", "t-1", lost))(update)
    assert Running(journal, "t", "t-1", lost).write("note", x=2) is None
    assert journal.path.read_bytes() == before and lost.lost
    lost.release()


def test_a_step_that_fails_after_its_lease_was_lost_writes_no_journal_line_or_status(tmp_path, monkeypatch):
    """The runner's own writers: a step that raises after another runner took it over leaves the
    journal and the status file as the new owner has them."""
    from moelab.lab.graph import Experiment, Prediction, Step

    prefix = tmp_path / "lab"
    monkeypatch.setenv("MOELAB_LEASE_TIMEOUT", "60")

    def stolen(cfg, out):  # B takes the step over while A runs it, then A's step fails
        lease = prefix / f"{step.dirname()}.lease"
        lease.write_text(json.dumps({"owner": "B", "heartbeat": time.time() + 60}))
        (prefix / f"{step.dirname()}.status").write_text(json.dumps({"status": "RUNNING", "owner": "B"}))
        raise RuntimeError("late failure")

    step = Step("s", stolen, {})
    exp = Experiment(issue=38, slug="stolen", title="t", goal="g", hypothesis="h",
                     prediction=Prediction(metric="s:x", value=1, low=0, high=2), steps=[step])  # fmt: skip
    runner = Runner(exp, prefix, **QUIET)
    result = runner.run()
    assert result["steps"] == {"s": "LOST"} and result["lost"] == ["s"] and result["verdict"] is None
    events = runner.journal.read()
    assert [e["event"] for e in events] == ["declared", "prediction_registered", "attempt", "step_started"]
    assert json.loads((prefix / f"{step.dirname()}.status").read_text())["owner"] == "B"
    (attempt,) = (prefix / f"{step.dirname()}.attempts").iterdir()
    assert "late failure" in json.loads((attempt / "lease_lost.json").read_text())["how"]
