"""Task evaluations (moelab.eval.tasks): the format's refusals and the metrics against a hand-computed
case, from log-likelihoods set by hand."""

from __future__ import annotations

import json
import math

import pytest

from moelab.errors import UsageError
from moelab.eval.tasks import Example, load_task, score

# log-likelihoods (nats) set by hand for each (context, continuation)
LL = {
    ("2+2=", "4"): -1.0, ("2+2=", "22"): -2.5, ("2+2=", "5"): -3.0,          # right: "4" (acc and acc_norm)
    ("grass is", " green"): -5.5, ("grass is", " blue"): -5.0,               # raw: blue; per byte: green
    ("def f(", "x):"): -2.0,                                                 # a continuation
}  # fmt: skip


def test_metrics_against_a_hand_computed_case():
    exs = [
        Example("2+2=", ("4", "22", "5"), 0),
        Example("grass is", (" green", " blue"), 0),
        Example("def f(", continuation="x):"),
    ]
    res = score(exs, lambda pairs: [LL[p] for p in pairs])
    # acc: example 1 right (-1.0 best), example 2 wrong (" blue" -5.0 beats " green" -5.5): 1/2
    assert res["acc"] == 0.5
    # acc_norm, per character (ASCII: per byte alike): ex 1 -1/1, -2.5/2, -3/1 -> "4"; ex 2 -5.5/6 = -0.92
    # beats -5/5 -> " green": 2/2
    assert res["acc_norm"] == res["acc_bytes"] == 1.0
    assert res["chance"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    # bits per byte over the right answers and the continuation: (1 + 5.5 + 2) nats over 1 + 6 + 3 bytes
    assert res["bpb"] == pytest.approx(8.5 / math.log(2) / 10)
    assert res["examples"] == 3 and res["multiple_choice"] == 2


def test_acc_norm_differs_from_acc_where_length_matters():
    exs = [Example("q", ("a", "bbbbbbbbbb"), 1)]
    res = score(exs, lambda pairs: [-1.0, -5.0])  # the long choice: lower in total, higher per byte
    assert res["acc"] == 0.0 and res["acc_norm"] == 1.0


# "ééé": 3 characters, 6 UTF-8 bytes; "abcd": 4 and 4. Log-likelihoods -3.3 and -4.0: per character
# -1.1 against -1.0 picks "abcd", per byte -0.55 against -1.0 picks "ééé" (the answer)
NON_ASCII = ("q", ["ééé", "abcd"], 0, [-3.3, -4.0])


def test_acc_norm_is_per_character_and_acc_bytes_per_byte_on_a_non_ascii_choice():
    context, choices, answer, ll = NON_ASCII
    res = score([Example(context, tuple(choices), answer)], lambda pairs: ll)
    assert res["acc"] == 1.0 and res["acc_norm"] == 0.0 and res["acc_bytes"] == 1.0


def test_acc_norm_and_acc_bytes_are_lm_evals_own(tmp_path):
    """lm-evaluation-harness's own scoring of the same log-likelihoods (its multiple-choice
    process_results on a local task; the dev install holds lm-eval) gives moelab's numbers."""
    import json

    from lm_eval.api.task import ConfigurableTask

    context, choices, answer, ll = NON_ASCII
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"context": context, "choices": choices, "answer": answer}) + "\n")
    task = ConfigurableTask(config={
        "task": "non_ascii", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
        "doc_to_target": "answer", "target_delimiter": "",
        "metric_list": [{"metric": m, "higher_is_better": True} for m in ("acc", "acc_norm", "acc_bytes")]})  # fmt: skip
    theirs = task.process_results(next(iter(task.test_docs())), [(x, False) for x in ll])
    ours = score([Example(context, tuple(choices), answer)], lambda pairs: ll)
    assert theirs == {"acc": 1.0, "acc_norm": 0.0, "acc_bytes": 1.0}  # the hand-computed case above
    assert {k: ours[k] for k in theirs} == theirs


def test_ties_go_to_the_first_choice():
    exs = [Example("q", ("a", "b", "c"), 0), Example("q", ("a", "b", "c"), 2)]
    res = score(exs, lambda pairs: [0.0] * len(pairs))
    assert res["acc"] == 0.5


