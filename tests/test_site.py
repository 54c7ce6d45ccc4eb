"""The static site and the issue text: every section, escaped user text, config diffs, opened in headless Chromium."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import MICRO, write_experiment
from moelab.cli import main
from moelab.lab.journal import Journal

REAL = """
from moelab.lab import Experiment, Prediction, output_of
from moelab.lab.steps import eval_step, train_step

train = train_step("micro", "tiny", OVERRIDES, progress=False)
evaluate = eval_step("micro-eval", output_of(train))
experiment = Experiment(issue=7, slug="micro", title="Micro <b>run</b>", goal="Check the site & its escaping.",
    hypothesis="Loss falls. <script>alert('owned')</script>",
    prediction=Prediction(metric="micro-eval:loss_dropless.macro", value=6.0, low=4.0, high=8.0), steps=[evaluate])
"""


@pytest.fixture(scope="module")
def real_lab(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("real_lab")
    overrides = [*MICRO, f"data.sources=[{corpus['code']}, {corpus['prose']}]", "train.steps=12"]
    exp = root / "exp7_micro.py"
    exp.write_text(REAL.replace("OVERRIDES", repr(overrides)))
    assert main(["run", str(exp), "--prefix", str(root / "prefix")]) == 0
    site = root / "site"
    assert main(["report", "--prefix", str(root / "prefix"), "--out", str(site)]) == 0
    return {"exp": exp, "prefix": root / "prefix", "site": site}


def test_issue_text_has_every_section(real_lab, capsys):
    assert main(["issue", str(real_lab["exp"]), "--prefix", str(real_lab["prefix"])]) == 0
    md = capsys.readouterr().out
    for section in ("## Goal", "## Hypothesis", "## Pre-registered prediction", "## Steps and configs", "## Results"):
        assert section in md
    assert "CONFIRMED" in md and "micro-eval:loss_dropless.macro" in md
    assert "| micro |" in md and "K /" in md  # parameters of the trained config


def test_site_escapes_user_text(real_lab):
    page = (real_lab["site"] / "exp7_micro.html").read_text()
    assert "&lt;script&gt;alert(&#x27;owned&#x27;)&lt;/script&gt;" in page
    assert "<script" not in page and "Micro &lt;b&gt;run&lt;/b&gt;" in page
    index = (real_lab["site"] / "index.html").read_text()
    assert "exp7_micro.html" in index and "CONFIRMED" in index
    for key in ("loss", "lr", "grad_norm", "dropped", "expert_load", "router_entropy", "throughput"):
        assert f"id='micro-{key}'" in page, key
    assert page.count("<svg") >= 7 and "step_finished" in page and "checkpoint" in page


CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium: apt-get install chromium (.ci/run does this)")
def test_site_opens_in_headless_chromium_without_errors(real_lab, tmp_path):
    from PIL import Image

    for page in ("index.html", "exp7_micro.html"):
        shot = tmp_path / f"{page}.png"
        res = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--enable-logging=stderr",
                "--v=0",
                "--window-size=1200,2400",
                f"--screenshot={shot}",
                (real_lab["site"] / page).as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert shot.exists(), res.stderr[-2000:]
        console = [line for line in res.stderr.splitlines() if "CONSOLE" in line or "Failed to load resource" in line]
        assert not console, console
        pixels = Image.open(shot).convert("L")
        lo, hi = pixels.getextrema()
        assert hi - lo > 100, page  # not blank
        if page != "index.html":
            # the plots render: a region below the header holds many distinct shades
            assert len(pixels.crop((0, 600, 1200, 2400)).getcolors(maxcolors=1 << 16)) > 50


def test_site_shows_config_diff_and_mid_run_changes(lab, capsys):
    assert main(["run", str(lab["exp"]), "--prefix", str(lab["prefix"])]) == 0
    assert (
        main(
            [
                "change",
                str(lab["exp"]),
                "--prefix",
                str(lab["prefix"]),
                "--what",
                "lr x 0.5 <now>",
                "--why",
                "gradient norm kept climbing",
            ]
        )
        == 0
    )
    write_experiment(lab["exp"], value=5, hypothesis="second version")
    assert main(["run", str(lab["exp"]), "--prefix", str(lab["prefix"])]) == 0
    assert main(["report", "--prefix", str(lab["prefix"]), "--out", str(lab["prefix"] / "site")]) == 0
    page = (lab["prefix"] / "site" / "exp9_chain.html").read_text()
    assert "Diff against the previous version" in page
    assert "-  &quot;size&quot;: 1" in page and "+  &quot;size&quot;: 5" in page
    assert "lr x 0.5 &lt;now&gt;" in page and "gradient norm kept climbing" in page
    events = Journal(lab["prefix"] / "experiments" / "exp9_chain" / "journal.jsonl").read()
    (change,) = [e for e in events if e["event"] == "change"]
    assert change["at_step"] is None  # the chain trains nothing: a training step would name nothing (refused)
    assert main(["status", "--prefix", str(lab["prefix"])]) == 0
    out = capsys.readouterr().out
    assert "exp9_chain (v2)" in out and "SUCCESS" in out and "CONFIRMED" in out
