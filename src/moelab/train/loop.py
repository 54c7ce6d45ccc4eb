"""The training loop: data, step, metrics, evals, checkpoints, the NaN guard and exact resume.

Batches are a pure function of (seed, step), the state is checkpointed with the metrics cursor,
so a run resumed from a checkpoint writes exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from moelab import accounting
from moelab.cache import cached_matmul_peak, enable_compile_cache, remember, remembered
from moelab.config import (
    Config,
    config_hash,
    data_seed,
    phase_config,
    phase_seq_lens,
    resolve_dtype,
    rope_scaling_of,
    to_dict,
)
from moelab.data.mixture import batch_at, batch_rows, build_mixture, epochs_at
from moelab.data.store import build_store
from moelab.errors import ConfigError, RunError, RunRefused  # noqa: F401 - raised here, importable from here
from moelab.monitor.faults import Injector
from moelab.monitor.health import HealthMonitor, ladder_from_forecast
from moelab.monitor.reference import reference_factors
from moelab.parallel import mesh as pmesh
from moelab.progress import Progress, phase, say
from moelab.runs import RunDir, append_jsonl, git_state, host, load_run_config, read_jsonl, versions
from moelab.schedule import eval_points  # noqa: F401 - importable from here
from moelab.train import checkpoint, optim
from moelab.train.evaluate import Evaluator
from moelab.train.step import init_train_state, make_train_step, offload_state

# testing aid: "kill@STEP,kill_in_save@STEP,stop@STEP,stop_in_save@STEP", each fires once per run; stop
# freezes the process (SIGSTOP) where kill ends it, for a test to wake it (SIGCONT) later
FAULT_ENV = "MOELAB_TEST_FAULTS"


def _fault_hook(run: RunDir):
    spec = os.environ.get(FAULT_ENV, "")
    faults = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        kind, _, at = item.partition("@")
        faults.append((kind, int(at)))
    if not faults:
        return None
    fired_path = run.path / "faults_fired.json"

    def hook(point: str, step: int) -> None:
        fired = json.loads(fired_path.read_text()) if fired_path.exists() else []
        for kind, at in faults:
            kinds = {"step": ("kill", "stop"), "in_save": ("kill_in_save", "stop_in_save")}[point]
            if at == step and [kind, at] not in fired and kind in kinds:
                fired.append([kind, at])
                fired_path.write_text(json.dumps(fired))
                os.kill(os.getpid(), signal.SIGSTOP if kind.startswith("stop") else signal.SIGKILL)

    return hook


# fields a resume may change: where and how the same run is computed, not what it computes
PLACEMENT = {"mesh.data", "mesh.expert", "mesh.fsdp", "train.micro_batch", "train.offload", "train.async_checkpoint"}


def _check_resume(run: RunDir, cfg: Config | None, resume: bool) -> Config:
    """The config to run: ``cfg``, or the run's own when resuming (with ``cfg`` None, or when the
    run was re-planned and ``cfg`` differs from it only in its horizon)."""
    if not run.config.exists():
        if cfg is None:
            raise RunRefused(f"{run.path}: no config.json to resume from; give a config")
        return cfg
    if not resume:
        raise RunRefused(f"{run.path}: already holds a run; pass --resume to continue it, or choose another --out")
    ours = load_run_config(run.path)  # refuses a config.json that is not one, in one line
    saved = json.loads(run.config.read_text())
    if cfg is None or saved["hash"] == config_hash(cfg):
        return ours
    old, new = saved["config"], json.loads(json.dumps(to_dict(cfg)))  # tuples as the file's lists
    diff = [f"{s}.{k}" for s in new if isinstance(new[s], dict) for k in new[s] if old.get(s, {}).get(k) != new[s][k]]
    if ours.train.replans and set(diff) <= {"train.steps", "train.replans"}:
        return ours  # `moelab replan` changed the horizon: the run follows its new plan
    if set(diff) <= PLACEMENT:
        # a placement, not a change of the run: resume on another mesh, with other micro-batches, offload or
        # checkpoint saving (what fits the machines it now runs on), and record it
        _mesh(cfg)  # refused before the record changes
        run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
        if set(diff) & {"mesh.data", "mesh.expert", "mesh.fsdp"}:
            run.event("mesh_change", before=old["mesh"], after=new["mesh"])
        if rest := sorted(set(diff) - {"mesh.data", "mesh.expert", "mesh.fsdp"}):
            sec = lambda d, k: d.get(k.split(".")[0], {}).get(k.split(".")[1])  # noqa: E731
            run.event("placement_change", before={k: sec(old, k) for k in rest}, after={k: sec(new, k) for k in rest})
        return cfg
    raise RunRefused(
        f"{run.path}: the config differs from the run's ({', '.join(diff) or 'name'}); resume with the same config"
    )


def _finished(run: RunDir, cfg: Config | None) -> dict | None:
    """A finished run's summary (its newest checkpoint at its planned horizon, summary.json written),
    said in one line; None when the run has more to do, or when ``cfg`` is not the run's own (which
    ``_check_resume`` then judges). Resuming a finished run writes nothing."""
    if not (run.summary.is_file() and run.config.is_file()):
        return None
    try:
        saved_hash = json.loads(run.config.read_text()).get("hash")
        planned = load_run_config(run.path).train.steps
    except (ValueError, AttributeError, RunRefused):
        return None  # not a config.json: _check_resume says so in one line
    if cfg is not None and saved_hash != config_hash(cfg):
        return None
    saved = checkpoint.steps(run.ckpt)
    if not saved or saved[-1] < planned:
        return None
    try:
        summary = json.loads(run.summary.read_text())
    except ValueError:
        return None  # a summary cut short: the run finishes again and rewrites it
    say(f"{run.path}: the run is finished (step {saved[-1]} of {planned}); nothing was trained or written. "
        "To train it further, re-plan its horizon first (moelab replan)", True)  # fmt: skip
    return summary


def _mesh(cfg: Config):
    """The (data, expert) mesh when the config asks for more than one device, else None."""
    if cfg.mesh.data * cfg.mesh.expert == 1:
        return None
    try:
        return pmesh.make_mesh(cfg.mesh, cfg.model.n_routed)
    except pmesh.MeshError as exc:
        raise RunRefused(str(exc)) from None


class ForecastUpdates:
    """Refits of a run's registered joint-law forecast with the run's own evaluations so far, every
    ``train.forecast_update_every`` of the run: each is appended to forecast_updates.jsonl and is an
    event (and goes to ``callback``); forecast.json, which the health checks and verdict use, stays."""

    def __init__(self, run: RunDir, forecast: dict | None, cfg: Config, callback, progress: bool):
        self.run, self.forecast, self.callback, self.progress = run, forecast, callback, progress
        self.every = cfg.train.forecast_update_every * cfg.train.steps
        self.on = bool(forecast and self.every > 0 and forecast.get("rungs"))
        if self.on:  # (the laws load scipy, a second of a short run's start, only for a run held to a forecast)
            from moelab.ladder.law import LAWS

            self.on = forecast.get("law") in LAWS
        self.path = run.path / "forecast_updates.jsonl"
        self.done = {u["at_step"] for u in read_jsonl(self.path)} if self.on else set()
        self.rungs = None

    def after_eval(self, step: int) -> None:
        if not self.on or step == 0 or step in self.done:
            return
        if self.done and step < max(self.done) + self.every - 0.5:
            return
        from moelab.ladder.forecast import ForecastError, rung_run, update_forecast

        try:
            agg = self.forecast.get("metric", "macro")  # what the registered forecast is of
            if self.rungs is None:
                self.rungs = [rung_run(d, agg=agg) for d in self.forecast["rungs"]]
            upd = update_forecast(self.forecast, rung_run(self.run.path, agg=agg), self.rungs)
        except (ForecastError, ValueError, OSError) as exc:  # the rungs moved away: say so once, go on
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


def _train_record(done: int, cfg: Config, m: dict, extra: dict) -> dict:
    rec = {"kind": "train", "step": done, "tokens": done * cfg.train.batch_size * cfg.model.seq_len}
    rec.update({k: v for k, v in m.items() if k != "finite"})
    rec.update(extra)
    return rec


def train(
    cfg: Config | None,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    trackers=(),
    on_forecast_update=None,
    stop=None,
) -> dict:
    """Train ``cfg`` into ``out``; returns the summary (also written to summary.json).

    With ``resume``, ``cfg`` may be None: the run's own config.json is used (as re-planned).
    ``on_forecast_update(update)`` is called with each refit of the run's forecast (see
    ``train.forecast_update_every``), after it is written to forecast_updates.jsonl. ``stop()``,
    asked before every step, ends the run (RunError) without writing more when it says so: the lab
    asks whether this runner still holds the step's lease.

    The phases, in order: check what was asked, prepare the data, build or restore the state,
    launch (the record of what runs, the forecast and learning-rate plan it is held to, the health
    monitor), the step loop, the summary."""
    phase("store check")
    run = RunDir(out)
    if cfg is not None:  # compute_dtype auto: what runs here is what the run records and hashes
        cfg = resolve_dtype(cfg)
    if jax.process_index() > 0:  # one writer: the others keep their records apart and share ckpt/
        run = RunDir(Path(out) / f".process-{jax.process_index()}")
        run.ckpt = Path(out) / "ckpt"
    if resume and (done := _finished(run, cfg)) is not None:
        for t in trackers:
            t.close()
        return done
    cfg = _check_resume(run, cfg, resume)
    from moelab.model.transformer import backend_problems

    if problems := cfg.check_vocab() + backend_problems(cfg.model):
        raise ConfigError(problems)
    job = _Job(cfg, run, _mesh(cfg), progress, trackers)  # a bad mesh is refused before anything is written
    job.task_sets = _task_sets(cfg)  # a task file that is not one is refused before anything is written
    job.prepare_data()
    job.build_or_restore(resume)
    job.launch(on_forecast_update)
    ended = False
    try:
        job.step_loop(stop)
        ended = True
    except RunError as exc:
        run.event("failure", error=str(exc))
        raise
    except BaseException as exc:
        run.event("failure", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        raise
    finally:
        pmesh.set_active(None)
        for t in trackers:
            t.close()
        if not ended:
            job.ckpts.abandon()  # a failing run still waits for a save in flight; its own error is the one raised
    return job.finish()


def _task_sets(cfg: Config) -> dict:
    """train.task_evals' examples, ``train.task_eval_examples`` of each evenly spread over its file (the
    same ones at every evaluation); a run holding out less than the built-in tasks' documents is told so."""
    if not cfg.train.task_evals:
        return {}
    from moelab.eval.builtin import BUILTIN, builtin_task
    from moelab.eval.tasks import load_tasks

    every = load_tasks(cfg.train.task_evals, "train.task_evals")
    if set(cfg.train.task_evals) & set(BUILTIN):  # made from documents held out at the manifest's fraction
        made = json.loads((builtin_task(BUILTIN[0]).parent / "tasks.json").read_text())["held_out_fraction"]
        if cfg.data.held_out_fraction < made:
            say(f"note: the built-in tasks come from documents held out at data.held_out_fraction {made:g}; "
                f"this run holds out {cfg.data.held_out_fraction:g}, so it may train on some of them", True)  # fmt: skip
    n = cfg.train.task_eval_examples
    return {k: [v[i] for i in np.linspace(0, len(v) - 1, n).round().astype(int)] if 0 < n < len(v) else v
            for k, v in every.items()}  # fmt: skip


