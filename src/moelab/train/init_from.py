"""Fine-tuning from a finished run: ``train.init_from = "RUN:STEP"`` starts a run from the weights of
RUN's checkpoint at STEP (the parameters and the router's balancing biases) with the run's own
optimizer, freshly initialised, its own schedule from step 0 and its own data.

``train.init_from = "hf:DIR"`` starts from a Hugging Face folder in the layout `moelab export hf` writes
(config.json of model_type moelab, model.safetensors; ``moelab.model.hf_layout``): its weights and
router biases, its config's shape fields compared with this model's first, and the file's SHA-256 on
the event.

The parent's model must have this run's shapes: the parameters are compared leaf by leaf before
anything is written, and a difference is refused naming the model fields that differ. Fields that
leave every shape alone (the context, RoPE, the dispatch, capacity, the dropout of the router) may
change. The run records an ``init_from`` event with the parent's folder, step and config hash, and a
lab step that fine-tunes names its parent as a dependency (``moelab.lab.steps.finetune_step``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from moelab.config import Config, config_hash, to_dict
from moelab.errors import RunRefused, UsageError
from moelab.model.hf_layout import WEIGHTS, from_hf, shape_fields
from moelab.runs import load_run_config
from moelab.train import checkpoint, optim
from moelab.train.step import init_train_state


def init_overrides(spec: str, cfg: Config, flag: str = "--init-from") -> list[str]:
    """``RUN[:STEP]`` as overrides of ``cfg``: train.init_from with the step named (the newest checkpoint
    by default) and, where ``cfg`` trains its own tokenizer, the parent's (its token ids)."""
    if _is_hf(Path(spec)):  # a Hugging Face folder: its weights, its tokenizer
        out = [f"train.init_from=hf:{Path(spec).resolve()}"]
        return out + ([f"data.tokenizer={Path(spec).resolve()}"] if not cfg.data.tokenizer else [])
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


def _is_hf(path: Path) -> bool:
    """A folder of a Hugging Face model (config.json with a model_type), not a moelab run's."""
    try:
        return path.is_dir() and "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _hf_dir(cfg: Config) -> Path | None:
    return Path(cfg.train.init_from[3:]) if cfg.train.init_from.startswith("hf:") else None


def check_hf(cfg: Config, where: Path) -> dict:
    """An export's config.json, after checking that it is moelab's layout with this model's shapes and
    that its weights hold every tensor at its shape (read from the file's header); RunRefused in one line."""
    from safetensors import safe_open

    flag = f"train.init_from: {where}"
    try:
        hf = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RunRefused(f"{flag}: no readable config.json ({e.__class__.__name__})") from None
    if hf.get("model_type") != "moelab":
        raise RunRefused(f"{flag}: a {hf.get('model_type')!r} model; moelab starts from its own layout only "
                         "(a folder `moelab export hf` wrote)")  # fmt: skip
    differ = [f"{k} ({hf.get(k)} there, {v} here)" for k, v in shape_fields(cfg.model).items() if hf.get(k) != v]
    if differ:
        raise RunRefused(f"{flag}: its weights do not fit this model; they differ in {', '.join(differ)}")
    if not (where / WEIGHTS).is_file():
        raise RunRefused(f"{flag}: no {WEIGHTS}")
    with safe_open(str(where / WEIGHTS), framework="numpy") as fh:
        shapes = {k: np.empty(fh.get_slice(k).get_shape(), np.bool_) for k in fh.keys()}  # noqa: SIM118
    try:
        from_hf(shapes, cfg.model)
    except ValueError as e:
        raise RunRefused(f"{flag}/{WEIGHTS}: {e}") from None
    return hf


def parent_of(cfg: Config) -> tuple[Path, int]:
    """(the parent's run folder, the checkpoint step) of ``train.init_from``."""
    run, _, step = cfg.train.init_from.rpartition(":")
    return Path(run), int(step)


def _abstract(cfg: Config):
    return jax.eval_shape(lambda: init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg))))


def check_parent(cfg: Config) -> Config | None:
    """The parent's config (None for a Hugging Face folder), after checking (before anything is written) that its checkpoint exists and
    its parameters have this run's shapes; RunRefused in one line otherwise."""
    if (where := _hf_dir(cfg)) is not None:
        check_hf(cfg, where)
        return None
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
    if parent is None:  # train.init_from hf:DIR
        saved, event = _load_hf(cfg)
    else:
        run, step = parent_of(cfg)
        saved, _ = checkpoint.restore(Path(run) / "ckpt", step, _abstract(parent))
        event = {"parent": str(run), "step": step, "parent_config_hash": config_hash(parent)}

    def place(new, like):  # the parent's arrays where this run keeps its own (its devices, its sharding)
        return jax.device_put(new.astype(like.dtype), like.sharding) if hasattr(like, "sharding") else new

    params = jax.tree.map(place, saved["params"], state["params"])
    model_state = jax.tree.map(place, saved["model_state"], state["model_state"])
    opt_state = jax.jit(opt.init)(params)
    opt_state = jax.tree.map(lambda new, like: jax.device_put(new, like.sharding), opt_state, state["opt_state"])
    return {"params": params, "opt_state": opt_state, "model_state": model_state}, event


def _load_hf(cfg: Config) -> tuple[dict, dict]:
    """The parameters and model state in an export's model.safetensors, and the event's fields."""
    from safetensors.numpy import load_file

    where = _hf_dir(cfg)
    hf = check_hf(cfg, where)
    path = where / WEIGHTS
    params, bias = from_hf(load_file(str(path)), cfg.model)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    event = {"parent": str(where), "step": hf.get("moelab_step"), "format": "hf", "sha256": digest.hexdigest()}
    return {"params": params, "model_state": {"router_bias": bias}}, event
