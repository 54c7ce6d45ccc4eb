"""Bad input across every subcommand: one line on stderr that names the input, exit code 2, and
nothing left behind that looks like a run (no file written or changed under the case's directory or
the trained run it points at)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MICRO, write_experiment
from moelab.cli import main

BAD_FILES = {
    "list.yaml": "- a\n- b\n",
    "bad.yaml": "model: [unclosed\n",
    "unknown.yaml": "model:\n  no_such_field: 1\n",
    "nan.csv": "N,C,loss\n1e6,1e18,nan\n2e6,2e18,3.0\n",
    "inf.csv": "N,C,loss\n1e6,1e18,inf\n",
    "negn.csv": "N,C,loss\n-1e6,1e18,3\n",
    "c0.csv": "N,C,loss\n1e6,0,3\n",
    "short.csv": "N,C,loss\n1e6,1e18\n",
    "text.csv": "N,C,loss\n1e6,1e18,abc\n",
    "header.csv": "N,C,loss\n",
    "three.csv": "N,C,loss\n1e6,1e18,3\n2e6,4e18,2.9\n4e6,1.6e19,2.8\n",
    "same.csv": "N,C,loss\n" + "1e6,1e18,3\n" * 7,
    "good.csv": "N,C,loss\n" + "".join(f"{n},{n * t * 6},{2 + 1 / (n * t) ** 0.1}\n" for n in (1e6, 2e6, 4e6) for t in (10, 20, 40)),
    "badfc.json": '{"not": "a forecast"',
    "badfc2.json": '{"law": "x"}',
    "bandfc.json": '{"steps": [1, 2], "loss": [3, 3], "low": [3.5, 2], "high": [2.5, 4]}',
    "listfc.json": "[1, 2, 3]",
    "broken_exp.py": "this is not python(\n",
    "noexp.py": "x = 1\n",
    "nope_ladder.yaml": "name: x\nrecipe: tiny\nwidths: [a, b]\nhead_dim: 32\nlayers: [2]\n",
    "nowidths_ladder.yaml": "name: x\nrecipe: tiny\nwidths: []\nhead_dim: 32\nlayers: 2\ntokens_per_active_param: 20\n",
    "empty.yaml": "",
    "comments.yaml": "# nothing but a comment\n",
    "listbase.yaml": "- base: tiny\n",
}  # fmt: skip
BINARY = {"latin.yaml": b"\xff\xfe\x00bad", "latin.csv": b"N,C,loss\n\xff\xfe,1,2\n"}


@pytest.fixture(scope="module")
def env(corpus, tmp_path_factory):
    """A trained micro run, a copy whose config.json is cut short, and the bad files."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = root / "files"
    files.mkdir()
    for name, text in BAD_FILES.items():
        (files / name).write_text(text)
    for name, data in BINARY.items():
        (files / name).write_bytes(data)
    (files / "adir").mkdir()
    (files / "afile").write_text("a file")
    run = root / "run"
    sets = [x for kv in MICRO for x in ("--set", kv)]
    args = ["train", "tiny", *sets, "--steps", "6", "--data", corpus["code"], "--out", str(run), "--quiet"]
    assert main([*args, "--set", "train.checkpoint_every=3"]) == 0
    trunc = root / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text((run / "config.json").read_text()[:100])
    for name, (low, high, metric) in {
        "exp41_inverted.py": (3.1, 2.9, "c:value"),
        "exp42_nostep.py": (2.9, 3.1, "nowhere:value"),
        "exp43_outside.py": (3.5, 3.6, "c:value"),
    }.items():
        text = write_experiment(files / name).read_text()
        text = text.replace("low=2.9, high=3.1", f"low={low}, high={high}").replace(
            'metric="c:value"', f"metric={metric!r}"
        )
        (files / name).write_text(text)
    (files / "exp44_override.py").write_text(
        "from moelab.lab import Experiment, Prediction, output_of\nfrom moelab.lab.steps import train_step\n"
        "t = train_step('t', 'tiny', ['model.top_k=100'])\n"
        "experiment = Experiment(issue=44, slug='override', title='t', goal='g', hypothesis='h',\n"
        "    prediction=Prediction(metric='t:final_loss', value=1, low=0, high=2), steps=[t])\n"
    )
    (files / "exp45_train.py").write_text(
        "from moelab.lab import Experiment, Prediction\nfrom moelab.lab.steps import train_step\n"
        "t = train_step('t', 'tiny', ['train.steps=50'])\n"
        "experiment = Experiment(issue=45, slug='train', title='t', goal='g', hypothesis='h',\n"
        "    prediction=Prediction(metric='t:final_loss', value=1, low=0, high=2), steps=[t])\n"
    )
    return {"root": root, "files": files, "run": run, "trunc": trunc}


