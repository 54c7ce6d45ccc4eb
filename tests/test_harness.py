"""`moelab eval RUN --harness TASK,...`: lm-evaluation-harness on the exported checkpoint, offline.

Without lm-eval the command says what to install; with it (the harness extra), a task that cannot
run is refused in one line, and a local multiple-choice task YAML runs end to end. Its numbers are
checked against moelab's: lm-eval's log-likelihood of each choice equals moelab's on the same tokens,
and moelab's ``score`` of those log-likelihoods gives lm-eval's acc and acc_norm.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from moelab.cli import main
from moelab.export.harness import NEEDS


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_harness_without_lm_eval_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["eval", str(tmp_path), "--harness", "arc_easy"]) == 2
    err = _err(capsys)
    assert len(err) == 1 and NEEDS in err[0], err
    for args, msg in [
        (["--harness", "a", "--tasks", "t.jsonl"], "--harness with --tasks"),
        (["--harness", " , "], "--harness: give lm-eval task names"),
        (["--limit", "3"], "--limit: only with --harness"),
    ]:
        assert main(["eval", str(tmp_path), *args]) == 2, args
        err = _err(capsys)
        assert len(err) == 1 and msg in err[0], (args, err)


def _yaml(path, data) -> str:
    path.write_text(
        "task: tiny_next_line\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    return str(path)


def test_harness_refuses_tasks_it_cannot_run(tiny_run, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    cases = [
        (str(tmp_path / "missing.yaml"), "missing.yaml: no such task YAML"),
        (_yaml(tmp_path / "nodata.yaml", tmp_path / "gone.jsonl"), "nodata.yaml: its dataset is not on this machine"),
    ]
    # a moelab task file may mix multiple choice with continuations; a multiple-choice YAML over it cannot
    # read the continuation (lm-eval raised a TypeError deep inside before), nor an answer past the choices
    good = {"context": "x = (", "choices": ["1)", "1]"], "answer": 0}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(good) + "\n" + json.dumps({"context": "y = ", "continuation": "2"}) + "\n")
    past = tmp_path / "past.jsonl"
    past.write_text(json.dumps(good) + "\n" + json.dumps({**good, "answer": 5}) + "\n")
    cases += [
        (_yaml(tmp_path / "mixed.yaml", mixed), "tiny_next_line: document 1 does not fit the task's fields"),
        (_yaml(tmp_path / "past.yaml", past), "document 1 does not fit the task's fields (its target 5 is not one of"),
    ]
    _refused(tiny_run, cases, capsys)


@pytest.mark.slow  # lm-eval's index of its own tasks takes seconds to scan
def test_harness_refuses_task_names_it_cannot_run(tiny_run, capsys):
    pytest.importorskip("lm_eval")
    cases = [
        ("no_such_task_xyz", "no_such_task_xyz: not an lm-eval task"),
        ("arc_easy", "arc_easy: its dataset is not on this machine (not in the local Hugging Face cache"),
    ]
    _refused(tiny_run, cases, capsys)


def _refused(run, cases, capsys):
    for spec, msg in cases:
        assert main(["eval", str(run), "--harness", spec]) == 2, spec
        err = _err(capsys)
        assert len(err) == 1 and msg in err[0], (spec, err)
    assert not list((run / "evals").glob("*-harness.json"))


def _next_line_task(corpus, path, n=16, seed=0):
    """A moelab task file (context + four candidate lines + answer) from short lines of stdlib code:
    which line really follows. Short, so that no pair is cut to the model's context of 64 tokens."""
    from pathlib import Path

    lines = [s.rstrip() for s in (Path(corpus["code"]) / "textwrap.py").read_text().splitlines()]
    lines = [s for s in lines if 8 <= len(s.strip()) <= 40]
    pool = sorted(set(lines))
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for i in rng.choice(len(lines) - 1, n, replace=False):
            true = lines[i + 1]
            wrong = [pool[j] for j in rng.choice(len(pool), 4, replace=False) if pool[j] != true][:3]
            answer = int(rng.integers(4))
            choices = ["\n" + c for c in wrong[:answer] + [true] + wrong[answer:]]
            fh.write(json.dumps({"context": lines[i], "choices": choices, "answer": answer}) + "\n")
    return path


def test_harness_runs_a_local_task_and_agrees_with_moelab(tiny_run, corpus, tmp_path, capsys):
    """A multiple-choice task YAML over a local JSON-lines file (the same file is a moelab task) through
    `moelab eval --harness`; lm-eval's log-likelihoods are moelab's on the same tokens, and its acc and
    acc_norm are what moelab's ``score`` makes of them. moelab's own `eval --tasks` conditions on an
    end-of-text token first (lm-eval on the context alone), so its numbers may differ a little."""
    pytest.importorskip("lm_eval")
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer

    from moelab.eval.tasks import load_task, score
    from moelab.export import load_trained
    from moelab.export.harness import evaluate_harness
    from moelab.train.run_tasks import evaluate_tasks
    from test_export import moelab_logits

    data = _next_line_task(corpus, tmp_path / "next_line.jsonl")
    yaml = _yaml(tmp_path / "next_line.yaml", data)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread (see test_export)
    try:
        assert main(["eval", str(tiny_run), "--harness", yaml]) == 0
        table = capsys.readouterr().out
        res = evaluate_harness(tiny_run, [yaml], progress=False, samples=True)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tiny_run / "evals" / "step_00000010-harness.json").read_text())
    got = res["tasks"]["tiny_next_line"]
    assert saved["tasks"] == res["tasks"] and res["examples"] == {"tiny_next_line": 16} and res["step"] == 10
    assert f"{got['acc']:>8.4f}" in table.split("acc_norm")[0] and "tiny_next_line" in table

    # lm-eval's requests: the context alone (its trailing spaces moved to the choice), the choice's tokens
    # those of context + choice past the context's
    examples = load_task(data)
    t = load_trained(tiny_run)
    tok = Tokenizer.from_file(str(t.tokenizer_path))
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    seqs = []
    for ex in examples:
        context = ex.context.rstrip()
        seqs.extend((enc(ex.context + c), len(enc(context))) for c in ex.choices)
    assert max(len(s) for s, _ in seqs) <= 64
    logits = moelab_logits(t.params, t.model_state, t.cfg.model, [s for s, _ in seqs])
    ours = []
    for (ids, n), lg in zip(seqs, logits, strict=True):
        logp = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
        ours.append(float(sum(logp[k - 1, ids[k]] for k in range(n, len(ids)))))
    by_doc = sorted(res["samples"]["tiny_next_line"], key=lambda s: s["doc_id"])
    theirs = [ll for s in by_doc for ll in s["resps"]]
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    mine = score(examples, lambda _: ours)
    assert (got["acc"], got["acc_norm"]) == pytest.approx((mine["acc"], mine["acc_norm"]), abs=1e-12)
    own = evaluate_tasks(tiny_run, [str(data)], progress=False)["tasks"]["next_line"]
    print(f"lm-eval acc {got['acc']:.4f} acc_norm {got['acc_norm']:.4f}; moelab eval --tasks acc {own['acc']:.4f} "
          f"acc_norm {own['acc_norm']:.4f} (after an end-of-text token); chance {own['chance']:.2f}")  # fmt: skip