@pytest.mark.parametrize(
    "line,msg",
    [
        ("not json", "not a JSON object"),
        (json.dumps({"choices": ["a", "b"], "answer": 0}), 'needs a string "context"'),
        (json.dumps({"context": "c", "choices": ["a"], "answer": 0}), "two or more non-empty strings"),
        (json.dumps({"context": "c", "choices": ["a", "b"], "answer": 2}), "index of the right choice, 0..1"),
        (json.dumps({"context": "c", "choices": ["a", "b"], "answer": True}), "index of the right choice"),
        (json.dumps({"context": "c"}), 'or a non-empty "continuation"'),
    ],
)
def test_bad_task_lines_are_refused_in_one_line(tmp_path, line, msg):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "ok", "continuation": "x"}) + "\n" + line + "\n")
    with pytest.raises(UsageError, match=msg) as err:
        load_task(path)
    assert f"{path}:2" in str(err.value) and "\n" not in str(err.value)


def test_a_task_file_loads(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "answer": 1}) + "\n\n"
                    + json.dumps({"context": "d", "continuation": "e"}) + "\n")  # fmt: skip
    assert load_task(path) == [Example("a", ("b", "c"), 1), Example("d", continuation="e")]
    with pytest.raises(UsageError, match="no such task file"):
        load_task(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UsageError, match="holds no example"):
        load_task(tmp_path / "empty.jsonl")


class _ByteTok:
    """A stand-in tokenizer: one id per UTF-8 byte (+ 2), eos 1, no bos."""

    eos, bos, add_bos = 1, None, False

    class tokenizer:  # noqa: N801 - the shape of a tokenizers.Tokenizer's encode
        @staticmethod
        def encode(text, add_special_tokens=False):
            import types

            return types.SimpleNamespace(ids=[b + 2 for b in text.encode("utf-8")])


