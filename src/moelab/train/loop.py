"""The training loop: data, step, metrics, evals, checkpoints, the NaN guard and exact resume.

Batches are a pure function of (seed, step), the state is checkpointed with the metrics cursor,
so a run resumed from a checkpoint writes exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from moelab import accounting
from moelab.config import Config, config_from_dict, config_hash, to_dict
from moelab.data.mixture import batch_at, build_mixture
from moelab.data.store import build_store
from moelab.ladder.faults import Injector
from moelab.ladder.health import HealthMonitor, ladder_from_forecast
from moelab.parallel import mesh as pmesh
from moelab.train import checkpoint, optim
from moelab.train.evaluate import Evaluator
from moelab.train.record import (
    RunDir,
    append_jsonl,
    enable_compile_cache,
    git_state,
    host,
    matmul_peak,
    read_jsonl,
    versions,
)
from moelab.train.step import init_train_state, make_train_step

FAULT_ENV = "MOELAB_TEST_FAULTS"  # testing aid: "kill@STEP,kill_in_save@STEP", each fires once per run


class RunError(Exception):
    """A run that cannot go on (exit code 3); the message says why and what was kept."""


class RunRefused(ValueError):
    """A run the user asked for that cannot start as asked (exit code 2)."""


def eval_points(cfg: Config, steps: int) -> set[int]:
    every = cfg.train.eval_every
    if every:
        points = set(range(0, steps + 1, every))
    else:
        points = {int(round(k * steps / 20)) for k in range(21)}
    return points | {0, steps}


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
            if at == step and [kind, at] not in fired and kind == {"step": "kill", "in_save": "kill_in_save"}[point]:
                fired.append([kind, at])
                fired_path.write_text(json.dumps(fired))
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


def load_run_config(run_dir: str | Path) -> Config:
    run = RunDir(run_dir)
    if not run.config.exists():
        raise RunRefused(f"{run_dir}: no config.json; is this a run directory?")
    return config_from_dict(json.loads(run.config.read_text())["config"], source=str(run.config))


def _check_resume(run: RunDir, cfg: Config | None, resume: bool) -> Config:
    """The config to run: ``cfg``, or the run's own when resuming (with ``cfg`` None, or when the
    run was re-planned and ``cfg`` differs from it only in its horizon)."""
    if not run.config.exists():
        if cfg is None:
            raise RunRefused(f"{run.path}: no config.json to resume from; give a config")
        return cfg
    if not resume:
        raise RunRefused(f"{run.path}: already holds a run; pass --resume to continue it, or choose another --out")
    saved = json.loads(run.config.read_text())
    ours = config_from_dict(saved["config"], source=str(run.config))
    if cfg is None or saved["hash"] == config_hash(cfg):
        return ours
    old, new = saved["config"], json.loads(json.dumps(to_dict(cfg)))  # tuples as the file's lists
    diff = [f"{s}.{k}" for s in new if isinstance(new[s], dict) for k in new[s] if old.get(s, {}).get(k) != new[s][k]]
    if ours.train.replans and set(diff) <= {"train.steps", "train.replans"}:
        return ours  # `moelab replan` changed the horizon: the run follows its new plan
    if set(diff) <= {"mesh.data", "mesh.expert"}:
        # a placement, not a change of the run: resume on another mesh, and record it
        _mesh(cfg)  # refused before the record changes
        run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
        run.event("mesh_change", before=old["mesh"], after=new["mesh"])
        return cfg
    raise RunRefused(
        f"{run.path}: the config differs from the run's ({', '.join(diff) or 'name'}); resume with the same config"
    )


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
        from moelab.ladder.law import LAWS

        self.run, self.forecast, self.callback, self.progress = run, forecast, callback, progress
        self.every = cfg.train.forecast_update_every * cfg.train.steps
        self.on = bool(forecast and forecast.get("law") in LAWS and self.every > 0 and forecast.get("rungs"))
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
            if self.rungs is None:
                self.rungs = [rung_run(d) for d in self.forecast["rungs"]]
            upd = update_forecast(self.forecast, rung_run(self.run.path), self.rungs)
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
        if self.progress:
            from tqdm import tqdm

            tqdm.write(
                f"forecast update at step {step}: final held-out loss {fin['loss']:.4f} "
                f"[{fin['low']:.4f}, {fin['high']:.4f}] (registered: {self.forecast['loss'][-1]:.4f})",
                file=sys.stderr,
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
    asks whether this runner still holds the step's lease."""
    from tqdm import tqdm

    run = RunDir(out)
    if jax.process_index() > 0:  # one writer: the others keep their records apart and share ckpt/
        run = RunDir(Path(out) / f".process-{jax.process_index()}")
        run.ckpt = Path(out) / "ckpt"
    cfg = _check_resume(run, cfg, resume)
    mesh = _mesh(cfg)  # refused before anything is written
    enable_compile_cache()
    store = build_store(cfg.data, cfg.model.vocab_size, progress=progress)
    mixture = build_mixture(cfg, store)
    steps, b, s_len = cfg.train.steps, cfg.train.batch_size, cfg.model.seq_len
    run.path.mkdir(parents=True, exist_ok=True)
    if not run.config.exists():
        run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))

    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    if mesh is not None:  # routed experts split over `expert`, the rest replicated, batches over both
        state = pmesh.shard_tree(state, mesh)
    start, skip, cursor_ok = 0, set(), False
    # the NaN guard's memory: non-finite steps in a row, and whether it restored since the last checkpoint
    guard = {"consecutive": 0, "restored": False}
    saved = checkpoint.steps(run.ckpt)
    if resume and saved:
        state, meta = checkpoint.restore(run.ckpt, saved[-1], state)
        start, skip = meta["step"], set(meta["skip_steps"])
        guard.update(meta.get("nan_guard", {}))
        run.truncate_metrics(meta["metrics_cursor"])
        cursor_ok = True
        run.event("resume", step=start, checkpoint=saved[-1])
    elif resume and run.metrics.exists():
        run.truncate_metrics(0)  # nothing was checkpointed: start again from the beginning
        run.event("resume", step=0, checkpoint=None)
    run.event(
        "launch",
        config_hash=config_hash(cfg),
        git=git_state(),
        versions=versions(),
        host=host(),
        devices=[str(d) for d in jax.devices()],
        start_step=start,
        store=store.manifest["key"],
        domains=store.domains,
        epochs=mixture.epochs,
    )
    fault = _fault_hook(run)
    pmesh.set_active(mesh)  # the train step's MoE blocks trace their transports on this mesh
    step_fn = make_train_step(cfg, opt, h)
    evaluator = Evaluator(cfg, store)
    # MFU per device, against one device's peak in the compute dtype (the mesh's tokens/s over all of them)
    peak = cfg.train.peak_flops or matmul_peak(dtype=cfg.model.compute_dtype)
    n_devices = cfg.mesh.data * cfg.mesh.expert
    flops_per_token = 3 * accounting.count(cfg).forward_flops_per_token
    evals = eval_points(cfg, steps)
    poison = set(cfg.train.poison_steps)
    try:
        injector = Injector(cfg.train.inject, store.domains)
    except ValueError as exc:
        raise RunRefused(str(exc)) from None
    # health checks see every record; a resumed run's monitor first re-reads what survived
    # the forecast the run is held to (`moelab ladder forecast --out RUN_DIR/forecast.json`, or the lab's
    # registered one): recorded by its hash at the first launch; a later launch refuses a changed one
    if jax.process_index() == 0 and run.forecast.is_file() and not run.forecast_versions():
        run.register_forecast("launch", step=start)
    forecast = run.verified_forecast()
    # the learning-rate plan, registered at launch: the rate each step should apply (a wrong config,
    # lr_high, is in it); the health check holds the rate the optimiser applied against it
    plan = h.peak_lr * np.asarray(optim.lr_factor(np.arange(steps), h), np.float64)
    plan *= np.array([injector.plan_scale(x) for x in range(steps)])
    if jax.process_index() == 0:
        run.register_lr_plan(plan, start_step=start)
    monitor = HealthMonitor(
        lr_at=lambda step: plan[min(step, steps - 1)],
        forecast=forecast,
        ladder=ladder_from_forecast(forecast),  # the rungs the forecast came from, when at hand
        steps=steps,
    )
    monitor.reset(read_jsonl(run.metrics))
    updates = ForecastUpdates(run, forecast, cfg, on_forecast_update, progress)

    def record(rec: dict) -> None:
        append_jsonl(run.metrics, rec)
        for t in trackers:
            t.log(rec)
        for f in monitor.update(rec):
            if f.first and f.level == "OK":
                continue  # only changes of level are events
            run.event("health", check=f.check, level=f.level, step=f.step, evidence=f.evidence)
            if f.level == "ALERT":
                tqdm.write(f"moelab: ALERT at step {f.step}: {f.check}: {f.evidence}", file=sys.stderr)

    def do_eval(done: int) -> dict:
        t0 = time.perf_counter()
        pmesh.set_active(None)  # evaluation runs the single-device dispatch on the (sharded) weights
        try:
            res = evaluator(state["params"], state["model_state"])
        finally:
            pmesh.set_active(mesh)
        rec = {
            "kind": "eval",
            "step": done,
            "tokens": done * b * s_len,
            **res,
            "eval_seconds": time.perf_counter() - t0,
        }
        record(rec)
        run.event("eval", step=done, loss=res["loss"]["macro"], loss_dropless=res["loss_dropless"]["macro"])
        updates.after_eval(done)
        return rec

    def do_checkpoint(done: int) -> None:
        meta = {
            "step": done,
            "metrics_cursor": run.metrics_cursor(),
            "skip_steps": sorted(skip),
            "nan_guard": dict(guard),
            "config_hash": config_hash(cfg),
            "seed": cfg.train.seed,
            "time": time.time(),
        }
        path = checkpoint.save(run.ckpt, done, state, meta, cfg.train.keep_last, cfg.train.keep_every, fault)
        run.event("checkpoint", step=done, path=f"ckpt/{path.name}")

    def after_step(done: int, metrics, timing: list) -> None:
        """Log (when the step ran), evaluate and checkpoint after step ``done``."""
        if metrics is not None and (done % cfg.train.log_every == 0 or done == steps):
            m = jax.device_get(metrics)
            t_sum, n = timing
            tps = n * b * s_len / t_sum if n else float("nan")
            extra = {
                "tokens_per_s": tps,
                "step_time": t_sum / n if n else float("nan"),
                "mfu": tps * flops_per_token / (peak * n_devices),
                "phase": mixture.phase_at(done - 1),
            }
            record(_train_record(done, cfg, m, extra))
            bar.set_postfix(loss=f"{float(m['loss']):.3f}", tok_s=f"{tps:,.0f}")
            timing[:] = [0.0, 0]
        if done in evals:
            do_eval(done)
        if done % cfg.train.checkpoint_every == 0 or done == steps:
            # a new checkpoint is a new place to restore to: the guard may restore again, and the
            # checkpoint says so, or a run resumed from it would stop where this one restores
            guard["restored"] = False
            do_checkpoint(done)

    try:
        if start == 0 and not cursor_ok:
            do_eval(0)
        bar = tqdm(total=steps, initial=start, desc="train", unit="step", disable=None if progress else True)
        timing, warm = [0.0, 0], False  # seconds and steps since the last log line
        s = start
        while s < steps:
            if stop is not None and stop():
                raise RunError(f"stopped at step {s}: another runner holds this run now; nothing more is written")
            if fault:
                fault("step", s)
            if s in skip:  # a batch the NaN guard ruled out: no update, evals and checkpoints as usual
                s += 1
                bar.update(1)
                after_step(s, None, timing)
                continue
            batch, rows_domain = batch_at(store, mixture, cfg.train.seed, injector.data_step(s), b, s_len)
            if mesh is not None:
                batch = pmesh.put_batch(batch, mesh)
            for f in injector.starting(s):
                run.event("inject", step=s, fault=f.kind, arg=f.arg)
            batch = injector.corrupt(s, batch, rows_domain, store.domains, store.manifest["vocab_size"], cfg.train.seed)
            state = injector.edit_state(s, state)
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch, np.int32(s), np.bool_(s in poison), injector.step_args(s))
            finite = bool(metrics["finite"])
            if warm:  # the first step in a process compiles; it is not timed
                timing[0] += time.perf_counter() - t0
                timing[1] += 1
            warm = True
            if not finite:
                guard["consecutive"] += 1
                run.event("nan_skip", step=s, loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]))
                if guard["consecutive"] >= cfg.train.nan_patience:
                    n_bad = guard["consecutive"]
                    bad = [x for x in range(s, -1, -1) if x not in skip][:n_bad][::-1]
                    ckpts = checkpoint.steps(run.ckpt)
                    if guard["restored"] or not ckpts:
                        why = "again after a restore" if guard["restored"] else "and there is no checkpoint to restore"
                        raise RunError(
                            f"NaN guard: {n_bad} non-finite steps in a row (steps {bad[0]}-{bad[-1]}) {why}; "
                            f"stopping. Checkpoints and metrics are kept in {run.path}"
                        )
                    state, meta = checkpoint.restore(run.ckpt, ckpts[-1], state)
                    skip.update(bad)
                    skip.update(meta["skip_steps"])
                    run.truncate_metrics(meta["metrics_cursor"])
                    monitor.reset(read_jsonl(run.metrics))
                    run.event("nan_restore", at_step=s, restored_step=ckpts[-1], skipping=bad)
                    bar.update(ckpts[-1] - (s + 1))
                    s = ckpts[-1]
                    guard.update(consecutive=0, restored=True)
                    continue
            else:
                guard["consecutive"] = 0
            s += 1
            bar.update(1)
            after_step(s, metrics, timing)
        bar.close()
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

    summary = summarize(run, cfg, peak)
    run.summary.write_text(json.dumps(summary, indent=1))
    run.event("end", step=steps, summary=summary)
    return summary


def summarize(run: RunDir, cfg: Config, peak: float | None = None) -> dict:
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
            tokens_per_s=float(np.nanmedian([r["tokens_per_s"] for r in tail])),
            mfu=float(np.nanmedian([r["mfu"] for r in tail])),
        )
    if eval_recs:
        out["first_eval"] = {"loss": eval_recs[0]["loss"], "bpb": eval_recs[0]["bpb"]}
        out["final_eval"] = {k: eval_recs[-1][k] for k in ("loss", "bpb", "loss_dropless", "bpb_dropless")}
    if peak:
        out["peak_flops"] = peak  # one device's, in the compute dtype; MFU is per device
        out["devices"] = cfg.mesh.data * cfg.mesh.expert
    return out
