"""Results kept in the cache for the command run again (moelab.cache.remember): the fit check's
verdict and the initial model's evaluation, answered only for the same config, code and machine."""

from __future__ import annotations

import json

import pytest

from conftest import MICRO
from moelab import cache
from moelab.cache import remember, remembered
from moelab.config import load_config, resolve_dtype
from moelab.plan import memory
from moelab.runs import read_jsonl
from moelab.train import evaluate
from moelab.train.loop import train


def test_a_result_is_answered_for_its_key_code_and_settings_only(monkeypatch, tmp_path):
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path))
    key = {"config": {"seed": 0}, "store": "abc"}
    assert remembered("k", key) is None
    remember("k", key, {"loss": {"macro": 1.25, "x": float("nan")}})
    got = remembered("k", key)
    assert got["loss"]["macro"] == 1.25 and got["loss"]["x"] != got["loss"]["x"]  # NaN comes back as NaN
    assert remembered("k", {**key, "store": "abd"}) is None  # another key
    assert remembered("other", key) is None  # another computation
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")  # XLA set otherwise: may compute otherwise
    assert remembered("k", key) is None
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(cache, "code_fingerprint", lambda: "edited")  # moelab's code edited
    assert remembered("k", key) is None
    monkeypatch.undo()
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path))
    [path] = (tmp_path / "memo" / "k").iterdir()
    path.write_text(path.read_text()[:-5])  # a file cut short is no answer
    assert remembered("k", key) is None


def test_a_plan_that_fits_is_traced_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MOELAB_CACHE", str(tmp_path))
    monkeypatch.delenv("MOELAB_NO_FIT_CHECK", raising=False)
    calls = []
    real = memory.plan
    monkeypatch.setattr(memory, "plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = resolve_dtype(load_config("tiny", MICRO))
    memory.fit_check(cfg)
    memory.fit_check(cfg)
    assert len(calls) == 1  # (another config, code or machine is another key: the test above)


@pytest.mark.slow  # three short runs: a minute on 2 busy cores
def test_the_initial_evaluation_of_the_same_config_is_the_one_computed(corpus, monkeypatch, tmp_path):
    # (a field no other test sets: nothing in the session cache answers the first run)
    sets = [*MICRO, f"data.sources=[{corpus['code']}]", "train.steps=1", "train.eval_every=1",
            "train.tracker_project=test-memo"]  # fmt: skip
    calls = []
    real = evaluate.Evaluator.__call__
    monkeypatch.setattr(evaluate.Evaluator, "__call__", lambda self, *a: calls.append(1) or real(self, *a))

    def evals(name: str, *extra: str) -> list[dict]:
        calls.clear()
        train(load_config("tiny", [*sets, *extra]), tmp_path / name, progress=False)
        recs = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "eval"]
        return [{k: v for k, v in r.items() if k != "eval_seconds"} for r in recs]

    first = evals("first")
    assert len(calls) == 2  # steps 0 and 1
    again = evals("again")
    assert len(calls) == 1  # step 1 only: step 0's from the cache ...
    assert json.dumps(again) == json.dumps(first)  # ... the same record, to the last bit
    other = evals("seed1", "train.seed=1")  # another initial model: computed
    assert len(calls) == 2 and other[0]["loss"] != first[0]["loss"]