# (arguments, what the line must name); {f}: the bad files, {t}: this case's own directory,
# {run}: the trained run, {trunc}: a run whose config.json is cut short
CASES = [
    # the memory plan
    ("plan memory tiny --mesh data=2 --set model.attention_impl=cudnn", "model.attention_impl: cudnn needs"),
    ("train tiny --set model.attention_impl=cudnn --out {t}/o", "model.attention_impl: cudnn needs"),
    ("train tiny --set model.moe_impl=fast --out {t}/o", "model.moe_impl"),
    ("plan memory tiny --mesh data=2,expert=x", "--mesh"),
    ("plan memory tiny --mesh nodes=4", "--mesh"),
    ("plan memory tiny --mesh data=2,expert=3", "expert=3 does not divide"),
    ("plan memory tiny --mesh data=3", "train.batch_size=16 does not split"),
    ("plan memory tiny --mesh data=2 --device A100", "--device"),
    ("plan memory tiny --mesh data=2 --device-memory -4", "--device-memory"),
    ("plan memory tiny --mesh data=2 --micro-batch 0", "--micro-batch"),
    # configs
    ("train {f}/list.yaml --out {t}/o", "list.yaml"),
    ("train {f}/latin.yaml --out {t}/o", "latin.yaml"),
    ("train {f}/adir --out {t}/o", "adir"),
    ("train {f}/bad.yaml --out {t}/o", "bad.yaml"),
    ("train {f}/unknown.yaml --out {t}/o", "no_such_field"),
    ("train no-such-preset --out {t}/o", "no-such-preset"),
    ("train tiny --set nosection.x=1 --out {t}/o", "nosection"),
    ("train tiny --set model.d_model=abc --out {t}/o", "model.d_model"),
    ("train tiny --set garbage --out {t}/o", "garbage"),
    ("train tiny --set train.steps=0 --out {t}/o", "train.steps"),
    ("train tiny --set train.lr=-1 --out {t}/o", "train.lr"),
    ("train tiny --set train.warmup_frac=1.5 --out {t}/o", "train.warmup_frac"),
    ("train tiny --set model.top_k=100 --out {t}/o", "model.top_k"),
    ("train tiny --set model.vocab_size=100 --out {t}/o", "model.vocab_size"),
    ("train tiny --set model.vocab_size=1 --out {t}/o", "model.vocab_size"),
    ("train tiny --set data.text_field= --out {t}/o", "data.text_field"),
    ("train tiny --seed -1 --out {t}/o", "train.seed"),
    ("train tiny --steps x --out {t}/o", "--steps"),
    ("train tiny --inject lr_spike@-1 --out {t}/o", "lr_spike@-1"),
    ("train tiny --inject nope@5 --out {t}/o", "nope@5"),
    ("train tiny --inject lr_spike@x --out {t}/o", "lr_spike@x"),
    ("train tiny --inject token_noise@5:2 --out {t}/o", "token_noise@5:2"),
    # where the run goes
    ("train tiny --out /proc/moelab-nope", "--out"),
    ("train tiny --out {f}/afile", "--out"),
    ("train tiny --resume --out {t}/empty", "--out"),
    ("train tiny --resume --out {t}/missing", "--out"),
    ("train tiny --out {t}/stranger", "--out"),
    ("train tiny --resume --out {t}/stranger", "--out"),
    ("train tiny --out {run}", "--resume"),
    ("train --out {t}/o", "config"),
    ("train --resume --out {trunc}", "config.json"),
    ("train tiny --devices 0 --out {t}/o", "--devices"),
    ("train tiny --max-restarts -1 --out {t}/o", "--max-restarts"),
    # config and flops
    ("config tiny --set train.seed=-1", "train.seed"),
    ("config tiny --set data.text_field=", "data.text_field"),
    ("config no-such-preset", "no-such-preset"),
    ("flops tiny --steps -5", "--steps"),
    ("flops tiny --tokens -1", "--tokens"),
    ("flops tiny --tokens 5 --steps 3", "--tokens"),
    # ladder fit-nd
    ("ladder fit-nd {f}/nan.csv --n-col N --flops-col C --loss-col loss", "nan.csv"),
    ("ladder fit-nd {f}/inf.csv --n-col N --flops-col C --loss-col loss", "inf.csv"),
    ("ladder fit-nd {f}/negn.csv --n-col N --flops-col C --loss-col loss", "negn.csv"),
    ("ladder fit-nd {f}/c0.csv --n-col N --flops-col C --loss-col loss", "c0.csv"),
    ("ladder fit-nd {f}/short.csv --n-col N --flops-col C --loss-col loss", "short.csv"),
    ("ladder fit-nd {f}/text.csv --n-col N --flops-col C --loss-col loss", "text.csv"),
    ("ladder fit-nd {f}/header.csv --n-col N --flops-col C --loss-col loss", "header.csv"),
    ("ladder fit-nd {f}/three.csv --n-col N --flops-col C --loss-col loss", "three.csv"),
    ("ladder fit-nd {f}/same.csv --n-col N --flops-col C --loss-col loss", "same.csv"),
    ("ladder fit-nd {f}/latin.csv --n-col N --flops-col C --loss-col loss", "latin.csv"),
    ("ladder fit-nd {f}/missing.csv --n-col N --flops-col C --loss-col loss", "missing.csv"),
    ("ladder fit-nd {f}/good.csv --n-col params --flops-col C --loss-col loss", "params"),
    ("ladder fit-nd {f}/good.csv --n-col N --flops-col C --loss-col loss --exclude-top -3", "--exclude-top"),
    ("ladder fit-nd {f}/good.csv --n-col N --flops-col C --loss-col loss --exclude-top 100", "--exclude-top"),
    ("ladder fit-nd {f}/good.csv --n-col N --flops-col C --loss-col loss --delta -1", "--delta"),
    ("ladder fit-nd {f}/good.csv --n-col N --flops-col C --loss-col loss --delta nan", "--delta"),
    # other ladder commands
    ("ladder plan {f}/missing.yaml", "missing.yaml"),
    ("ladder plan {f}/nope_ladder.yaml", "nope_ladder.yaml"),
    ("ladder backtest --ladder {run} --target {run}", "--ladder"),
    ("ladder forecast --ladder {t}/missing --target tiny --out {t}/fc.json", "missing"),
    # health and eval
    ("health {run} --forecast {f}/badfc.json", "badfc.json"),
    ("health {run} --forecast {f}/badfc2.json", "badfc2.json"),
    ("health {run} --forecast {f}/bandfc.json", "bandfc.json"),
    ("health {run} --forecast {f}/listfc.json", "listfc.json"),
    ("health {run} --forecast {f}/latin.yaml", "latin.yaml"),
    ("health {run} --forecast {f}/missing.json", "missing.json"),
    ("health {run} --ladder {t}/missing", "--ladder"),
    ("health {t}/nonexist", "nonexist"),
    ("health {trunc}", "config.json"),
    ("eval {trunc}", "config.json"),
    ("eval {t}/nonexist", "nonexist"),
    ("eval {run} --checkpoint 999", "999"),
    ("eval {run} --noise 2 --against {t}/nonexist", "nonexist"),
    ("eval {run} --noise 0", "--noise"),
    ("status --prefix /nonexistent-moelab", "--prefix"),
    ("train tiny --data {t}/nonexist --out {t}/o", "nonexist"),
    ("train tiny --data {f}/good.csv --out {t}/o", "good.csv"),
    ("train tiny --set train.steps=2.5 --out {t}/o", "train.steps"),
    # runs that cannot fit are refused before they start, with the plan's figure and what fits
    ("train tiny --set train.batch_size=100000 --out {t}/o", "train.batch_size 2"),
    ("train tiny --set model.n_routed=100000 --out {t}/o", "not even one sequence per device fits"),
    ("train tiny --data  --out {t}/o", "an empty source"),
    # replan
    ("replan {run} --tokens nan --reason x", "--tokens"),
    ("replan {run} --tokens inf --reason x", "--tokens"),
    ("replan {run} --tokens 1e300 --reason x", "--tokens"),
    ("replan {run} --tokens -5 --reason x", "--tokens"),
    ("replan {run} --tokens 10 --reason x", "--tokens"),
    ("replan {run} --tokens 100000 --reason  ", "--reason"),
    ("replan {trunc} --tokens 100000 --reason x", "config.json"),
    # the lab
    ("run {f}/missing_exp.py", "missing_exp.py"),
    ("run {f}/broken_exp.py", "broken_exp.py"),
    ("run {f}/noexp.py", "noexp.py"),
    ("run {f}/exp41_inverted.py --prefix {t}/lab", "low above high"),
    ("run {f}/exp42_nostep.py --prefix {t}/lab", "nowhere"),
    ("run {f}/exp43_outside.py --prefix {t}/lab", "outside its own interval"),
    ("run {f}/exp44_override.py --prefix {t}/lab", "model.top_k"),
    ("run {f}/exp44_override.py --prefix {t}/lab --dry-run", "model.top_k"),
    ("issue {f}/broken_exp.py", "broken_exp.py"),
    ("change {f}/exp45_train.py --what  --why y --prefix {t}/lab", "--what"),
    ("change {f}/exp45_train.py --what x --why  --prefix {t}/lab", "--why"),
    ("change {f}/exp45_train.py --what x --why y --step 51 --prefix {t}/lab", "--step"),
    ("change {f}/exp45_train.py --what x --why y --step -1 --prefix {t}/lab", "--step"),
    ("report --prefix /nonexistent-moelab --out {t}/site", "--prefix"),
    ("report --prefix {t} --out {f}/good.csv", "--out"),
    # issue 43: the tracebacks and silent accepts a new user met
    ("train {f}/empty.yaml --out {t}/o", "empty.yaml: empty"),
    ("train {f}/comments.yaml --out {t}/o", "comments.yaml: empty"),
    ("config {f}/listbase.yaml", "listbase.yaml: expected a mapping"),
    ("plan memory {f}/list.yaml --mesh data=2", "list.yaml: expected a mapping"),
    ("sample {run} --prompt x --seed -1", "--seed -1"),
    ("sample {run} --prompt x --temperature nan", "--temperature nan"),
    ("sample {run} --prompt x --temperature inf", "--temperature inf"),
    ("ladder plan {f}/nowidths_ladder.yaml", "widths"),
    ("run {f}/exp45_train.py --only ([ --prefix {t}/lab", "--only '(['"),
    ("run {f}/exp45_train.py --force ([ --prefix {t}/lab", "--force '(['"),
    ("run {f}/exp45_train.py --only nomatch --prefix {t}/lab", "matches none"),
    ("run {f}/exp45_train.py --max-concurrent 0 --prefix {t}/lab", "--max-concurrent 0"),
    ("train tiny --coordinator nohost --num-processes 2 --process-id 0 --out {t}/o", "--coordinator 'nohost'"),
    ("train tiny --coordinator host:port --num-processes 2 --process-id 0 --out {t}/o", "HOST:PORT"),
    ("plan memory tiny --mesh data=2,data=4", "given twice"),
    ("plan memory tiny --mesh ", "--mesh: empty"),
    ("plan memory tiny --mesh data=2 --micro-batch 3", "--micro-batch: 3 sequences per device does not divide the 8"),
    ("train tiny --steps 2 --inject lr_spike@99 --out {t}/o", "lr_spike@99"),
    ("change {f}/exp45_train.py --what x --why y --prefix {t}/nowhere", "holds no journal"),
    ("eval {run} --against {run}", "--against: only with --noise"),
    ("eval {run} --depths 0.5", "--depths: only with --retrieval"),
    ("eval {run} --examples 4", "--examples: only with --retrieval"),
    ("eval {run} --samples 2", "--samples: only with --tasks"),
    ("eval {run} --temperature 0.5", "--temperature and --seed"),
    ("eval {run} --noise 2 --retrieval 64", "--noise with --retrieval"),
    ("eval {run} --noise 2 --data {t}", "--data with --noise"),
    ("export hf {run} --out {f}/afile/model", "is a file, not a folder"),
    ("export safetensors {run} --out /proc/moelab-nope/x.safetensors", "/proc"),
    ("report --prefix {run} --out /proc/moelab-nope/site", "--out"),
    ("report --prefix {run} --out {f}/afile/site", "is a file, not a folder"),
    ("train --restart --out {run}", "--restart"),
    ("train tiny --restart --out {t}/missing", "--out"),
]


