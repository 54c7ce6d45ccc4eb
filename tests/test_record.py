"""Records that cannot lie: the prediction that counts is the one on record before the first step;
a later one is recorded and shown as post hoc, everywhere a verdict is shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.lab.commands import issue_markdown, load_experiment
from moelab.lab.executor import Runner
from moelab.lab.journal import Journal, record
from moelab.report.site import build_site

EXPERIMENT = """
from moelab.lab import Experiment, Prediction, Step

def measure(cfg, out):
    return {"value": 7.0}

step = Step("measure", measure, {})
experiment = Experiment(issue=21, slug="late", title="a late prediction", goal="g", hypothesis=HYPOTHESIS,
    prediction=Prediction(metric="measure:value", value=VALUE, low=LOW, high=HIGH), steps=[step])
"""


def write(path: Path, value: float, low: float, high: float, hypothesis: str = "h") -> Path:
    text = EXPERIMENT.replace("HYPOTHESIS", repr(hypothesis)).replace("VALUE", repr(value))
    path.write_text(text.replace("LOW", repr(low)).replace("HIGH", repr(high)))
    return path


@pytest.fixture
def rewritten(tmp_path):
    """The issue's case: 7.0 against [2.9, 3.1] is FALSIFIED; then the prediction is declared again
    as [6.9, 7.1] (and the hypothesis reworded) and the experiment rerun."""
    exp_path, prefix = tmp_path / "exp21_late.py", tmp_path / "lab"
    first = Runner(load_experiment(write(exp_path, 3.0, 2.9, 3.1)), prefix, log=lambda *_: None).run()
    second = Runner(load_experiment(write(exp_path, 7.0, 6.9, 7.1, "the same, said after")), prefix, log=lambda *_: None)
    return first, second.run(), second, prefix


def test_a_prediction_rewritten_after_the_outcome_is_post_hoc(rewritten):
    first, second, runner, _ = rewritten
    assert first["verdict"]["verdict"] == "FALSIFIED" and first["post_hoc_verdict"] is None
    assert second["verdict"]["verdict"] == "FALSIFIED"  # still judged against what was registered first
    assert second["verdict"]["pre_registered"] and second["verdict"]["prediction_version"] == 1
    late = second["post_hoc_verdict"]
    assert late["verdict"] == "POST-HOC CONFIRMED" and not late["pre_registered"] and late["prediction_version"] == 2
    events = runner.journal.read()
    rec = record(events)
    assert rec["prediction"]["version"] == 1 and [p["version"] for p in rec["post_hoc_predictions"]] == [2]
    assert rec["declaration"]["hypothesis"] == "h" and rec["post_hoc_declarations"][0]["hypothesis"] == "the same, said after"
    assert rec["prediction"]["time"] < rec["first_step"] < rec["post_hoc_predictions"][0]["time"]
    verdicts = [e["verdict"] for e in events if e["event"] == "verdict"]
    assert verdicts == ["FALSIFIED", "POST-HOC CONFIRMED"]  # the rerun did not judge the first one again
    assert "CONFIRMED" not in [e["verdict"] for e in events if e["event"] == "verdict" and e.get("pre_registered")]


def test_every_view_shows_the_registered_verdict_and_marks_the_late_one(rewritten, tmp_path, capsys):
    _, _, runner, prefix = rewritten
    index = build_site(prefix, tmp_path / "site")
    html = index.read_text()
    row = html[html.index("a late prediction") :]
    assert "FALSIFIED" in row and "POST-HOC CONFIRMED" in row
    assert ">CONFIRMED<" not in html  # never a plain CONFIRMED
    page = (tmp_path / "site" / "exp21_late.html").read_text()
    assert "Registered before the run (version 1" in page and "the first step started" in page
    assert "POST HOC: prediction version 2" in page and "POST-HOC CONFIRMED" in page
    assert ">CONFIRMED<" not in page and "<p>h</p>" in page  # the hypothesis that counts
    text = issue_markdown(runner.exp, prefix)
    assert "**FALSIFIED**" in text and "**POST-HOC CONFIRMED**" in text and "**CONFIRMED**" not in text
    assert "POST HOC (registered" in text and "version 1" in text
    assert main(["status", "--prefix", str(prefix)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("exp21_late"))
    assert "verdict: FALSIFIED; POST-HOC CONFIRMED" in line


def test_a_prediction_changed_before_any_step_ran_is_still_registered(tmp_path):
    exp_path, prefix = tmp_path / "exp21_late.py", tmp_path / "lab"
    exp = load_experiment(write(exp_path, 3.0, 2.9, 3.1))
    Runner(exp, prefix, log=lambda *_: None, only="nothing-matches").run()  # declares; runs no step
    res = Runner(load_experiment(write(exp_path, 7.0, 6.9, 7.1)), prefix, log=lambda *_: None).run()
    assert res["verdict"]["verdict"] == "CONFIRMED" and res["verdict"]["prediction_version"] == 2
    assert res["post_hoc_verdict"] is None
    events = Journal(prefix / "experiments" / "exp21_late" / "journal.jsonl").read()
    assert [e["version"] for e in events if e["event"] == "prediction_registered"] == [1, 2]
    assert json.dumps(record(events)["post_hoc_predictions"]) == "[]"
