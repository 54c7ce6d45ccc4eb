"""Checkpoints: Orbax writes the arrays; moelab makes the save atomic and keeps last K + every M.

A checkpoint is ``ckpt/step_XXXXXXXX`` holding ``state/`` (Orbax) and ``meta.json``. It is
written as ``step_XXXXXXXX.partial`` and renamed when complete, so a crash during a save leaves
only a ``.partial`` folder, which is never loaded and is cleared by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.exists():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "meta.json").exists() and (p / "state").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    return [s for s, _ in _dirs(root)]


def save(
    root: Path, step: int, state, meta: dict, keep_last: int, keep_every: int, fault_hook=None, keep_steps=()
) -> Path:
    import orbax.checkpoint as ocp

    primary = jax.process_index() == 0  # in a multi-process job every process saves its shards
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    if primary:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    _sync(f"ckpt-start-{step}")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save((partial / "state").absolute(), state)
    ckptr.wait_until_finished()
    _sync(f"ckpt-written-{step}")
    if fault_hook is not None:
        fault_hook("in_save", step)  # tests kill the process here: arrays written, not yet complete
    if primary:
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        _prune(root, keep_last, keep_every, keep_steps)
    _sync(f"ckpt-done-{step}")
    return final


def _sync(name: str) -> None:
    """A barrier across the processes of a multi-process job (nothing in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _prune(root: Path, keep_last: int, keep_every: int, keep_steps=()) -> None:
    found = _dirs(root)
    newest = {s for s, _ in found[-keep_last:]}
    for s, p in found:
        if s in newest or (keep_every and s % keep_every == 0) or s in keep_steps:
            continue
        shutil.rmtree(p, ignore_errors=True)


def restore(root: Path, step: int, abstract_state) -> tuple[object, dict]:
    import orbax.checkpoint as ocp

    path = root / f"step_{step:08d}"
    meta = json.loads((path / "meta.json").read_text())
    # restored onto the template's devices and shardings: a checkpoint saved under one mesh loads under another
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state
    )
    state = ocp.StandardCheckpointer().restore((path / "state").absolute(), abstract)
    return state, meta
