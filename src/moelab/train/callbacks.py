"""What the training loop does besides the update, as callbacks over its run state (``train.core``).

Each callback implements some of the hooks below; the loop calls every callback that has a hook,
in the order of its list (``default_callbacks``), at these points:

- ``on_start(loop)``: before the first step this process runs.
- ``before_step(loop, s)``: before step ``s``'s batch is made (a callback may raise to stop the run).
- ``before_update(loop, s)`` and ``after_update(loop, s, finite)``: around the compiled step alone.
- ``on_nonfinite(loop, s, metrics)``: the step's loss or gradient was not finite; a callback may
  return the step to go on from (the NaN guard, after restoring a checkpoint).
- ``on_restore(loop, at, to)``: the state was restored at step ``at`` to checkpoint ``to``.
- ``after_step(loop, done, metrics)``: after step ``done`` - 1 (``metrics`` None for a skipped batch).
- ``on_record(loop, rec)``: a metrics line was appended to metrics.jsonl (``loop.record``).
- ``after_eval(loop, done)``: the held-out evaluation after step ``done`` was recorded.
- ``on_end(loop)``: after the last step.
- ``close(loop, ended)``: always, last (``ended`` False when the run failed).

The order of ``default_callbacks``: the lease check, the test faults (MOELAB_TEST_FAULTS), Ctrl-C
and SIGTERM (``train.interrupt``: a checkpoint at the next step boundary, then exit 130), the NaN
guard, the step timer, the progress bar, the step's compile (beside the initial evaluation),
checkpoint events, the metrics log, the held-out evaluations, forecast refits, the trackers, the
health checks, then checkpoint saves; a user's own callbacks come last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

from moelab import schedule
from moelab.errors import RunError
from moelab.ladder import forecast as F
from moelab.ladder.law import LAWS
from moelab.monitor.health import HealthMonitor, ladder_from_forecast
from moelab.progress import Progress, phase, say
from moelab.runs import RunDir, append_jsonl, read_jsonl
from moelab.train import checkpoint
from moelab.train.interrupt import Interrupt

# testing aid: "kill@STEP,kill_in_save@STEP,stop@STEP,stop_in_save@STEP", each fires once per run; stop
# freezes the process (SIGSTOP) where kill ends it, for a test to wake it (SIGCONT) later. kill@ and stop@
# first let a background save in flight finish (a test names the checkpoints it expects, whatever the
# machine's speed); kill_in_save@ is the fault inside a save
FAULT_ENV = "MOELAB_TEST_FAULTS"


class Callback:
    """A callback's hooks do nothing unless it defines them (see the module's docstring)."""


class LeaseCheck(Callback):
    """``stop()``, asked before every step and after the last save: True ends the run (RunError) without
    writing more (the lab asks whether this runner still holds the step's lease)."""

    def __init__(self, stop):
        self.stop = stop

    def before_step(self, loop, s: int) -> None:
        if self.stop():
            raise RunError(f"stopped at step {s}: another runner holds this run now; nothing more is written")

    def on_end(self, loop) -> None:
        loop.rs.ckpts.wait()  # the last save complete; a runner that lost its lease meanwhile stops here
        self.before_step(loop, loop.rs.steps)


class TestFaults(Callback):
    """The MOELAB_TEST_FAULTS testing aid: the process kills (or freezes) itself at a step, or inside
    a checkpoint's save; each fires once per run (faults_fired.json in the run's folder)."""

    def __init__(self, run: RunDir, spec: str):
        self.faults = []
        for item in filter(None, (x.strip() for x in spec.split(","))):
            kind, _, at = item.partition("@")
            self.faults.append((kind, int(at)))
        self.fired_path = run.path / "faults_fired.json"

    @classmethod
    def from_env(cls, run: RunDir):
        spec = os.environ.get(FAULT_ENV, "")
        return cls(run, spec) if spec.strip() else None

    def hook(self, point: str, step: int, settle=None) -> None:
        fired = json.loads(self.fired_path.read_text()) if self.fired_path.exists() else []
        for kind, at in self.faults:
            kinds = {"step": ("kill", "stop"), "in_save": ("kill_in_save", "stop_in_save")}[point]
            if at == step and [kind, at] not in fired and kind in kinds:
                if settle is not None:
                    settle()
                fired.append([kind, at])
                self.fired_path.write_text(json.dumps(fired))
                os.kill(os.getpid(), signal.SIGSTOP if kind.startswith("stop") else signal.SIGKILL)

    def before_step(self, loop, s: int) -> None:
        self.hook("step", s, settle=loop.rs.ckpts.wait)


class NanGuard(Callback):
    """A non-finite step is skipped; ``train.nan_patience`` in a row restore the newest checkpoint and
    skip those batches; again before a new checkpoint stops the run. Its memory (``rs.guard``) is
    saved with every checkpoint."""

    def on_nonfinite(self, loop, s: int, metrics) -> int | None:
        rs = loop.rs
        cfg, run, guard = rs.cfg, rs.run, rs.guard
        guard["consecutive"] += 1
        run.event("nan_skip", step=s, loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]))
        if guard["consecutive"] < cfg.train.nan_patience:
            return None
        n_bad = guard["consecutive"]
        bad = [x for x in range(s, -1, -1) if x not in rs.skip][:n_bad][::-1]
        ckpts = rs.ckpts.steps()  # a save in flight is waited for: it may be the one to restore
        if guard["restored"] or not ckpts:
            why = "again after a restore" if guard["restored"] else "and there is no checkpoint to restore"
            raise RunError(
                f"NaN guard: {n_bad} non-finite steps in a row (steps {bad[0]}-{bad[-1]}) {why}; "
                f"stopping. Checkpoints and metrics are kept in {run.path}"
            )
        rs.state, meta = checkpoint.restore(run.ckpt, ckpts[-1], rs.state)
        rs.skip.update(bad)
        rs.skip.update(meta["skip_steps"])
        run.truncate_metrics(meta["metrics_cursor"])
        run.event("nan_restore", at_step=s, restored_step=ckpts[-1], skipping=bad)
        loop.emit("on_restore", s, ckpts[-1])
        guard.update(consecutive=0, restored=True)
        return ckpts[-1]

    def after_update(self, loop, s: int, finite: bool) -> None:
        if finite:
            loop.rs.guard["consecutive"] = 0


