"""Plain runs on the site: `moelab report --prefix DIR` on a folder of `moelab train` runs gives an index
that lists them beside the experiments and a page per run whose loss plot holds the run's losses."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np

from moelab.cli import main
from moelab.runs import read_jsonl


def _line_points(page: str, gid: str) -> np.ndarray:
    """The (x, y) vertices of the SVG path matplotlib wrote for the line with this gid."""
    group = re.search(rf'<g id="{gid}">\s*<path d="([^"]*)"', page)
    assert group, gid
    return np.array(re.findall(r"(-?[\d.]+) (-?[\d.]+)", group.group(1)), dtype=float)


def test_plain_runs_get_pages_and_plots_beside_the_experiments(tiny_run, lab, tmp_path, capsys):
    prefix = tmp_path / "runs"
    run = prefix / "mine" / "first"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("ckpt", "evals"))
    (run / "evals").mkdir()
    (run / "evals" / "step_00000010.json").write_text(json.dumps({"step": 10, "loss": {"macro": 5.4321}}))
    step_out = prefix / "lab" / "t-0123abcd"  # a lab step's output holds a run's files too: the lab's, not a run
    shutil.copytree(tiny_run, step_out, ignore=shutil.ignore_patterns("ckpt", "evals"))
    (step_out / "provenance.json").write_text("{}")
    assert main(["run", str(lab["exp"]), "--prefix", str(prefix / "lab")]) == 0
    capsys.readouterr()

    assert main(["report", "--prefix", str(prefix), "--out", str(tmp_path / "site")]) == 0
    index = (tmp_path / "site" / "index.html").read_text()
    assert "<a href='exp9_chain.html'>" in index  # the experiment under runs/lab, found from runs
    assert "<a href='run-mine__first.html'>mine/first</a>" in index
    assert index.count("<a href='run-") == 1  # the lab step's output is no plain run

    page = (tmp_path / "site" / "run-mine__first.html").read_text()
    train = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 10  # the fixture logs every step
    assert f"<td id=final-loss>{train[-1]['loss']:.6g}</td>" in page
    assert f"{train[-1]['step']} of 10" in page
    # the loss plot: one vertex per logged step, at the step, its height the loss (an affine map to pixels)
    xy = _line_points(page, "train-loss")
    steps, losses = np.array([r["step"] for r in train], float), np.array([r["loss"] for r in train])
    assert len(xy) == len(train)
    for data, px in ((steps, xy[:, 0]), (losses, xy[:, 1])):
        fit = np.polyfit(data, px, 1)
        assert np.abs(np.polyval(fit, data) - px).max() < 0.01 * np.ptp(px), (data, px)
    assert np.polyfit(losses, xy[:, 1], 1)[0] < 0  # SVG's y points down: a higher loss is drawn higher
    assert "id='run-lr'" in page and "id='run-expert_load'" in page  # the same figures as an experiment's runs
    assert "step_00000010.json" in page and "5.4321" in page  # `moelab eval`'s kept results
    assert "<h2>Timeline</h2>" in page and "launch" in page


def test_a_folder_with_no_runs_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", "--prefix", str(tmp_path / "empty"), "--out", str(tmp_path / "site")]) == 0
    assert "No experiments or runs under" in (tmp_path / "site" / "index.html").read_text()


def test_the_chain_lab_has_no_runs(lab, tmp_path, capsys):
    """An experiment whose steps train nothing: its page, and no run rows."""
    assert main(["run", str(lab["exp"]), "--prefix", str(lab["prefix"])]) == 0
    assert main(["report", "--prefix", str(lab["prefix"]), "--out", str(tmp_path / "site")]) == 0
    index = (tmp_path / "site" / "index.html").read_text()
    assert "exp9_chain.html" in index and "<h2>Runs</h2>" not in index


def test_status_lists_plain_runs_beside_experiments(tiny_run, tmp_path, capsys):
    """`moelab status --prefix` names each plain run with its state, steps and last losses, read from its
    own records; a run without its summary is unfinished."""
    recs = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if r["kind"] == "train"][-1]
    assert main(["status", "--prefix", str(tiny_run.parent)]) == 0
    out = capsys.readouterr().out
    assert "runs (1):" in out
    (line,) = [x for x in out.splitlines() if str(tiny_run) in x]
    assert line.split()[0] == "finished" and f"step {last['step']} of 10" in line
    assert f"train loss {last['loss']:.4g}" in line
    copy = tmp_path / "runs" / "again"
    shutil.copytree(tiny_run, copy, ignore=shutil.ignore_patterns("ckpt", "evals"))
    (copy / "summary.json").unlink()
    assert main(["status", "--prefix", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "unfinished"