def test_model_loglik_equals_the_log_softmax_of_the_full_forward():
    """The batched, padded, truncated scoring against each pair's log-probabilities read one by one
    from the model's whole log-softmax: pairs of several lengths, one longer than the context (cut at
    its start), batches of 2 with a short last batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from conftest import MICRO
    from moelab.config import load_config
    from moelab.eval.tasks import model_loglik
    from moelab.model import init_params, init_state
    from moelab.model.transformer import forward, logits_of

    m = load_config("tiny", MICRO).model  # seq_len 32, vocab 512
    params, state = init_params(m, jax.random.PRNGKey(3)), init_state(m)
    pairs = [("ab", "cd"), ("hello there", " you"), ("x" * 40, "yz"), ("q", "r")]
    got = model_loglik(params, state, m, _ByteTok, batch=2)(pairs)
    fwd = jax.jit(lambda p, st, x: forward(p, st, x, m, "dropless"))
    for (ctx, cont), value in zip(pairs, got, strict=True):
        ids = ([1] + [b + 2 for b in ctx.encode()] + [b + 2 for b in cont.encode()])[-(m.seq_len + 1) :]
        row = jnp.zeros((1, m.seq_len), jnp.int32).at[0, : len(ids) - 1].set(jnp.asarray(ids[:-1]))  # one shape
        hidden, _, _ = fwd(params, state, row)
        logp = jax.nn.log_softmax(logits_of(params, hidden)[0].astype(jnp.float32), axis=-1)
        n = len(cont.encode())
        want = sum(float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1 - n, len(ids) - 1))
        assert value == pytest.approx(want, abs=1e-4)
    assert np.isfinite(got).all()


@pytest.mark.slow  # over 10 s: `make test-all` (CI) runs it; make test measured 16:24 with it
def test_task_evals_in_the_loop_reach_metrics_summary_and_site(corpus, tmp_path, capsys):
    """train.task_evals: scored at every evaluation (the same as `moelab eval --tasks` on the same
    checkpoint), in the summary and as a plot per task on the site; a bad task is refused before a
    run folder exists."""
    from conftest import MICRO
    from moelab.config import load_config
    from moelab.report.plots import run_plots
    from moelab.runs import read_jsonl
    from moelab.train.loop import train
    from moelab.train.run_tasks import evaluate_retrieval, evaluate_tasks

    task = tmp_path / "mine.jsonl"
    task.write_text("\n".join(json.dumps(r) for r in [
        {"context": "def f(x):\n    return", "choices": [" x", " 1", " None"], "answer": 0},
        {"context": "import ", "choices": ["os", "zz"], "answer": 0},
        {"context": "for i in ", "continuation": "range(10):"},
    ]))  # fmt: skip
    gen = tmp_path / "gen.jsonl"  # generation tasks whose outcome turns on what the model writes, and two fixed ones
    gen.write_text("\n".join(json.dumps(r) for r in [
        *({"prompt": p, "regex": r, "stop": ["\n"]}
          for p, r in zip(("def ", "x = ", "import ", "class ", "# "), ("[aeiou]", r"^\)", "[0-9]", "def", "q"), strict=True)),
        {"prompt": "x = 1\n# ", "tests": "assert x == 1", "stop": ["\n"]},  # the completion: a comment
        {"prompt": "x = 1\n# ", "tests": "assert x == 2", "stop": ["\n"]},
    ]))  # fmt: skip
    sets = MICRO + [f"data.sources=[{corpus['code']}]", "train.steps=4", "train.eval_every=2", "model.seq_len=64"]
    bad = tmp_path / "bad-run"
    with pytest.raises(UsageError, match="train.task_evals: 'nosuch' is neither"):
        train(load_config("tiny", sets + ["train.task_evals=[nosuch]"]), bad, progress=False)
    assert not bad.exists()
    run = tmp_path / "run"
    summary = train(load_config("tiny", sets + [f"train.task_evals=[{task},{gen}]"]), run, progress=False)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(set(r["tasks"]) == {"mine", "gen"} for r in evals)
    # a generation task: the loop's pass@1 is `moelab eval`'s, completion for completion
    offline_gen = evaluate_tasks(run, [str(gen)], progress=False)["tasks"]["gen"]
    assert evals[-1]["tasks"]["gen"] == {"pass@1": offline_gen["pass@1"]}
    assert offline_gen["passed"]["gen/6"] == 1 and offline_gen["passed"]["gen/7"] == 0
    assert offline_gen["pass@1"] == sum(offline_gen["passed"].values()) / 7
    assert "task-gen" in dict(run_plots(run))
    # the command line: k samples at a temperature, pass@1 and pass@k (pass@k >= pass@1), printed and kept
    from moelab.cli import main

    assert main(["eval", str(run), "--tasks", str(gen), "--samples", "3", "--max-new-tokens", "8"]) == 0
    said = capsys.readouterr().out
    kept = json.loads((run / "evals" / "step_00000004-tasks.json").read_text())["tasks"]
    assert kept["gen"]["samples"] == 3
    line = next(x for x in said.splitlines() if x.strip().startswith("gen "))
    assert line.split()[1:] == ["7", f"{kept['gen']['pass@1']:.3f}", f"{kept['gen']['pass@3']:.3f}"]
    assert kept["gen"]["pass@3"] >= kept["gen"]["pass@1"]
    assert main(["eval", str(run), "--samples", "3"]) == 2  # a flag that does nothing alone: refused
    assert "--samples: only with --tasks; alone it changes nothing" in capsys.readouterr().err
    assert summary["final_tasks"] == evals[-1]["tasks"] and summary["first_tasks"] == evals[0]["tasks"]
    offline = evaluate_tasks(run, [str(task)], progress=False)["tasks"]["mine"]
    kept = json.loads((run / "evals" / "step_00000004-tasks.json").read_text())["tasks"]
    assert set(kept) == {"gen", "mine"}  # beside the task scored there before
    for k in ("acc", "acc_norm", "chance"):
        assert evals[-1]["tasks"]["mine"][k] == offline[k]
    assert evals[-1]["tasks"]["mine"]["bpb"] == pytest.approx(offline["bpb"], rel=1e-5)
    assert "task-mine" in dict(run_plots(run))
    from moelab.train.trackers import _flat  # what W&B and TensorBoard are given

    assert _flat(evals[-1])["tasks/mine/acc"] == evals[-1]["tasks"]["mine"]["acc"]
    # the retrieval task at the model's whole context, keys at both ends; past the context: one line
    got = evaluate_retrieval(run, [64], (0.0, 1.0), n=2, progress=False)
    assert set(got["acc"]) == {"64@0", "64@1"} and all(v in (0.0, 0.5, 1.0) for v in got["acc"].values())
    assert (run / "evals" / "step_00000004-retrieval.json").is_file()
    with pytest.raises(UsageError, match="--retrieval: 128 tokens; give lengths from 16 to the model's context, 64"):
        evaluate_retrieval(run, [128], progress=False)
