"""Use what you trained: a run's checkpoint as weights and a tokenizer, for sampling and export.

``load_trained`` restores a checkpoint's parameters and router biases (not the optimiser's state
alone: Orbax restores the whole train state, shaped by ``jax.eval_shape``, nothing initialised) and
finds the run's tokenizer: ``tokenizer.json`` in the run directory (written by ``moelab train``), or
for a run trained before that, the token store's, rebuilt from the run's data sources if it is gone.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax

from moelab.config import Config
from moelab.data.store import build_store
from moelab.errors import RunRefused
from moelab.runs import RunDir, load_run_config
from moelab.train import checkpoint, optim
from moelab.train.step import init_train_state


class Trained(NamedTuple):
    cfg: Config
    params: dict  # numpy-backed jax arrays, fp32
    model_state: dict  # {"router_bias": [layers, experts]}
    step: int
    tokenizer_path: Path


def checkpoint_step(run_dir: str | Path, step: int | None) -> int:
    """The newest complete checkpoint's step, or ``step`` if it is one; else one line, RunRefused."""
    run = RunDir(run_dir)
    saved = checkpoint.steps(run.ckpt)
    if not saved:
        raise RunRefused(
            f"{run.ckpt}: no complete checkpoint; train the run (it saves every train.checkpoint_every steps)"
        )
    if step is None:
        return saved[-1]
    if step not in saved:
        raise RunRefused(f"--checkpoint {step}: no such checkpoint in {run.ckpt} (have: {', '.join(map(str, saved))})")
    return step


def tokenizer_of(run_dir: str | Path, cfg: Config, progress: bool = True) -> Path:
    path = Path(run_dir) / "tokenizer.json"
    if path.is_file():
        return path
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    return build_store(cfg.data, cfg.model.vocab_size, progress=progress).path / "tokenizer.json"


def load_trained(run_dir: str | Path, step: int | None = None, progress: bool = True) -> Trained:
    cfg = load_run_config(run_dir)
    step = checkpoint_step(run_dir, step)
    opt = optim.make_optimizer(cfg, optim.hyper(cfg))
    abstract = jax.eval_shape(lambda: init_train_state(cfg, opt))
    state, _ = checkpoint.restore(RunDir(run_dir).ckpt, step, abstract)
    return Trained(cfg, state["params"], state["model_state"], step, tokenizer_of(run_dir, cfg, progress))
