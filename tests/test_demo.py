"""`moelab demo` (what `make demo` runs) end to end, on a shorter experiment."""

from __future__ import annotations

import re

from conftest import MICRO, run_cli

SHORT = """
from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import eval_step, train_step

train = train_step("short", "tiny", OVERRIDES, progress=False)
evaluate = eval_step("short-eval", output_of(train))
experiment = Experiment(issue=4, slug="short", title="A short run", goal="Exercise the demo.",
    hypothesis="Twenty-four steps at a rate of 0.01 take the held-out loss below a uniform guess over the 512 tokens, ln 512 = 6.238.",
    prediction=Prediction(metric="short-eval:loss_dropless.macro", value=5.5, low=4.0, high=6.238,
                          falsify_low=3.0, falsify_high=6.5), steps=[evaluate])
"""


def test_demo_prints_accounting_runs_the_experiment_and_writes_the_site(corpus, tmp_path):
    exp = tmp_path / "exp4_short.py"
    overrides = [*MICRO, f"data.sources=[{corpus['code']}, {corpus['prose']}]", "train.steps=24", "train.lr=1e-2"]
    exp.write_text(SHORT.replace("OVERRIDES", repr(overrides)))
    res = run_cli("demo", "--experiment", str(exp), "--prefix", str(tmp_path / "lab"), "--site", str(tmp_path / "site"))
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout
    assert "535.3B [535.3B]" in text and "22.76B [22.76B]" in text
    worst = float(re.search(r"largest relative difference from Marin's figures: ([0-9.]+)%", text).group(1))
    assert worst < 0.5
    for domain in ("code", "prose", "macro"):
        assert re.search(rf"^  {domain}\s+[0-9.]+\s+[0-9.]+", text, re.M), domain
    assert "tokens/s" in text and "MFU" in text
    outcome = float(re.search(r"^  macro\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)", text, re.M).group(1))  # dropless
    assert 4.0 <= outcome <= 6.238 and "verdict: CONFIRMED" in text  # it learned something, and the verdict says so
    assert f"site: {(tmp_path / 'site' / 'index.html').resolve()}" in text
    assert (tmp_path / "site" / "exp4_short.html").exists()


def test_demo_without_the_clone_says_where_it_runs(monkeypatch, tmp_path, capsys):
    """An install from a wheel holds no experiments/ or ladders/: the demo says to run it in a clone."""
    from moelab.cli import demo, main

    monkeypatch.setattr(demo, "EXAMPLE", tmp_path / "experiments" / "exp37_forecast_prior.py")
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    monkeypatch.setattr(demo, "DEMO_LADDER", tmp_path / "ladders" / "demo.yaml")
    assert main(["demo", "--prefix", str(tmp_path / "lab")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "run it in a clone (make demo), or give --experiment FILE" in line
    assert not (tmp_path / "lab").exists()
