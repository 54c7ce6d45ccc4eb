"""Fine-tuning from a finished run: ``train.init_from = "RUN:STEP"`` starts a run from the weights of
RUN's checkpoint at STEP (the parameters and the router's balancing biases) with the run's own
optimizer, freshly initialised, its own schedule from step 0 and its own data.

The parent's model must have this run's shapes: the parameters are compared leaf by leaf before
anything is written, and a difference is refused naming the model fields that differ. Fields that
leave every shape alone (the context, RoPE, the dispatch, capacity, the dropout of the router) may
change. The run records an ``init_from`` event with the parent's folder, step and config hash, and a
lab step that fine-tunes names its parent as a dependency (``moelab.lab.steps.finetune_step``).
"""

from __future__ import annotations

from pathlib import Path

import jax

from moelab.config import Config, config_hash, to_dict
from moelab.errors import RunRefused, UsageError
from moelab.runs import load_run_config
from moelab.train import checkpoint, optim
from moelab.train.step import init_train_state


def init_overrides(spec: str, cfg: Config, flag: str = "--init-from") -> list[str]:
    """``RUN[:STEP]`` as overrides of ``cfg``: train.init_from with the step named (the newest checkpoint
    by default) and, where ``cfg`` trains its own tokenizer, the parent's (its token ids)."""
    tail = spec.rpartition(":")[2]
    run, step = (spec.rpartition(":")[0], int(tail)) if tail.isdigit() and ":" in spec else (spec, None)
    load_run_config(run)  # refused in one line when it is not a run folder
    saved = checkpoint.steps(Path(run) / "ckpt")
    if not saved:
        raise UsageError(f"{flag} {spec}: {run} has no complete checkpoint")
    at = saved[-1] if step is None else step
    if at not in saved:
        raise UsageError(f"{flag} {spec}: no checkpoint at step {at} (have: {', '.join(map(str, saved))})")
    out = [f"train.init_from={Path(run).resolve()}:{at}"]
    if not cfg.data.tokenizer:
        out.append(f"data.tokenizer={Path(run).resolve()}")
    return out


def parent_of(cfg: Config) -> tuple[Path, int]:
    """(the parent's run folder, the checkpoint step) of ``train.init_from``."""
    run, _, step = cfg.train.init_from.rpartition(":")
    return Path(run), int(step)


def _abstract(cfg: Config):
    return jax.eval_shape(lambda: init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg))))


def check_parent(cfg: Config) -> Config:
    """The parent's config, after checking (before anything is written) that its checkpoint exists and
    its parameters have this run's shapes; RunRefused in one line otherwise."""
    run, step = parent_of(cfg)
    parent = load_run_config(run)  # refused in one line when it is not a run folder
    ckpt = Path(run) / "ckpt"
    saved = checkpoint.steps(ckpt)
    if step not in saved:
        have = ", ".join(map(str, saved)) or "none"
        raise RunRefused(f"train.init_from: {run} has no checkpoint at step {step} (have: {have})")
    mine, theirs = _abstract(cfg)["params"], _abstract(parent)["params"]
    shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), mine)
    if jax.tree.structure(mine) != jax.tree.structure(theirs) or shapes != jax.tree.map(
        lambda x: (x.shape, str(x.dtype)), theirs
    ):
        a, b = to_dict(cfg)["model"], to_dict(parent)["model"]
        fields = [f"model.{k} ({b[k]} there, {a[k]} here)" for k in a if a[k] != b.get(k)]
        raise RunRefused(
            f"train.init_from: {run}'s weights do not fit this model; they differ in {', '.join(fields) or 'shape'}"
        )
    return parent


def init_state(cfg: Config, state: dict, opt) -> tuple[dict, dict]:
    """``state`` (this run's fresh state, placed as the run places it) with the parent's parameters and
    model state, and the optimizer state initialised from them; and the ``init_from`` event's fields."""
    parent = check_parent(cfg)
    run, step = parent_of(cfg)
    saved, _ = checkpoint.restore(Path(run) / "ckpt", step, _abstract(parent))

    def place(new, like):  # the parent's arrays where this run keeps its own (its devices, its sharding)
        return jax.device_put(new.astype(like.dtype), like.sharding) if hasattr(like, "sharding") else new

    params = jax.tree.map(place, saved["params"], state["params"])
    model_state = jax.tree.map(place, saved["model_state"], state["model_state"])
    opt_state = jax.jit(opt.init)(params)
    opt_state = jax.tree.map(lambda new, like: jax.device_put(new, like.sharding), opt_state, state["opt_state"])
    event = {"parent": str(run), "step": step, "parent_config_hash": config_hash(parent)}
    return {"params": params, "opt_state": opt_state, "model_state": model_state}, event