def _check_fault_domains(cfg: Config) -> None:
    """A fault that names a domain (data_corruption@S:D) is refused before the store is built, not after."""
    from moelab.data.store import resolve_all
    from moelab.monitor.faults import Injector, parse

    try:
        if any(f.kind == "data_corruption" and f.arg for f in map(parse, cfg.train.inject)):
            Injector(cfg.train.inject, [d.name for d in resolve_all(cfg.data)[0]])
    except ValueError as exc:
        raise RunRefused(str(exc)) from None


class _Job:
    """One training process's run, phase by phase (see ``train``)."""

    def __init__(self, cfg: Config, run: RunDir, mesh, progress: bool, trackers):
        self.cfg, self.run, self.mesh, self.progress, self.trackers = cfg, run, mesh, progress, trackers
        # the batch: b sequences of s_len tokens (a phase of shorter sequences holds more of them)
        self.steps, self.b, self.s_len = cfg.train.steps, cfg.train.batch_size, cfg.model.seq_len
        self.lens = phase_seq_lens(cfg)
        self.by_len: dict[int, dict] = {}  # per sequence length: its phase config, step, evaluator, FLOPs

    # ------------------------------------------------------------------ phases

    def prepare_data(self) -> None:
        """The token store (built once, cached) and the mixture; the run's config.json."""
        cfg = self.cfg
        enable_compile_cache()
        _check_fault_domains(cfg)
        self.store = build_store(cfg.data, cfg.model.vocab_size, progress=self.progress)
        self.mixture = build_mixture(cfg, self.store)
        self.run.path.mkdir(parents=True, exist_ok=True)
        if not self.run.config.exists():
            self.run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
        tokenizer = self.run.path / "tokenizer.json"  # the run's own, for `moelab sample` and `moelab export`
        if not tokenizer.exists() and (self.store.path / "tokenizer.json").exists():
            shutil.copyfile(self.store.path / "tokenizer.json", tokenizer)

    def build_or_restore(self, resume: bool) -> None:
        """A fresh state, or the newest complete checkpoint's (with the data position, the NaN guard's
        memory and the metrics cut back to its cursor)."""
        cfg, run = self.cfg, self.run
        phase("state")
        say("building the model and optimiser state" + (" (or restoring the newest checkpoint)" if resume else ""),
            self.progress)  # fmt: skip
        self.h = optim.hyper(cfg)
        self.opt = optim.make_optimizer(cfg, self.h)
        self.state = init_train_state(cfg, self.opt)
        if self.mesh is not None:  # by the rules table: FSDP over `data`, experts also over `expert`
            self.state = pmesh.shard_tree(self.state, self.mesh, cfg.mesh.fsdp)
        self.state = offload_state(self.state, cfg)  # train.offload: the optimizer state in host memory
        self.start, self.skip, self.cursor_ok = 0, set(), False
        # the NaN guard's memory: non-finite steps in a row, and whether it restored since the last checkpoint
        self.guard = {"consecutive": 0, "restored": False}
        t = cfg.train
        if t.checkpoint_dir:  # any path Orbax's file layer takes (gs://...); the run's ckpt/ otherwise
            run.ckpt = checkpoint.as_path(t.checkpoint_dir)
        saved = checkpoint.steps(run.ckpt)

        def damaged(step: int, reason: str) -> None:
            say(f"{run.ckpt}/step_{step:08d}: the checkpoint is damaged ({reason}); falling back to an older one", True)
            run.event("checkpoint_damaged", step=step, reason=reason)
            where = run.ckpt / f"step_{step:08d}"
            if where.exists() and jax.process_index() == 0:  # kept for a look, never loaded again
                where.rename(where.with_name(where.name + ".damaged"))

        found = checkpoint.restore_newest(run.ckpt, self.state, damaged) if resume and saved else None
        self.fresh = found is None  # the state is the config's initial one
        if resume and saved and found is None:
            raise RunError(f"{run.ckpt}: none of its {len(saved)} checkpoints restores; the run cannot resume")
        # the journal's checkpoint event is written once a checkpoint is complete (a background save's later)
        self.ckpts = checkpoint.Checkpoints(run.ckpt, t.keep_last, t.keep_every, t.keep_steps, t.async_checkpoint,
                                            lambda info: run.event("checkpoint", **info), _fault_hook(run))  # fmt: skip
        if found is not None:
            self.state, meta, step = found
            self.start, self.skip = meta["step"], set(meta["skip_steps"])
            self.guard.update(meta.get("nan_guard", {}))
            run.truncate_metrics(meta["metrics_cursor"])
            self.cursor_ok = True
            run.event("resume", step=self.start, checkpoint=step)
        elif resume and run.metrics.exists():
            run.truncate_metrics(0)  # nothing was checkpointed: start again from the beginning
            run.event("resume", step=0, checkpoint=None)

    def launch(self, on_forecast_update) -> None:
        """The launch event, the step and the evaluator, the forecast and learning-rate plan the run
        is held to, and the health monitor (which first re-reads what survived of the metrics)."""
        cfg, run, store, steps = self.cfg, self.run, self.store, self.steps
        phase("launch")
        run.event(
            "launch",
            config_hash=config_hash(cfg),
            git=git_state(),
            versions=versions(),
            host=host(),
            devices=[str(d) for d in jax.devices()],
            mesh=None if self.mesh is None else {k: int(v) for k, v in self.mesh.shape.items()},  # what the run used
            # the rows of each batch this process builds (all of them on one device)
            batch_rows=list(pmesh.local_rows((self.b, self.s_len + 1), self.mesh)) if self.mesh else [0, self.b],
            start_step=self.start,
            store=store.manifest["key"],
            domains=store.domains,
            epochs=self.mixture.epochs,
        )
        self.fault = _fault_hook(run)
        pmesh.set_active(self.mesh, cfg.mesh.fsdp)  # the train step traces its transports and gathers on it
        self.shardings = None if self.mesh is None else jax.tree.map(lambda x: x.sharding, self.state)
        # MFU per device, against one device's peak in the compute dtype (the mesh's tokens/s over all of them)
        set_matmul_precision(cfg)
        phase("peak")
        self.peak, self.peak_source = device_peak(cfg, self.progress)
        phase("launch")
        self.n_devices = cfg.mesh.data * cfg.mesh.expert
        self.evals = eval_points(cfg, steps)
        self.poison = set(cfg.train.poison_steps)
        try:
            self.injector = Injector(cfg.train.inject, store.domains)
        except ValueError as exc:
            raise RunRefused(str(exc)) from None
        # the forecast the run is held to (`moelab ladder forecast --out RUN_DIR/forecast.json`, or the lab's
        # registered one): recorded by its hash at the first launch; a later launch refuses a changed one
        if jax.process_index() == 0 and run.forecast.is_file() and not run.forecast_versions():
            run.register_forecast("launch", step=self.start)
        forecast = run.verified_forecast()
        # the learning-rate plan, registered at launch: the rate each step should apply (a wrong config,
        # lr_high, is in it); the health check holds the rate the optimiser applied against it. The plan
        # is the schedule's definition written apart (monitor/reference.py), not optim.lr_factor, which
        # sets the rate: a bug in that function shows instead of agreeing with itself
        plan = self.h.peak_lr * reference_factors(cfg.train, steps)
        plan *= np.array([self.injector.plan_scale(x) for x in range(steps)])
        if jax.process_index() == 0:
            run.register_lr_plan(plan, start_step=self.start)
        self.monitor = HealthMonitor(
            lr_at=lambda step: plan[min(step, steps - 1)],
            forecast=forecast,
            ladder=ladder_from_forecast(forecast),  # the rungs the forecast came from, when at hand
            steps=steps,
        )
        self.monitor.reset(read_jsonl(run.metrics))
        self.updates = ForecastUpdates(run, forecast, cfg, on_forecast_update, self.progress)

    def at_length(self, step: int) -> dict:
        """What step ``step`` runs with, for its phase's sequence length (data.phase_seq_lens): the
        phase's config, its train step (compiled on first use), evaluator and FLOPs per token."""
        phase = self.mixture.phase_at(step)
        length = self.lens[phase]
        got = self.by_len.get(length)
        if got is None:
            pcfg = phase_config(self.cfg, phase)
            if len(set(self.lens)) > 1:
                scaling = rope_scaling_of(pcfg.model)
                self.run.event("context", step=step, phase=phase, seq_len=length, sequences=pcfg.train.batch_size,
                               rope={"scaling": scaling[0], "factor": scaling[1], "original_len": scaling[2]})  # fmt: skip
                if step > self.start:
                    rope = "RoPE unscaled" if scaling[0] == "none" else f"RoPE {scaling[0]} x{scaling[1]:g}"
                    say(f"step {step}: phase {phase} trains at {length} tokens a sequence, {pcfg.train.batch_size} "
                        f"sequences a batch ({rope}); compiling its step", self.progress)  # fmt: skip
            got = self.by_len[length] = {
                "cfg": pcfg,
                "step": make_train_step(pcfg, self.opt, self.h, self.shardings),
                "evaluator": None,
                "flops_per_token": 3 * accounting.count(pcfg).forward_flops_per_token,
            }
        return got

    def evaluator_at(self, done: int):
        """The evaluator of the phase that trained step ``done`` - 1 (the first phase's at step 0): the
        held-out windows at that phase's length, RoPE as it trains."""
        got = self.at_length(max(done - 1, 0))
        if got["evaluator"] is None:  # runs under the mesh, as the model trains
            got["evaluator"] = Evaluator(got["cfg"], self.store, mesh=self.mesh)
        return got

    def step_loop(self, stop) -> None:
        """Every step from the start: a batch, the update, the NaN guard, then logs, evals and checkpoints."""
        run, inj = self.run, self.injector
        if self.start == 0 and not self.cursor_ok:
            phase("initial eval")
            say("evaluating the initial model on the held-out windows", self.progress)
            self.evaluate(0)
        phase("compile")
        say(f"compiling the train step (step {self.start + 1} waits for it; the XLA cache keeps it for reruns)",
            self.progress)  # fmt: skip
        self.bar = Progress(self.steps, self.start, desc="train", unit="step", enabled=self.progress)
        timing, warm = [0.0, 0], False  # seconds and steps since the last log line
        s = self.start
        while s < self.steps:
            if stop is not None and stop():
                raise RunError(f"stopped at step {s}: another runner holds this run now; nothing more is written")
            if self.fault:
                self.fault("step", s)
            if s in self.skip:  # a batch the NaN guard ruled out: no update, evals and checkpoints as usual
                s += 1
                self.bar.update(1)
                self.after_step(s, None, timing)
                continue
            for f in inj.starting(s):
                run.event("inject", step=s, fault=f.kind, arg=f.arg)
            batch = self.batch(s)
            self.state = inj.edit_state(s, self.state)
            now = self.at_length(s)
            if now["step"] is not getattr(self, "step_fn", None):
                self.step_fn, self.flops_per_token, warm = now["step"], now["flops_per_token"], False
            t0 = time.perf_counter()
            self.state, metrics = self.step_fn(
                self.state, batch, np.int32(s), np.bool_(s in self.poison), inj.step_args(s)
            )
            finite = bool(metrics["finite"])
            if warm:  # the first step in a process compiles; it is not timed
                timing[0] += time.perf_counter() - t0
                timing[1] += 1
            else:
                phase("steps")
            warm = True
            if not finite:
                back = self.nan_guard(s, metrics)
                if back is not None:  # restored: on from the checkpoint's step
                    s = back
                    continue
            else:
                self.guard["consecutive"] = 0
            s += 1
            self.bar.update(1)
            self.after_step(s, metrics, timing)
        self.bar.close()
        self.ckpts.wait()  # the last save complete; a runner that lost its lease meanwhile stops here
        if stop is not None and stop():
            raise RunError(f"stopped at step {s}: another runner holds this run now; nothing more is written")

    def batch(self, s: int):
        """Step ``s``'s batch: on a mesh each process builds only its devices' rows (all of them when
        a data-corruption or token-noise fault, a testing aid, rewrites rows)."""
        cfg, store, inj = self.cfg, self.store, self.injector
        args = (store, self.mixture, data_seed(cfg), inj.data_step(s), self.b, self.s_len)
        if self.mesh is not None and not any(f.kind in ("data_corruption", "token_noise") for f in inj.active(s)):
            rows, length, _ = self.mixture.shape_at(inj.data_step(s), self.b, self.s_len)
            return pmesh.put_rows(lambda lo, hi: batch_rows(*args, lo, hi)[0], (rows, length + 1), self.mesh)
        batch, rows_domain = batch_at(*args)
        batch = inj.corrupt(s, batch, rows_domain, store.domains, store.manifest["vocab_size"], cfg.train.seed)
        return batch if self.mesh is None else pmesh.put_batch(batch, self.mesh)

    def finish(self) -> dict:
        phase("checkpoint")
        say("waiting for the last checkpoint to be complete", self.progress and self.ckpts.saving())
        self.ckpts.close()  # the run never ends with a save in flight
        phase("summary")
        summary = summarize(self.run, self.cfg, self.peak, self.peak_source)
        self.run.summary.write_text(json.dumps(summary, indent=1))
        self.run.event("end", step=self.steps, summary=summary)
        return summary

    # ------------------------------------------------------------------ what the loop does

    def nan_guard(self, s: int, metrics) -> int | None:
        """A non-finite step: skipped; ``nan_patience`` in a row restore the newest checkpoint (the
        step to go on from is returned) and skip those batches; again before a new checkpoint stops."""
        cfg, run, guard = self.cfg, self.run, self.guard
        guard["consecutive"] += 1
        run.event("nan_skip", step=s, loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]))
        if guard["consecutive"] < cfg.train.nan_patience:
            return None
        n_bad = guard["consecutive"]
        bad = [x for x in range(s, -1, -1) if x not in self.skip][:n_bad][::-1]
        ckpts = self.ckpts.steps()  # a save in flight is waited for: it may be the one to restore
        if guard["restored"] or not ckpts:
            why = "again after a restore" if guard["restored"] else "and there is no checkpoint to restore"
            raise RunError(
                f"NaN guard: {n_bad} non-finite steps in a row (steps {bad[0]}-{bad[-1]}) {why}; "
                f"stopping. Checkpoints and metrics are kept in {run.path}"
            )
        self.state, meta = checkpoint.restore(run.ckpt, ckpts[-1], self.state)
        self.skip.update(bad)
        self.skip.update(meta["skip_steps"])
        run.truncate_metrics(meta["metrics_cursor"])
        self.monitor.reset(read_jsonl(run.metrics))
        run.event("nan_restore", at_step=s, restored_step=ckpts[-1], skipping=bad)
        self.bar.update(ckpts[-1] - (s + 1))
        guard.update(consecutive=0, restored=True)
        return ckpts[-1]

    def record(self, rec: dict) -> None:
        """A metrics line: to the file, the trackers and the health monitor (a changed level is an event)."""
        append_jsonl(self.run.metrics, rec)
        for t in self.trackers:
            t.log(rec)
        for f in self.monitor.update(rec):
            if f.first and f.level == "OK":
                continue  # only changes of level are events
            self.run.event("health", check=f.check, level=f.level, step=f.step, evidence=f.evidence)
            if f.level == "ALERT":
                text = f"moelab: ALERT at step {f.step}: {f.check}: {f.evidence}"
                if getattr(self, "bar", None) is not None:  # under the progress bar, not through it
                    self.bar.write(text)
                else:
                    print(text, file=sys.stderr)

    def evaluate(self, done: int) -> dict:
        t0 = time.perf_counter()
        now = self.at_length(max(done - 1, 0))
        # the initial model is the config's (its seed) and so are the windows: its held-out losses are
        # remembered in the cache (with the code, versions and machine that computed them), and the
        # same config's next run records them again without computing them (task scores are computed)
        key = None
        if done == 0 and self.fresh and not self.cfg.train.task_evals:
            key = {"config": to_dict(self.cfg), "store": self.store.manifest["key"]}
        res = remembered("initial_eval", key) if key is not None else None
        if res is None:
            res = self.evaluator_at(done)["evaluator"](self.state["params"], self.state["model_state"])
            if key is not None:
                remember("initial_eval", key, res)
        rec = {"kind": "eval", "step": done, "tokens": done * self.b * self.s_len, **res}
        if len(set(self.lens)) > 1:
            rec["seq_len"] = now["cfg"].model.seq_len  # the held-out windows' length, as the phase trains
        if self.cfg.train.task_evals:  # the tasks by log-likelihood, the model as this phase trains it
            rec["tasks"] = self.tasks(now["cfg"].model)
        rec["eval_seconds"] = time.perf_counter() - t0
        self.record(rec)
        self.run.event("eval", step=done, loss=res["loss"]["macro"], loss_dropless=res["loss_dropless"]["macro"])
        self.updates.after_eval(done)
        return rec

    def tasks(self, m) -> dict:
        """train.task_evals scored now: each task's acc, acc_norm, acc_bytes, chance and bits per byte."""
        from moelab.eval.tasks import model_loglik, score

        if not hasattr(self, "task_tok"):
            from moelab.data.tokenizer import load_saved

            self.task_tok = load_saved(self.store.path)
        loglik = model_loglik(self.state["params"], self.state["model_state"], m, self.task_tok, batch=32)
        keep = ("acc", "acc_norm", "acc_bytes", "chance", "bpb")
        return {name: {k: v for k, v in score(ex, loglik).items() if k in keep} for name, ex in self.task_sets.items()}

    def save(self, done: int) -> None:
        cfg, run = self.cfg, self.run
        meta = {
            "step": done,
            "metrics_cursor": run.metrics_cursor(),
            "skip_steps": sorted(self.skip),
            "nan_guard": dict(self.guard),
            "config_hash": config_hash(cfg),
            "seed": cfg.train.seed,
            "time": time.time(),
        }
        self.ckpts.save(done, self.state, meta)  # in the background with train.async_checkpoint

    def after_step(self, done: int, metrics, timing: list) -> None:
        """Log (when the step ran), evaluate and checkpoint after step ``done``."""
        cfg, steps = self.cfg, self.steps
        self.ckpts.poll()  # a background save that completed: its journal event
        if metrics is not None and (done % cfg.train.log_every == 0 or done == steps):
            m = jax.device_get(metrics)
            t_sum, n = timing
            tps = n * self.b * self.s_len / t_sum if n else float("nan")
            per_device = tps / self.n_devices
            extra = {
                "tokens_per_s": tps,
                "tokens_per_s_per_device": per_device,
                "flops_per_s_per_device": per_device * self.flops_per_token,
                "step_time": t_sum / n if n else float("nan"),
                "mfu": per_device * self.flops_per_token / self.peak if self.peak else float("nan"),
                "phase": self.mixture.phase_at(done - 1),
                # passes over each domain's training windows so far (a shuffled pass per epoch, counted exactly)
                "epochs": epochs_at(self.store, self.mixture, data_seed(cfg), done, self.b, self.s_len),
            }
            self.record(_train_record(done, cfg, m, extra))
            self.bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{tps:,.0f}")
            timing[:] = [0.0, 0]
        if done in self.evals:
            phase("final eval" if done == steps else "eval")
            self.evaluate(done)
        if done % cfg.train.checkpoint_every == 0 or done == steps or done in cfg.train.keep_steps:
            # a new checkpoint is a new place to restore to: the guard may restore again, and the
            # checkpoint says so, or a run resumed from it would stop where this one restores
            self.guard["restored"] = False
            phase("checkpoint")
            self.save(done)
        phase("steps")  # (a step that follows; the last one's is empty)


