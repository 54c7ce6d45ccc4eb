"""Training a config into a run folder: the checks before anything is written, the phases that make
the run state (``prepare``), the loop (``train.core``) with its callbacks, and the summary.

Batches are a pure function of (seed, step), the state is checkpointed with the metrics cursor,
so a run resumed from a checkpoint writes exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import jax
import numpy as np

from moelab.cache import enable_compile_cache
from moelab.config import Config, changed_fields, config_hash, phase_seq_lens, resolve_dtype, to_dict
from moelab.config.faults import parse
from moelab.data.mixture import build_mixture, padding_stats
from moelab.data.store import build_store, resolve_all
from moelab.errors import ConfigError, RunError, RunRefused  # noqa: F401 - raised here, importable from here
from moelab.eval.builtin import BUILTIN, builtin_task
from moelab.eval.tasks import load_tasks
from moelab.model.transformer import backend_problems
from moelab.monitor.faults import Injector
from moelab.monitor.reference import reference_factors
from moelab.parallel import mesh as pmesh
from moelab.paths import as_path
from moelab.progress import phase, say
from moelab.runs import RunDir, git_state, host, load_run_config, read_jsonl, versions
from moelab.schedule import eval_points
from moelab.train import checkpoint, optim
from moelab.train.callbacks import FAULT_ENV, TestFaults, default_callbacks  # noqa: F401 - FAULT_ENV importable
from moelab.train.core import Loop
from moelab.train.init_from import check_parent, init_state
from moelab.train.run_state import Injection, RunState
from moelab.train.step import init_train_state, offload_state
from moelab.train.summary import device_peak, matmul_dtype, set_matmul_precision, summarize  # noqa: F401

# fields a resume may change: where and how the same run is computed, not what it computes
PLACEMENT = {"mesh.data", "mesh.expert", "mesh.fsdp", "train.micro_batch", "train.offload", "train.async_checkpoint"}


def _check_resume(run: RunDir, cfg: Config | None, resume: bool) -> Config:
    """The config to run: ``cfg``, or the run's own when resuming (with ``cfg`` None, or when the
    run was re-planned and ``cfg`` differs from it only in its horizon). The run's config.json must
    still be what the run wrote (its hash): an edited one is refused, naming the fields changed."""
    if not run.config.exists():
        if cfg is None:
            raise RunRefused(f"{run.path}: no config.json to resume from; give a config")
        return cfg
    if not resume:
        raise RunRefused(f"{run.path}: already holds a run; pass --resume to continue it, or choose another --out")
    ours = load_run_config(run.path)  # refuses a config.json that is not one, in one line
    saved = json.loads(run.config.read_text())
    if saved.get("hash") != config_hash(ours):
        raise RunRefused(_edited(run, saved, ours))
    if cfg is None or saved["hash"] == config_hash(cfg):
        return ours
    old, new = saved["config"], to_dict(cfg)
    diff = changed_fields(old, new)
    if ours.train.replans and set(diff) <= {"train.steps", "train.replans"}:
        return ours  # `moelab replan` changed the horizon: the run follows its new plan
    if set(diff) <= PLACEMENT:
        # a placement, not a change of the run: resume on another mesh, with other micro-batches, offload or
        # checkpoint saving (what fits the machines it now runs on), and record it
        _mesh(cfg)  # refused before the record changes
        run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
        old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))  # tuples as the file's lists
        if set(diff) & {"mesh.data", "mesh.expert", "mesh.fsdp"}:
            run.event("mesh_change", before=old["mesh"], after=new["mesh"])
        if rest := sorted(set(diff) - {"mesh.data", "mesh.expert", "mesh.fsdp"}):
            sec = lambda d, k: d.get(k.split(".")[0], {}).get(k.split(".")[1])  # noqa: E731
            run.event("placement_change", before={k: sec(old, k) for k in rest}, after={k: sec(new, k) for k in rest})
        return cfg
    raise RunRefused(
        f"{run.path}: the config differs from the run's ({', '.join(diff) or 'name'}); resume with the same config"
    )


def _edited(run: RunDir, saved: dict, ours: Config) -> str:
    """The refusal of a config.json edited after the run wrote it: the fields that differ from the
    config its newest checkpoint was saved with (each checkpoint keeps it), or, without one, the hash."""
    root = as_path(ours.train.checkpoint_dir) if ours.train.checkpoint_dir else run.ckpt
    for step in reversed(checkpoint.steps(root)):
        try:
            meta = checkpoint.meta_of(root, step)
        except (OSError, ValueError):
            continue
        if "config" in meta:
            diff = changed_fields(meta["config"], to_dict(ours)) or ["fields outside the hash"]
            return (f"{run.config}: edited after the run wrote it: {', '.join(diff)} differ from the config its "
                    f"checkpoint at step {step} was saved with; put them back (a resume never changes what a run "
                    "computes), or train the changed config into a new --out")  # fmt: skip
    return (
        f"{run.config}: edited after the run wrote it (its config no longer matches its hash "
        f"{saved.get('hash')}); put it back, or train the changed config into a new --out"
    )


def _check_again(run: RunDir, cfg: Config, resume: bool, restart: bool) -> None:
    """--resume on a run with records but no checkpoint is refused (it would start over silently);
    --restart alone on a run with a checkpoint is refused (it would throw the checkpoint's steps away)."""
    root = as_path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else run.ckpt
    saved = checkpoint.steps(root)
    if restart and not resume and saved:
        raise RunRefused(f"--restart: {root} holds checkpoints (the newest at step {saved[-1]}); continue from it "
                         "with --resume, or train into a new --out")  # fmt: skip
    if resume and not restart and not saved and run.metrics.is_file() and run.metrics.stat().st_size:
        last = max((int(r.get("step", 0)) for r in read_jsonl(run.metrics)), default=0)
        raise RunRefused(f"--resume: {run.path} has records (to step {last}) but no checkpoint to continue from; "
                         "train it again from step 0 with --restart (its records are cut back)")  # fmt: skip


def _finished(run: RunDir, cfg: Config | None) -> dict | None:
    """A finished run's summary (its newest checkpoint at its planned horizon, summary.json written),
    said in one line; None when the run has more to do, or when ``cfg`` is not the run's own (which
    ``_check_resume`` then judges). Resuming a finished run writes nothing."""
    if not (run.summary.is_file() and run.config.is_file()):
        return None
    try:
        saved_hash = json.loads(run.config.read_text()).get("hash")
        ours = load_run_config(run.path)
    except (ValueError, AttributeError, RunRefused):
        return None  # not a config.json: _check_resume says so in one line
    planned = ours.train.steps
    if saved_hash != config_hash(ours) or (cfg is not None and saved_hash != config_hash(cfg)):
        return None  # an edited config.json, or another config: _check_resume judges
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


def train(
    cfg: Config | None,
    out: str | Path,
    *,
    resume: bool = False,
    restart: bool = False,
    progress: bool = True,
    trackers=(),
    on_forecast_update=None,
    stop=None,
    callbacks=(),
) -> dict:
    """Train ``cfg`` into ``out``; returns the summary (also written to summary.json).

    With ``resume``, ``cfg`` may be None: the run's own config.json is used (as re-planned). It is
    refused on a run that has records but no checkpoint; ``restart`` trains such a run again from
    step 0 (alone, it is refused on a run with a checkpoint).
    ``on_forecast_update(update)`` is called with each refit of the run's forecast (see
    ``train.forecast_update_every``), after it is written to forecast_updates.jsonl. ``stop()``,
    asked before every step, ends the run (RunError) without writing more when it says so: the lab
    asks whether this runner still holds the step's lease. ``callbacks`` run after the loop's own
    (train.callbacks: the hooks and their order).

    The phases, in order: check what was asked, prepare the data, build or restore the state,
    launch (the record of what runs, the forecast and learning-rate plan it is held to), the step
    loop, the summary."""
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
    cfg = _check_resume(run, cfg, resume or restart)
    _check_again(RunDir(out), cfg, resume, restart)  # (in a job, every process judges process 0's records)
    if problems := cfg.check_vocab() + backend_problems(cfg.model):
        raise ConfigError(problems)
    mesh = _mesh(cfg)  # a bad mesh is refused before anything is written
    task_sets = _task_sets(cfg)  # a task file that is not one is refused before anything is written
    if cfg.train.init_from:  # a parent without that checkpoint, or of other shapes: refused before anything is written
        check_parent(cfg)
    test_faults = TestFaults.from_env(run)
    _check_writer(cfg, test_faults)
    rs = prepare(cfg, run, mesh, progress, resume or restart, task_sets, test_faults)
    loop = Loop(rs, [*default_callbacks(rs, progress=progress, trackers=trackers, stop=stop,
                                        on_forecast_update=on_forecast_update, test_faults=test_faults),
                     *callbacks])  # fmt: skip
    loop.run()
    return finish(rs)


def _task_sets(cfg: Config) -> dict:
    """train.task_evals' examples, ``train.task_eval_examples`` of each evenly spread over its file (the
    same ones at every evaluation); a run holding out less than the built-in tasks' documents is told so."""
    if not cfg.train.task_evals:
        return {}
    every = load_tasks(cfg.train.task_evals, "train.task_evals")
    if set(cfg.train.task_evals) & set(BUILTIN):  # made from documents held out at the manifest's fraction
        made = json.loads((builtin_task(BUILTIN[0]).parent / "tasks.json").read_text())["held_out_fraction"]
        if cfg.data.held_out_fraction < made:
            say(f"note: the built-in tasks come from documents held out at data.held_out_fraction {made:g}; "
                f"this run holds out {cfg.data.held_out_fraction:g}, so it may train on some of them", True)  # fmt: skip
    n = cfg.train.task_eval_examples
    return {k: [v[i] for i in np.linspace(0, len(v) - 1, n).round().astype(int)] if 0 < n < len(v) else v
            for k, v in every.items()}  # fmt: skip


def _check_writer(cfg: Config, test_faults) -> None:
    """train.checkpoint_writer process: a single-process job, without test faults inside a save."""
    if cfg.train.checkpoint_writer != "process":
        return
    if jax.process_count() > 1:
        raise RunRefused("train.checkpoint_writer: process takes a single-process job (each process of a "
                         f"{jax.process_count()}-process job writes its own shards); use thread")  # fmt: skip
    if test_faults is not None and any(kind.endswith("_in_save") for kind, _ in test_faults.faults):
        raise RunRefused(f"{FAULT_ENV}: a fault inside a save needs train.checkpoint_writer: thread")


def _check_fault_domains(cfg: Config) -> None:
    """A fault that names a domain (data_corruption@S:D) is refused before the store is built, not after."""
    try:
        if any(f.kind == "data_corruption" and f.arg for f in map(parse, cfg.train.inject)):
            Injector(cfg.train.inject, [d.name for d in resolve_all(cfg.data)[0]])
    except ValueError as exc:
        raise RunRefused(str(exc)) from None


# ---------------------------------------------------------------------- the phases that make the run state


def prepare(cfg: Config, run: RunDir, mesh, progress: bool, resume: bool, task_sets: dict, test_faults=None):
    """The run state, phase by phase: the data, the state (fresh or restored), the launch. The fresh
    state is initialised in a thread beside the data's preparation (a cold store's tokenizer training
    and tokenizing leave a core free part of the time); the state phase takes it when it is done."""
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        # XLA:CPU's cached programs hang a multi-process job at its first step on a relaunch or resume
        # (measured: the same resume without the cache finishes); such a job compiles at every launch
        enable_compile_cache()
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    fresh = Beside(lambda: init_train_state(cfg, opt), "moelab-init")
    try:
        store, mixture = _prepare_data(cfg, run, progress)
    except BaseException:
        fresh.thread.join()  # JAX still computing in a thread when the interpreter exits aborts the process
        raise
    rs = _build_or_restore(cfg, run, mesh, progress, resume, store, mixture, task_sets, test_faults, (h, opt, fresh))
    _launch(rs)
    return rs


class Beside:
    """``fn()`` run in a daemon thread from now; ``get()`` waits for its value (or raises its error)."""

    def __init__(self, fn, name: str):
        self.value, self.error = None, None

        def work():
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001 - raised again by get(), on the caller's thread
                self.error = exc

        self.thread = threading.Thread(target=work, name=name, daemon=True)
        self.thread.start()

    def get(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def _prepare_data(cfg: Config, run: RunDir, progress: bool):
    """The token store (built once, cached) and the mixture; the run's config.json."""
    _check_fault_domains(cfg)
    store = build_store(cfg.data, cfg.model.vocab_size, progress=progress)
    mixture = build_mixture(cfg, store)
    for name, p in padding_stats(mixture, cfg.model.seq_len).items():  # data.packing padded
        say(f"padded rows: {name}: {p['documents']:,} documents, one a row; {100 * p['cut']:.1f}% of their tokens "
            f"cut past {cfg.model.seq_len + 1}, {100 * p['padding']:.1f}% of a row padding", progress)  # fmt: skip
    run.path.mkdir(parents=True, exist_ok=True)
    if not run.config.exists():
        run.config.write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
    tokenizer = run.path / "tokenizer.json"  # the run's own, for `moelab sample` and `moelab export`
    if not tokenizer.exists() and (store.path / "tokenizer.json").exists():
        shutil.copyfile(store.path / "tokenizer.json", tokenizer)
    return store, mixture


def _build_or_restore(cfg, run, mesh, progress, resume, store, mixture, task_sets, test_faults, made) -> RunState:
    """A fresh state, or the newest complete checkpoint's (with the data position, the NaN guard's
    memory and the metrics cut back to its cursor). ``made``: (hyper-parameters, optimiser, the fresh
    state being initialised beside the data's preparation)."""
    phase("state")
    say("building the model and optimiser state" + (" (or restoring the newest checkpoint)" if resume else ""),
        progress)  # fmt: skip
    h, opt, fresh = made
    state = fresh.get()
    if mesh is not None:  # by the rules table: FSDP over `data`, experts also over `expert`
        state = pmesh.shard_tree(state, mesh, cfg.mesh.fsdp)
    state = offload_state(state, cfg)  # train.offload: the optimizer state in host memory
    t = cfg.train
    if t.checkpoint_dir:  # any path Orbax's file layer takes (gs://...); the run's ckpt/ otherwise
        run.ckpt = as_path(t.checkpoint_dir)
    saved = checkpoint.steps(run.ckpt)

    def damaged(step: int, reason: str) -> None:
        say(f"{run.ckpt}/step_{step:08d}: the checkpoint is damaged ({reason}); falling back to an older one", True)
        run.event("checkpoint_damaged", step=step, reason=reason)
        where = run.ckpt / f"step_{step:08d}"
        if where.exists() and jax.process_index() == 0:  # kept for a look, never loaded again
            where.rename(where.with_name(where.name + ".damaged"))

    found = checkpoint.restore_newest(run.ckpt, state, damaged) if resume and saved else None
    if resume and saved and found is None:
        raise RunError(f"{run.ckpt}: none of its {len(saved)} checkpoints restores (each is kept as step_N.damaged "
                       "for a look); train the run again from step 0 with --restart")  # fmt: skip
    # the journal's checkpoint event is written once a checkpoint is complete (a background save's later)
    in_save = test_faults.hook if test_faults is not None and t.checkpoint_writer == "thread" else None
    ckpts = checkpoint.Checkpoints(run.ckpt, t.keep_last, t.keep_every, t.keep_steps, t.async_checkpoint,
                                   lambda info: run.event("checkpoint", **info), in_save,
                                   writer=t.checkpoint_writer)  # fmt: skip
    rs = RunState(cfg=cfg, run=run, mesh=mesh, progress=progress, store=store, mixture=mixture, h=h, opt=opt,
                  state=state, ckpts=ckpts, start=0, skip=set(), guard={"consecutive": 0, "restored": False},
                  cursor_ok=False, fresh=found is None, task_sets=task_sets, injection=None,
                  lens=phase_seq_lens(cfg))  # fmt: skip
    if found is not None:
        rs.state, meta, step = found
        rs.start, rs.skip = meta["step"], set(meta["skip_steps"])
        rs.guard.update(meta.get("nan_guard", {}))
        run.truncate_metrics(meta["metrics_cursor"])
        rs.cursor_ok = True
        run.event("resume", step=rs.start, checkpoint=step)
        say(f"resuming {run.path} from step {rs.start} of {rs.steps} (checkpoint {run.ckpt}/step_{step:08d})",
            jax.process_index() == 0)  # fmt: skip
    elif resume and run.metrics.exists():
        run.truncate_metrics(0)  # --restart (train() refused a plain --resume): from the beginning again
        run.event("resume", step=0, checkpoint=None)
        say(f"restarting {run.path} from step 0: it has no checkpoint; its records are cut back", True)
    if found is None and t.init_from:  # fine-tuning: the parent's weights, this run's own optimizer from them
        say(f"starting from the weights of {t.init_from}", progress)
        rs.state, event = init_state(cfg, rs.state, opt)
        rs.fresh = False  # not the seed's model: its held-out losses are computed, not remembered
        run.event("init_from", **event)
    return rs


def _launch(rs: RunState) -> None:
    """The launch event, the forecast and learning-rate plan the run is held to, the device's peak,
    the fault injection (when asked)."""
    cfg, run, store, steps, mesh = rs.cfg, rs.run, rs.store, rs.steps, rs.mesh
    phase("launch")
    run.event(
        "launch",
        config_hash=config_hash(cfg),
        git=git_state(),
        versions=versions(),
        host=host(),
        devices=[str(d) for d in jax.devices()],
        mesh=None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},  # what the run used
        # the rows of each batch this process builds (all of them on one device)
        batch_rows=list(pmesh.local_rows((rs.b, rs.s_len + 1), mesh)) if mesh else [0, rs.b],
        start_step=rs.start,
        store=store.manifest["key"],
        domains=store.domains,
        epochs=rs.mixture.epochs,
    )
    rs.shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, rs.state)
    # MFU per device, against one device's peak in the compute dtype (the mesh's tokens/s over all of them)
    set_matmul_precision(cfg)
    phase("peak")
    rs.peak, rs.peak_source = device_peak(cfg, rs.progress)
    phase("launch")
    rs.evals = eval_points(cfg, steps)
    try:
        injector = Injector(cfg.train.inject, store.domains)
    except ValueError as exc:
        raise RunRefused(str(exc)) from None
    if cfg.train.inject or cfg.train.poison_steps:  # a testing aid: the step is compiled with fault arguments
        rs.injection = Injection(injector, cfg.train.poison_steps, run)
    # the forecast the run is held to (`moelab ladder forecast --out RUN_DIR/forecast.json`, or the lab's
    # registered one): recorded by its hash at the first launch; a later launch refuses a changed one
    if jax.process_index() == 0 and run.forecast.is_file() and not run.forecast_versions():
        run.register_forecast("launch", step=rs.start)
    rs.forecast = run.verified_forecast()
    # the learning-rate plan, registered at launch: the rate each step should apply (a wrong config,
    # lr_high, is in it); the health check holds the rate the optimiser applied against it. The plan
    # is the schedule's definition written apart (monitor/reference.py), not optim.lr_factor, which
    # sets the rate: a bug in that function shows instead of agreeing with itself
    plan = rs.h.peak_lr * reference_factors(cfg.train, steps)
    plan *= np.array([injector.plan_scale(x) for x in range(steps)])
    if jax.process_index() == 0:
        run.register_lr_plan(plan, start_step=rs.start)
    rs.lr_plan = plan


def finish(rs: RunState) -> dict:
    """The last checkpoint complete, then the summary (summary.json and the ``end`` event)."""
    phase("checkpoint")
    say("waiting for the last checkpoint to be complete", rs.progress and rs.ckpts.saving())
    rs.ckpts.close()  # the run never ends with a save in flight
    phase("summary")
    summary = summarize(rs.run, rs.cfg, rs.peak, rs.peak_source)
    rs.run.summary.write_text(json.dumps(summary, indent=1))
    rs.run.event("end", step=rs.steps, summary=summary)
    return summary
