"""The training loop as a core with callbacks (docs/architecture.md): the hooks a callback gets, in
the documented order; the loop's own callbacks in theirs; fault injection outside the production step."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import MICRO
from moelab.config import load_config
from moelab.runs import read_jsonl
from moelab.train import callbacks as C
from moelab.train import optim
from moelab.train.loop import train
from moelab.train.step import init_train_state, make_train_step


class Hooks:
    """Every hook, as (name, step) in the order the loop called it."""

    def __init__(self):
        self.calls, self.losses, self.injection = [], [], "unset"

    def on_start(self, loop):
        self.calls.append(("on_start", loop.rs.start))
        self.injection = loop.rs.injection

    def before_step(self, loop, s):
        self.calls.append(("before_step", s))

    def before_update(self, loop, s):
        self.calls.append(("before_update", s))

    def after_update(self, loop, s, finite):
        self.calls.append(("after_update", s))

    def on_nonfinite(self, loop, s, metrics):
        self.calls.append(("on_nonfinite", s))

    def after_step(self, loop, done, metrics):
        self.calls.append(("after_step", done))

    def on_record(self, loop, rec):
        self.calls.append((f"record_{rec['kind']}", rec["step"]))
        if rec["kind"] == "train":
            self.losses.append(rec["loss"])

    def after_eval(self, loop, done):
        self.calls.append(("after_eval", done))

    def on_end(self, loop):
        self.calls.append(("on_end", loop.rs.steps))

    def close(self, loop, ended):
        self.calls.append(("close", ended))


def _cfg(corpus, *more):
    return load_config("tiny", [*MICRO, f"data.sources=[{corpus['code']}]", "train.steps=4", "train.eval_every=2",
                                "train.checkpoint_every=2", *more])  # fmt: skip


def test_a_callback_gets_every_hook_in_the_documented_order(corpus, tmp_path):
    hooks = Hooks()
    train(_cfg(corpus), tmp_path / "run", progress=False, callbacks=[hooks])
    step = lambda s: [("before_step", s), ("before_update", s), ("after_update", s)]  # noqa: E731
    evaluated = lambda d: [("record_eval", d), ("after_eval", d)]  # noqa: E731
    want = [("on_start", 0)]
    for s in range(4):
        done = s + 1
        want += step(s) + [("record_train", done)]  # the metrics line, logged every step (MICRO)
        want += evaluated(done) if done % 2 == 0 else []
        want += [("after_step", done)]
    want += [("on_end", 4), ("close", True)]
    # the initial evaluation comes first: recorded before a user's on_start (the loop's own run first)
    assert hooks.calls == evaluated(0) + want
    # what the callback saw is what the run wrote
    assert hooks.losses == [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert hooks.injection is None  # no faults asked: the production step, no injection around it


def test_a_failing_run_closes_its_callbacks_with_ended_false(corpus, tmp_path):
    hooks = Hooks()
    cfg = _cfg(corpus, "train.poison_steps=[1, 2, 3]", "train.nan_patience=2", "train.checkpoint_every=10")
    with pytest.raises(Exception, match="NaN guard"):
        train(cfg, tmp_path / "run", progress=False, callbacks=[hooks])
    assert ("on_nonfinite", 1) in hooks.calls and hooks.calls[-1] == ("close", False)
    assert hooks.injection is not None  # poison steps: the injection wraps the update
    events = [json.loads(x)["event"] for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1] == "failure"


def test_the_loops_own_callbacks_in_their_order(corpus, tmp_path):
    class Probe:
        def on_start(self, loop):
            self.names = [type(c).__name__ for c in loop.callbacks]

    probe = Probe()
    train(_cfg(corpus, "train.steps=1"), tmp_path / "run", progress=False, stop=lambda: False, callbacks=[probe])
    assert probe.names == ["LeaseCheck", "Interrupt", "NanGuard", "StepTimer", "ProgressBar", "StepPrecompile", "CheckpointEvents",
                           "MetricsLog",
                           "Evaluations", "ForecastRefits", "Trackers", "Health", "Checkpointer", "Probe"]  # fmt: skip
    assert C.FAULT_ENV == "MOELAB_TEST_FAULTS"


def test_the_step_compiles_beside_the_initial_eval_and_step_1_compiles_nothing(corpus, tmp_path, monkeypatch):
    """StepPrecompile: the step is traced and compiled in its own thread while the initial model is
    evaluated; the first update (main thread) then neither traces nor compiles anything (jit's call
    reuses the thread's executable), and the run's losses are those of a run without the thread."""
    import threading

    import jax.monitoring

    seen = []  # ("update", s) markers and (event, thread) of every trace/compile JAX reports

    def listen(event, duration, **kw):
        if "compile" in event or "trace" in event:
            seen.append((event, threading.current_thread().name))

    class Window:
        def before_update(self, loop, s):
            seen.append(("before_update", s))

        def after_update(self, loop, s, finite):
            seen.append(("after_update", s))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        cfg = _cfg(corpus, "train.steps=2", "train.seed=11")
        train(cfg, tmp_path / "run", progress=False, callbacks=[Window()])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    first = seen.index(("before_update", 0))
    in_thread = [e for e, who in seen[:first] if who == "moelab-step-compile"]
    assert any("trace" in e for e in in_thread), seen[:first]  # the step was traced (and lowered) there
    assert seen[first + 1] == ("after_update", 0), seen[first:]  # nothing traced or compiled at step 1

    # without the thread (the step compiled at step 1, as before): the same losses, to the bit
    plain = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    monkeypatch.setattr(C.StepPrecompile, "on_start", lambda self, loop: None)
    train(cfg, tmp_path / "run2", progress=False)
    again = [r["loss"] for r in read_jsonl(tmp_path / "run2" / "metrics.jsonl") if r["kind"] == "train"]
    assert plain == again


def test_the_production_step_takes_no_fault_arguments():
    cfg = load_config("tiny", MICRO)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 512))
    plain, faulted = make_train_step(cfg, opt, h), make_train_step(cfg, opt, h, faults=True)
    none = {"lr_scale": np.float32(1), "logit_z_scale": np.float32(1), "freeze_bias": np.bool_(False),
            "poison": np.bool_(False)}  # fmt: skip
    with pytest.raises(TypeError):
        plain(init_train_state(cfg, opt), batch, np.int32(0), none)
    a, ma = plain(init_train_state(cfg, opt), batch, np.int32(0))
    b, mb = faulted(init_train_state(cfg, opt), batch, np.int32(0), none)
    # faults that change nothing: the same numbers as the production step, to the bit
    assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
