"""A refused command leaves no folder behind: what it created for its --out (--prefix, --site), the
missing parents included, is gone once it exits 2 with its one line; a folder that was there before
stays as it was, and so does anything not written by the refused command."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import MICRO
from moelab.cli import main
from moelab.cli.common import new_outputs, remove_new_outputs

SETS = [x for kv in MICRO for x in ("--set", kv)]

# (what is refused, the arguments, what the one line names). {f}: the inputs below, {t}: this case's own
# folder, where each --out is new (its parents too where the path is nested)
CASES = [
    ("the backend", "train tiny --out {t}/o --set model.attention_impl=cudnn", "model.attention_impl"),
    ("a --data path that is not there", "train tiny --out {t}/o --data {f}/missing.txt", "missing.txt"),
    ("data.sources naming nothing", "train tiny --out {t}/o --set data.sources=[{f}/missing.txt]", "missing.txt"),
    ("a source in a format not read", "train tiny --out {t}/o --data {f}/table.csv", "table.csv"),
    ("JSON lines without the text field", "train tiny --out {t}/o --data {f}/nofield.jsonl", "'text' field"),
    ("a domain with no text", "train tiny --out {t}/o --data {f}/empty.txt", "no documents"),
    ("a missing tokenizer, nested --out",
     "train tiny --out {t}/a/b/o --data {f}/words.txt --set data.tokenizer={f}/nope.json", "data.tokenizer"),
    ("a file that is no tokenizer", "train tiny --out {t}/o --data {f}/words.txt --set data.tokenizer={f}/badtok.json",
     "badtok.json"),
    ("a missing task file", "train tiny --out {t}/o --set train.task_evals=[{f}/missing_task.jsonl]", "train.task_evals"),
    ("a task file that is not JSON", "train tiny --out {t}/o --set train.task_evals=[{f}/notjson.jsonl]", "notjson.jsonl"),
    ("a task line without a context", "train tiny --out {t}/o --set train.task_evals=[{f}/nocontext.jsonl]",
     "nocontext.jsonl:1"),
    ("a validation source not there", "train tiny --out {t}/o --set data.validation=[{f}/missing.txt]", "missing.txt"),
    ("a mesh larger than the devices", "train tiny --out {t}/o --set mesh.data=16", "mesh.data"),
    ("a domain shorter than a sequence", "train tiny --out {t}/o --data {f}/words.txt --set model.seq_len=4096 "
     "--set train.batch_size=1", "model.seq_len"),
    ("a fault naming no domain", "train tiny --out {t}/o --data {f}/words.txt --inject data_corruption@3:nodomain",
     "'nodomain', not a domain"),
    ("phase lengths that fall", "train tiny --out {t}/o --set data.phase_seq_lens=[64,32]", "data.phase_seq_lens"),
    ("an export of a run with no checkpoint", "export hf {run} --out {t}/x/hf", "no complete checkpoint"),
    ("an export of a run that is not one", "export safetensors {t} --out {t}/x/model.safetensors", "config.json"),
    ("a forecast from rungs not there", "ladder forecast --ladder {t}/missing --target tiny --out {t}/x/fc.json",
     "missing"),
    ("a site of a prefix not there", "report --prefix {t}/missing --out {t}/x/site", "--prefix"),
    ("an experiment file that is none", "run {f}/noexp.py --prefix {t}/x/lab", "noexp.py"),
    ("a change without a reason", "change {f}/noexp.py --what x --why  --prefix {t}/x/lab", "--why"),
]  # fmt: skip
TRAINS_FIRST = "the backend"  # the one case that also traces the memory plan (fit_check) as a run does


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_run_config):
    f = tmp_path_factory.mktemp("inputs")
    (f / "table.csv").write_text("a,b\n1,2\n")
    (f / "nofield.jsonl").write_text(json.dumps({"body": "some text"}) + "\n")
    (f / "empty.txt").write_text("")
    (f / "words.txt").write_text("a few words of text, too few for a long sequence\n" * 4)
    (f / "badtok.json").write_text("{}")
    (f / "notjson.jsonl").write_text("not json\n")
    (f / "nocontext.jsonl").write_text(json.dumps({"choices": ["a", "b"], "answer": 0}) + "\n")
    (f / "noexp.py").write_text("x = 1\n")
    return {"f": f, "run": tiny_run_config}


@pytest.fixture(scope="module")
def tiny_run_config(tmp_path_factory):
    """A folder holding a run's config.json and no checkpoint (what `export --checkpoint 999` reads)."""
    from moelab.config import config_hash, load_config, to_dict

    run = tmp_path_factory.mktemp("run")
    cfg = load_config("tiny", MICRO)
    (run / "config.json").write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}))
    return run


@pytest.fixture
def quick_plan(monkeypatch):
    """The memory plan's fit check traces the model (about a second on 2 cores); the refusals after it
    do not depend on it, so all but one case skip it."""
    import moelab.plan.memory

    monkeypatch.setattr(moelab.plan.memory, "fit_check", lambda cfg: None)