def matmul_dtype(cfg: Config, backend: str | None = None) -> str:
    """The precision the matmuls run in: the compute dtype, except float32 on an NVIDIA GPU under
    model.matmul_precision default or high, which runs as TF32 on the tensor cores (so MFU against
    the float32 peak could pass 100%)."""
    m = cfg.model
    backend = backend or jax.default_backend()
    if m.dtype == "float32" and backend == "gpu" and m.matmul_precision != "highest":
        return "tensorfloat32"
    return m.dtype


def set_matmul_precision(cfg: Config) -> None:
    """model.matmul_precision, set explicitly for the run (JAX's own default otherwise depends on the backend)."""
    p = cfg.model.matmul_precision
    jax.config.update("jax_default_matmul_precision", None if p == "default" else p)


def device_peak(cfg: Config, progress: bool = False) -> tuple[float | None, str]:
    """One device's peak FLOP/s in the compute dtype, for MFU, and where it comes from:
    ``train.peak_flops``, the published table (moelab/devices.py) for a known accelerator, or the
    measured matmul rate on a CPU. None (MFU not reported) for an accelerator not in the table."""
    from moelab import devices

    dtype = matmul_dtype(cfg)
    if cfg.train.peak_flops:
        return float(cfg.train.peak_flops), "train.peak_flops"
    kind = jax.devices()[0].device_kind
    published = devices.peak_flops(kind, dtype)
    if published:
        return published, f"published {dtype} peak of {devices.of_kind(kind).name}"
    if jax.default_backend() == "cpu":
        say(f"this machine's {dtype} matmul peak, for MFU (measured once a week)", progress)
        return cached_matmul_peak(dtype=dtype), f"measured {dtype} matmul rate of this CPU"
    say(f"no published {dtype} peak for {kind!r}: MFU is not reported; set train.peak_flops", progress)
    return None, "unknown"


