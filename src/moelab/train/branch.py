"""Branching a run: a new run that starts from another run's checkpoint with a new schedule.

A ladder learns how the loss depends on the horizon cheaply this way: one warmup-stable run per
size, and decays branched from its checkpoints, each a run of its own at a shorter horizon. The
branch is the parent's config with a new horizon from the branch step on (a ``train.replans``
entry, as `moelab replan` writes one, so the schedule, the mixture's phases and the forecasts read
it like any re-plan) and, at most, other fields that change nothing before that step (its decay
fraction or floor, when and what it logs, evaluates and checkpoints; its RoPE scaling while no step
before the branch ran at a longer context than the first phase's). The rate it applies before the
branch step must be the parent's, step for step, or it is refused: the shared prefix is one run.

The branch's directory starts as a copy of the parent's checkpoint at the step and the parent's
records up to it (metrics, so that its curve is whole), and a ``branch`` event that names the
parent, the step and the parent's config hash; training then resumes from that checkpoint. A fit
that holds both parent and branch counts the prefix once (``branch_point``, in moelab.runs: a
run folder's own record, read by the forecasts too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from moelab.config import Config, config_hash, load_config, phase_seq_lens, resolve_dtype, to_dict
from moelab.errors import RunRefused
from moelab.runs import RunDir, branch_point, load_run_config
from moelab.schedule import hyper, lr_factor, phase_boundaries
from moelab.train import checkpoint

# what a branch may change besides its horizon: nothing here alters a step before the branch point
# (the schedule's fields are checked step by step below)
MAY_CHANGE = {
    "train.steps", "train.replans", "train.decay_frac", "train.min_lr_ratio", "train.eval_every",
    "train.log_every", "train.checkpoint_every", "train.keep_last", "train.keep_every", "train.keep_steps",
    "train.forecast_update_every", "train.trackers", "train.tracker_project", "train.tracker_entity",
    "train.tracker_mode",
}  # fmt: skip


def _diff(a: Config, b: Config) -> list[str]:
    x, y = to_dict(a), to_dict(b)
    return [f"{s}.{k}" for s in x if isinstance(x[s], dict) for k in x[s] if x[s][k] != y[s].get(k)]


def _rates(cfg: Config, upto: int) -> np.ndarray:
    import jax.numpy as jnp

    h = hyper(cfg)
    return h.peak_lr * np.asarray(lr_factor(jnp.arange(upto), h), np.float64)


def _unused_before(cfg: Config, at: int) -> set[str]:
    """Fields that change no step before ``at``: the RoPE scaling while every step so far ran at the
    first phase's length (so branches can try scalings from a context change on)."""
    lens = phase_seq_lens(cfg)
    starts = phase_boundaries(cfg.data.phase_starts, cfg.train)
    return {"model.rope_scaling"} if all(n == lens[0] for n, b in zip(lens, starts, strict=True) if b < at) else set()


def branch_config(parent: Config, at: int, steps: int, overrides: list[str] = (), name: str = "") -> Config:
    """The parent's config with a horizon of ``steps`` from step ``at`` on (and ``overrides``, which
    may change only what leaves every step before ``at`` as it was); RunRefused, one line, otherwise."""
    if not 0 < at < parent.train.steps:
        raise RunRefused(
            f"--at: the branch step must lie inside the parent's run (1..{parent.train.steps - 1}), got {at}"
        )
    if steps <= at:
        raise RunRefused(f"--steps: the branch's horizon must be past its branch step {at}, got {steps}")
    spec = f"{at}:{parent.train.steps}->{steps}"
    base = load_config(parent, list(overrides))
    cfg = load_config(base, [f"train.steps={steps}", f"train.replans=[{', '.join((*base.train.replans, spec))}]"])
    changed = [f for f in _diff(parent, cfg) if f not in MAY_CHANGE and f not in _unused_before(parent, at)]
    if changed:
        raise RunRefused(
            f"--set {changed[0]}: a branch shares the parent's run up to step {at}; only its horizon and "
            f"{', '.join(sorted(f.split('.')[1] for f in MAY_CHANGE - {'train.steps', 'train.replans'}))} may change"
        )
    before, after = _rates(parent, at), _rates(cfg, at)
    off = np.flatnonzero(~np.isclose(before, after, rtol=1e-6, atol=0.0))
    if len(off):
        k = int(off[0])
        raise RunRefused(
            f"--set: the branch's learning rate before step {at} differs from the parent's (step {k}: {after[k]:.6g} "
            f"against {before[k]:.6g}); change only what comes after the branch step"
        )
    return dataclasses.replace(cfg, name=name or f"{parent.name or 'run'}-branch{at}-{steps}")


OWN = ("ckpt", "metrics.jsonl", "config.json", "tokenizer.json")  # what a branch's start writes


def start_branch(parent_dir: str | Path, at: int, out: str | Path, cfg: Config) -> Path:
    """Lay out the branch's directory: the parent's checkpoint at ``at``, its metrics up to it, the
    branch's config, and last the ``branch`` event: a start that died before it is started again
    (its partial copies replaced); ``out`` may hold nothing else but a failed step's error.txt."""
    parent = RunDir(parent_dir)
    pcfg = load_run_config(parent.path)
    saved = checkpoint.steps(parent.ckpt)
    if at not in saved:
        raise RunRefused(
            f"--at: {parent.path} has no checkpoint at step {at} (have: {', '.join(map(str, saved)) or 'none'}); "
            "train the parent with train.keep_steps naming the branch steps"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunRefused(f"--out: {out} is a file; a branch starts in a new directory")
    if branch_point(out) is not None:
        raise RunRefused(f"--out: {out} already holds a branch; resume it with `moelab train --resume --out {out}`")
    strangers = [
        p.name for p in (out.iterdir() if out.exists() else []) if p.name not in (*OWN, "error.txt", ".branching")
    ]
    if strangers:
        raise RunRefused(f"--out: {out} holds {strangers[0]}; a branch starts in a new or empty directory")
    src = parent.ckpt / f"step_{at:08d}"
    meta = checkpoint.read_meta(src)
    tmp = out / ".branching"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "ckpt").mkdir(parents=True)
    shutil.copytree(src, tmp / "ckpt" / src.name)
    with open(parent.metrics, "rb") as fh:  # the parent's records as they stood when it saved that step
        (tmp / "metrics.jsonl").write_bytes(fh.read(meta["metrics_cursor"]))
    cfg = resolve_dtype(cfg)  # as the run records it (compute_dtype auto resolved here)
    (tmp / "config.json").write_text(json.dumps({"hash": config_hash(cfg), "config": to_dict(cfg)}, indent=1))
    if (parent.path / "tokenizer.json").is_file():
        shutil.copyfile(parent.path / "tokenizer.json", tmp / "tokenizer.json")
    RunDir(tmp).event("branch", parent=str(parent.path.resolve()), parent_config_hash=config_hash(pcfg), step=at,
                      parent_steps=pcfg.train.steps, steps=cfg.train.steps, spec=cfg.train.replans[-1])  # fmt: skip
    for name in OWN:  # a start that died part-way left copies: replace them
        old = out / name
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
        if (tmp / name).exists():
            os.replace(tmp / name, old)
    os.replace(tmp / "events.jsonl", out / "events.jsonl")  # last: from here on the folder is a branch
    shutil.rmtree(tmp)
    return out