def call(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def refused(argv: str, fields: dict, capsys) -> str:
    args = [a.format(**fields) for a in argv.split(" ")]
    if args[-1] == "" and "--why" in args:  # "--why  ": an empty reason
        args = args[:-1]
    code = call(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (argv, code, err[-2000:])
    assert len(lines) == 1, (argv, err[-2000:])
    return lines[0]


@pytest.mark.parametrize("what,argv,names", CASES, ids=[c[0] for c in CASES])
def test_a_refused_command_leaves_no_folder(inputs, tmp_path, capsys, monkeypatch, request, what, argv, names):
    if what != TRAINS_FIRST:
        request.getfixturevalue("quick_plan")
    monkeypatch.chdir(tmp_path)
    line = refused(argv, {"f": inputs["f"], "t": tmp_path, "run": inputs["run"]}, capsys)
    assert names in line, (argv, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], (argv, sorted(map(str, tmp_path.rglob("*"))))


def test_the_table_is_wide():
    """At least 16 kinds of refusal, over every command that writes a folder or a file."""
    assert len({c[0] for c in CASES}) == len(CASES) >= 16
    assert {c[1].split(" ")[0] for c in CASES} >= {"train", "export", "ladder", "report", "run", "change"}


def test_a_folder_that_was_there_stays_as_it_was(inputs, tmp_path, capsys, quick_plan):
    """--out given as a folder that holds a file, and as a new folder inside one: the refusal after the
    run's folder would be made removes only what the command made."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".notes").write_text("kept")  # a hidden file: train accepts the folder as empty
    before = (mine / ".notes").stat().st_mtime_ns
    for out in (mine, mine / "new" / "run"):
        line = refused(f"train tiny --out {out} --data {inputs['f']}/missing.txt", {}, capsys)
        assert "missing.txt" in line
        assert sorted(p.name for p in mine.iterdir()) == [".notes"]
        assert (mine / ".notes").read_text() == "kept" and (mine / ".notes").stat().st_mtime_ns == before


def test_what_the_command_did_not_write_stays(tmp_path):
    """A new path that holds a file older than the command (another writer's), or a record of work
    done, is left whole; a parent it made that another command writes in too stays with that work."""
    import argparse

    started = time.time_ns()
    ours, top = tmp_path / "a" / "b", tmp_path / "a"
    args = argparse.Namespace(out=str(ours), prefix=str(tmp_path), site=None)
    assert new_outputs(args) == [(ours, top)]  # the outermost folder made; an existing prefix is never listed
    ours.mkdir(parents=True)
    old = ours / "theirs.txt"
    old.write_text("not ours")
    os.utime(old, ns=(started - 3600 * 10**9,) * 2)
    remove_new_outputs([(ours, top)], started)
    assert old.read_text() == "not ours"
    old.unlink()
    for done in ("metrics.jsonl", "ckpt/step_00000010/commit_success.txt", "lab/t-1a2b.status"):
        work = ours / done  # a refusal after work was done (a refit mid-run): the run stays
        work.parent.mkdir(parents=True, exist_ok=True)
        work.write_text("{}")
        remove_new_outputs([(ours, top)], started)
        assert work.is_file(), done
        work.unlink()
    beside = top / "c" / "run" / "config.json"  # a run started beside this one in the same new folder
    beside.parent.mkdir(parents=True)
    beside.write_text("{}")
    remove_new_outputs([(ours, top)], started)
    assert not ours.exists() and beside.read_text() == "{}"
    beside.unlink()
    beside.parent.rmdir()
    remove_new_outputs([(top / "c" / "run", top)], started)
    assert not top.exists() and tmp_path.is_dir()


@pytest.mark.slow
def test_a_supervised_run_refused_by_its_first_process_leaves_no_folder(inputs, tmp_path):
    """--max-restarts: the child process refuses (and says so); the parent made the folder and removes it."""
    import subprocess
    import sys

    out = tmp_path / "new" / "run"
    args = [
        "train",
        "tiny",
        *SETS,
        "--max-restarts",
        "1",
        "--out",
        str(out),
        "--data",
        str(inputs["f"] / "missing.txt"),
    ]
    proc = subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"moelab: {inputs['f'] / 'missing.txt'}: no such file or directory"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_fault_naming_no_domain_is_refused_before_the_store(inputs, tmp_path, capsys, monkeypatch):
    """The domains are known once the sources are indexed: such a run stops there, not after tokenizing."""
    import moelab.train.loop

    def no_store(*a, **k):
        raise AssertionError("the token store was built before the refusal")

    monkeypatch.setattr(moelab.train.loop, "build_store", no_store)
    line = refused(
        "train tiny --out {t}/o --data {f}/words.txt --inject data_corruption@3:nodomain",
        {"f": inputs["f"], "t": tmp_path},
        capsys,
    )
    assert "'nodomain', not a domain (words)" in line