def summarize(run: RunDir, cfg: Config, peak: float | None = None, peak_source: str = "") -> dict:
    recs = [json.loads(x) for x in run.metrics.read_text().splitlines() if x.strip()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    eval_recs = [r for r in recs if r["kind"] == "eval"]
    out = {"run": str(run.path), "steps": cfg.train.steps}
    if train_recs:
        tail = train_recs[-max(1, len(train_recs) // 4) :]
        out.update(
            final_loss=train_recs[-1]["loss"],
            dropped_frac=float(np.mean([r["dropped_frac"] for r in tail])),
            spilled_frac=float(np.mean([r["spilled_frac"] for r in tail])),
        )
        # steady-state speed: the steps that did not compile (none in a run of a step or two)
        timed = [r for r in tail if math.isfinite(r.get("tokens_per_s", math.nan))] or [
            r for r in train_recs if math.isfinite(r.get("tokens_per_s", math.nan))
        ]
        if timed:
            out["tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in timed]))
            n_dev = cfg.mesh.data * cfg.mesh.expert
            out["tokens_per_s_per_device"] = out["tokens_per_s"] / n_dev
            out["flops_per_s_per_device"] = (
                out["tokens_per_s_per_device"]
                * 3
                * accounting.count(phase_config(cfg, len(phase_seq_lens(cfg)) - 1)).forward_flops_per_token
            )
            out["mfu"] = float(np.median([r["mfu"] for r in timed]))
    if eval_recs:
        out["first_eval"] = {"loss": eval_recs[0]["loss"], "bpb": eval_recs[0]["bpb"]}
        out["final_eval"] = {k: eval_recs[-1][k] for k in ("loss", "bpb", "loss_dropless", "bpb_dropless")}
        if eval_recs[-1].get("tasks"):  # train.task_evals: the scores at the start and the end
            out["first_tasks"], out["final_tasks"] = eval_recs[0].get("tasks", {}), eval_recs[-1]["tasks"]
    if peak:
        out["peak_flops"] = peak  # one device's, in the compute dtype; MFU is per device
        out["peak_source"] = peak_source
    out["devices"] = cfg.mesh.data * cfg.mesh.expert
    return out