def call(args: list[str]) -> int:
    """main(), with argparse's own exit (a usage error) as its code."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def snapshot(*roots: Path) -> dict:
    """Every file under the roots, with its size and modification time (directories alone do not count)."""
    out = {}
    for root in roots:
        if root.is_dir():
            for p in root.rglob("*"):
                if p.is_file():
                    st = p.stat()
                    out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("argv,names", CASES, ids=[c[0].split(" {")[0] + f" #{i}" for i, c in enumerate(CASES)])
def test_bad_input_gets_one_line_and_exit_2_and_leaves_nothing(env, tmp_path, capsys, monkeypatch, argv, names):
    monkeypatch.setenv("LAB_COUNTS", str(tmp_path))  # what the chain experiments' steps need to load
    (tmp_path / "empty").mkdir()
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "notes.txt").write_text("mine")
    fields = {"f": env["files"], "t": tmp_path, "run": env["run"], "trunc": env["trunc"]}
    args = [a.format(**fields) for a in argv.split(" ")]
    if args[-1] == "" and "--reason" in args:  # "--reason  ": an empty reason
        args = args[:-1]
    before = snapshot(tmp_path, env["run"], env["trunc"])
    code = call(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (argv, code, err[-2000:])
    assert len(lines) == 1, (argv, err[-2000:])
    assert names in lines[0], (argv, lines[0])
    assert "Traceback" not in err
    assert snapshot(tmp_path, env["run"], env["trunc"]) == before, argv  # nothing written, nothing changed


def test_the_table_is_wide(env):
    """At least 60 cases over every subcommand that reads input."""
    assert len(CASES) >= 60
    commands = {c[0].split(" ")[0] for c in CASES}
    assert {"train", "config", "flops", "ladder", "health", "eval", "replan", "run", "issue", "report"} <= commands
    assert json.loads((env["run"] / "config.json").read_text())["config"]["train"]["steps"] == 6


def test_help_of_every_command_group_prints(capsys):
    """`moelab ladder --help` once failed (a % in its help text went through argparse's formatting)."""
    for group in (["ladder"], ["ladder", "fit-nd"], ["train"], ["run"], ["health"], ["replan"]):
        assert call([*group, "--help"]) == 0
        assert "usage: moelab " + " ".join(group) in capsys.readouterr().out


def test_a_run_that_died_before_its_config_can_still_be_resumed(tmp_path):
    """The supervisor's restart resumes a run whose first process died before config.json: its
    events are there, so --resume is not refused as 'nothing to resume'."""
    import argparse

    from moelab.cli.train import _check_out

    (tmp_path / "events.jsonl").write_text('{"event": "restart"}\n')
    _check_out(argparse.Namespace(out=str(tmp_path), resume=True))  # no refusal
    (tmp_path / "events.jsonl").unlink()
    with pytest.raises(Exception, match="holds no run to resume"):
        _check_out(argparse.Namespace(out=str(tmp_path), resume=True))


def test_a_change_inside_the_run_is_recorded(env, tmp_path):
    from moelab.runs import read_jsonl

    exp = str(env["files"] / "exp45_train.py")
    (tmp_path / "experiments" / "exp45_train").mkdir(parents=True)  # the journal its run starts
    (tmp_path / "experiments" / "exp45_train" / "journal.jsonl").touch()
    assert main(["change", exp, "--what", "lr x0.5", "--why", "spikes", "--step", "50", "--prefix", str(tmp_path)]) == 0
    (rec,) = read_jsonl(tmp_path / "experiments" / "exp45_train" / "journal.jsonl")
    assert (rec["event"], rec["what"], rec["why"], rec["at_step"]) == ("change", "lr x0.5", "spikes", 50)


def test_resuming_a_finished_run_says_so_and_writes_nothing(env, capsys):
    before = snapshot(env["run"])
    assert main(["train", "--resume", "--out", str(env["run"]), "--quiet"]) == 0
    assert "the run is finished (step 6 of 6)" in capsys.readouterr().err
    assert snapshot(env["run"]) == before  # no event appended, no summary rewritten


def test_status_on_a_fresh_checkout_says_nothing_has_run(tmp_path, monkeypatch, capsys):
    """No runs/lab yet (the default prefix): said, exit 0; a --prefix given that does not exist is bad input."""
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 0
    assert "nothing has run here yet: runs/lab does not exist" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()
    assert main(["status", "--prefix", str(tmp_path / "typo")]) == 2


def test_output_into_a_closed_pipe_is_quiet():
    """`moelab ... | head` stops reading early: the command ends as SIGPIPE would (141), without a traceback."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first line
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "moelab", "config", "--explain", "model"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(w)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_cache_that_is_a_file_is_refused_in_one_line(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOELAB_CACHE", str(env["files"] / "afile"))
    assert call(["train", "tiny", *(x for kv in MICRO for x in ("--set", kv)), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MOELAB_CACHE" in err and "afile" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_an_object_store_that_cannot_be_reached_is_refused_at_once(monkeypatch):
    """A host that does not resolve (.invalid never does, RFC 2606) is one line, not a minute of
    retries and a traceback."""
    import time

    from moelab.data import files
    from moelab.errors import DataError

    monkeypatch.setitem(files.HOSTS, "gs", "storage.moelab.invalid")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    files._unreachable.cache_clear()
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"gs://bucket/shards: cannot reach storage\.moelab\.invalid"):
        files.exists("gs://bucket/shards")
    assert time.perf_counter() - t0 < 15
    files._unreachable.cache_clear()