class StepTimer(Callback):
    """Seconds and steps since the last log line, the compiled step alone; a step that compiles its
    program (the first of a process, or of a new sequence length) is not timed."""

    def __init__(self):
        self.seconds, self.steps, self.warm, self.program, self.t0 = 0.0, 0, False, None, 0.0

    def before_update(self, loop, s: int) -> None:
        if loop.program is not self.program:
            self.program, self.warm = loop.program, False
        self.t0 = time.perf_counter()

    def after_update(self, loop, s: int, finite: bool) -> None:
        if self.warm:
            self.seconds += time.perf_counter() - self.t0
            self.steps += 1
        else:
            phase("steps")
        self.warm = True

    def take(self) -> tuple[float, int]:
        """(seconds, steps) since the last call."""
        out = (self.seconds, self.steps)
        self.seconds, self.steps = 0.0, 0
        return out


class ProgressBar(Callback):
    def __init__(self, progress: bool):
        self.enabled, self.bar = progress, None

    def on_start(self, loop) -> None:
        rs = loop.rs
        phase("compile")
        say(f"compiling the train step (step {rs.start + 1} waits for it; the XLA cache keeps it for reruns)",
            self.enabled)  # fmt: skip
        self.bar = Progress(rs.steps, rs.start, desc="train", unit="step", enabled=self.enabled)

    def after_step(self, loop, done: int, metrics) -> None:
        self.bar.update(1)

    def on_restore(self, loop, at: int, to: int) -> None:
        self.bar.update(to - (at + 1))

    def write(self, text: str) -> None:
        """A line under the bar, not through it (stderr before the bar exists)."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr)

    def on_end(self, loop) -> None:
        self.bar.close()


class StepPrecompile(Callback):
    """The train step compiled in a thread while the initial model is evaluated (the evaluator compiles
    and runs on the main thread beside it), so step 1 does not wait for it after the evaluation; the
    first update waits for the thread. jit's call reuses the executable the thread compiled. Not with
    fault injection (its step takes other arguments) nor when the run makes no initial evaluation."""

    def __init__(self):
        self.thread = None

    def on_start(self, loop) -> None:
        rs = loop.rs
        if rs.injection is not None or rs.start != 0 or rs.cursor_ok or rs.start >= rs.steps:
            return
        fn, batch = rs.at_length(rs.start)["step"], rs.batch(rs.start)

        def compile_step():
            try:
                fn.lower(rs.state, batch, np.int32(rs.start)).compile()
            except Exception:  # noqa: BLE001 - the first update compiles it again and raises the error itself
                pass

        self.thread = threading.Thread(target=compile_step, name="moelab-step-compile", daemon=True)
        self.thread.start()

    def before_update(self, loop, s: int) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def close(self, loop, ended: bool) -> None:
        self.before_update(loop, 0)  # a run failing before step 1: JAX compiling in a thread at exit aborts


class CheckpointEvents(Callback):
    """A background save that completed since the last step: its journal event (``checkpoint``)."""

    def after_step(self, loop, done: int, metrics) -> None:
        loop.rs.ckpts.poll()


class MetricsLog(Callback):
    """Every ``train.log_every`` steps and at the end: the step's metrics, speed and MFU as a ``train``
    line of metrics.jsonl (and so to the trackers and the health checks)."""

    def __init__(self, timer: StepTimer, bar: ProgressBar):
        self.timer, self.bar = timer, bar

    def after_step(self, loop, done: int, metrics) -> None:
        rs = loop.rs
        cfg = rs.cfg
        if metrics is None or not (done % cfg.train.log_every == 0 or done == rs.steps):
            return
        m = jax.device_get(metrics)
        t_sum, n = self.timer.take()
        tps = n * rs.b * rs.s_len / t_sum if n else float("nan")
        per_device = tps / rs.n_devices
        flops = loop.flops_per_token
        extra = {
            "tokens_per_s": tps,
            "tokens_per_s_per_device": per_device,
            "flops_per_s_per_device": per_device * flops,
            "step_time": t_sum / n if n else float("nan"),
            "mfu": per_device * flops / rs.peak if rs.peak else float("nan"),
            "phase": rs.mixture.phase_at(done - 1),
            # passes over each domain's training windows so far (a shuffled pass per epoch, counted exactly)
            "epochs": rs.epochs_at(done),
        }
        rec = {"kind": "train", "step": done, "tokens": done * cfg.train.batch_size * cfg.model.seq_len}
        rec.update({k: v for k, v in m.items() if k != "finite"})
        rec.update(extra)
        loop.record(rec)
        self.bar.bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{tps:,.0f}")


class Evaluations(Callback):
    """The held-out evaluation (and train.task_evals) at the initial model and at every eval point."""

    def __init__(self, progress: bool):
        self.progress = progress

    def on_start(self, loop) -> None:
        if loop.rs.start == 0 and not loop.rs.cursor_ok:
            phase("initial eval")
            say("evaluating the initial model on the held-out windows", self.progress)
            loop.evaluate(0)

    def after_step(self, loop, done: int, metrics) -> None:
        if done in loop.rs.evals:
            phase("final eval" if done == loop.rs.steps else "eval")
            loop.evaluate(done)


class ForecastRefits(Callback):
    """Refits of a run's registered joint-law forecast with the run's own evaluations so far, every
    ``train.forecast_update_every`` of the run: each is appended to forecast_updates.jsonl and is an
    event (and goes to ``callback``); forecast.json, which the health checks and verdict use, stays."""

    def __init__(self, run: RunDir, forecast: dict | None, cfg, callback, progress: bool):
        self.run, self.forecast, self.callback, self.progress = run, forecast, callback, progress
        self.every = cfg.train.forecast_update_every * cfg.train.steps
        self.on = bool(forecast and self.every > 0 and forecast.get("rungs") and forecast.get("law") in LAWS)
        self.path = run.path / "forecast_updates.jsonl"
        self.done = {u["at_step"] for u in read_jsonl(self.path)} if self.on else set()
        self.rungs = None

    def after_eval(self, loop, step: int) -> None:
        if not self.on or step == 0 or step in self.done:
            return
        if self.done and step < max(self.done) + self.every - 0.5:
            return
        try:
            agg = self.forecast.get("metric", "macro")  # what the registered forecast is of
            if self.rungs is None:
                self.rungs = [F.rung_run(d, agg=agg) for d in self.forecast["rungs"]]
            upd = F.update_forecast(self.forecast, F.rung_run(self.run.path, agg=agg), self.rungs)
        except (F.ForecastError, ValueError, OSError) as exc:  # the rungs moved away: say so once, go on
            self.on = False
            self.run.event("forecast_update_off", step=step, why=str(exc))
            return
        if upd is None:
            return
        self.done.add(step)
        append_jsonl(self.path, {"time": time.time(), **upd})
        fin = upd["final"]
        self.run.event("forecast_update", step=step, law=upd["law"], final=fin)
        say(
            f"forecast update at step {step}: final held-out loss {fin['loss']:.4f} "
            f"[{fin['low']:.4f}, {fin['high']:.4f}] (registered: {self.forecast['loss'][-1]:.4f})",
            self.progress,
        )
        if self.callback is not None:
            self.callback(upd)


class Health(Callback):
    """The health checks (``monitor.health``) on every metrics line: a changed level is an event, an
    ALERT is also printed under the progress bar."""

    def __init__(self, rs, bar: ProgressBar):
        self.bar = bar
        steps, plan = rs.steps, rs.lr_plan
        self.monitor = HealthMonitor(
            lr_at=lambda step: plan[min(step, steps - 1)],
            forecast=rs.forecast,
            ladder=ladder_from_forecast(rs.forecast),  # the rungs the forecast came from, when at hand
            steps=steps,
        )
        self.monitor.reset(read_jsonl(rs.run.metrics))  # what survived of the metrics

    def on_record(self, loop, rec: dict) -> None:
        for f in self.monitor.update(rec):
            if f.first and f.level == "OK":
                continue  # only changes of level are events
            loop.rs.run.event("health", check=f.check, level=f.level, step=f.step, evidence=f.evidence)
            if f.level == "ALERT":
                self.bar.write(f"moelab: ALERT at step {f.step}: {f.check}: {f.evidence}")

    def on_restore(self, loop, at: int, to: int) -> None:
        self.monitor.reset(read_jsonl(loop.rs.run.metrics))


class Trackers(Callback):
    """W&B, TensorBoard or a JSON-lines file (``train.trackers``): every metrics line; closed at the end."""

    def __init__(self, trackers):
        self.trackers = trackers

    def on_record(self, loop, rec: dict) -> None:
        for t in self.trackers:
            t.log(rec)

    def close(self, loop, ended: bool) -> None:
        for t in self.trackers:
            t.close()


class Checkpointer(Callback):
    """Every ``train.checkpoint_every`` steps, at ``train.keep_steps`` and at the end: a checkpoint (in
    the background with ``train.async_checkpoint``); the last one complete before the run ends.

    The first save that completes before the run's end is measured: what it cost the run (the time the
    loop waited for it, and the extra time of the steps taken while it was in flight, against the
    median step without one), said once with Young/Daly's interval for ``train.failure_hours``, and
    kept as a ``checkpoint_cost`` event."""

    def __init__(self, progress: bool = True):
        self.progress = progress
        self.clean, self.flight = [], []  # step seconds without and with a save in flight (none compiling)
        self.cost = None  # the save measured: {"step", "blocked"}, then done
        self.program, self.t0, self.busy = None, 0.0, False

    def before_update(self, loop, s: int) -> None:
        self.busy, self.t0 = loop.rs.ckpts.saving(), time.perf_counter()

    def after_update(self, loop, s: int, finite: bool) -> None:
        if loop.program is not self.program:  # a step that compiled its program: not timed
            self.program = loop.program
            return
        (self.flight if self.busy else self.clean).append(time.perf_counter() - self.t0)

    def after_step(self, loop, done: int, metrics) -> None:
        rs = loop.rs
        t = rs.cfg.train
        if self.cost is not None and "said" not in self.cost and not rs.ckpts.saving():
            self._say(rs)
        if done % t.checkpoint_every == 0 or done == rs.steps or done in t.keep_steps:
            # a new checkpoint is a new place to restore to: the guard may restore again, and the
            # checkpoint says so, or a run resumed from it would stop where this one restores
            rs.guard["restored"] = False
            phase("checkpoint")
            self._settle(rs)  # the measured save still in flight: the loop waits for it here
            t0 = time.perf_counter()
            rs.save(done)
            if self.cost is None and done < rs.steps and self.clean:
                self.cost, self.flight = {"step": done, "blocked": time.perf_counter() - t0}, []
                if not rs.ckpts.saving():  # saved in the foreground: complete already
                    self._say(rs)

    def _say(self, rs) -> None:
        """The measured save's cost, once: said, and kept as an event."""
        c, t = self.cost, rs.cfg.train
        step_s = float(sorted(self.clean)[len(self.clean) // 2])
        extra = sum(max(x - step_s, 0.0) for x in self.flight)
        c.update(said=True, save_s=c["blocked"] + extra, extra=extra, step_s=step_s, in_flight=len(self.flight))
        how = (f"in the background: {c['blocked']:.2f} s blocked, {extra:.2f} s of slower steps ({len(self.flight)} "
               "in flight)" if t.async_checkpoint else "the loop waited for it")  # fmt: skip
        text = f"checkpoint at step {c['step']}: the save cost the run {c['save_s']:.2f} s ({how}); a step takes {step_s:.2f} s"
        event = {"step": c["step"], "save_s": c["save_s"], "blocked_s": c["blocked"], "extra_s": extra,
                 "steps_in_flight": len(self.flight), "step_s": step_s, "background": bool(t.async_checkpoint)}  # fmt: skip
        if t.failure_hours > 0:
            best = schedule.checkpoint_interval(c["save_s"], t.failure_hours * 3600)
            steps = max(1, round(best / step_s))
            text += (f"; for a failure every {t.failure_hours:g} h, Young/Daly's interval is {steps:,} steps "
                     f"({best / 60:.1f} min; train.checkpoint_every is {t.checkpoint_every:,})")  # fmt: skip
            event.update(failure_hours=t.failure_hours, interval_s=best, interval_steps=steps)
        say(text, self.progress)
        rs.run.event("checkpoint_cost", **event)

    def on_end(self, loop) -> None:
        self._settle(loop.rs)
        loop.rs.ckpts.wait()  # the run never ends with a save in flight

    def _settle(self, rs) -> None:
        """The measured save, if still in flight: waited for, the wait counted in its cost, and said."""
        if self.cost is not None and "said" not in self.cost:
            t0 = time.perf_counter()
            rs.ckpts.wait()
            self.cost["blocked"] += time.perf_counter() - t0
            self._say(rs)

    def close(self, loop, ended: bool) -> None:
        if not ended:
            loop.rs.ckpts.abandon()  # a failing run still waits for a save in flight; its own error is raised


def default_callbacks(rs, *, progress: bool, trackers=(), stop=None, on_forecast_update=None, test_faults=None):
    """The loop's callbacks, in their order (the module's docstring)."""
    timer, bar = StepTimer(), ProgressBar(progress)
    lease = [LeaseCheck(stop)] if stop is not None else []
    faults = [test_faults] if test_faults is not None else []
    return [
        *lease,
        *faults,
        Interrupt(),
        NanGuard(),
        timer,
        bar,
        StepPrecompile(),
        CheckpointEvents(),
        MetricsLog(timer, bar),
        Evaluations(progress),
        ForecastRefits(rs.run, rs.forecast, rs.cfg, on_forecast_update, progress),
        Trackers(trackers),
        Health(rs, bar),
        Checkpointer(progress),
    ]
