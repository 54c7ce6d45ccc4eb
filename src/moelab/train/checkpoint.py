"""Checkpoints: Orbax writes the arrays; moelab makes the save atomic and durable and keeps last K + every M.

A checkpoint is ``ckpt/step_XXXXXXXX`` holding ``state/`` (Orbax) and ``meta.json``. It is
written as ``step_XXXXXXXX.partial``, its files and folders synced to disk, and renamed when
complete (the parent folder synced after), so a crash during a save leaves only a ``.partial``
folder, which is never loaded and is cleared by the next save. A checkpoint saved again at the
same step replaces the old one by two renames (the old one set aside as ``.replaced`` first, then
removed), so there is no moment without a complete checkpoint. A resume that finds the newest
checkpoint damaged says so and falls back to the newest one that restores (``restore_newest``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax

STEP_DIR = re.compile(r"^step_(\d{8})(\.replaced)?$")


def _dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.exists():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name):  # step_N before step_N.replaced
        m = STEP_DIR.match(p.name)
        if m and (p / "meta.json").exists() and (p / "state").exists():
            found.setdefault(int(m.group(1)), p)
    return sorted(found.items())


def _fsync_tree(path: Path) -> None:
    """Every file and folder under ``path`` (and ``path``) synced to disk."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_tree(partial)  # durable before it is named complete
        old = root / f"step_{step:08d}.replaced"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)  # still found (as .replaced) until the new one is in place
        os.rename(partial, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
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


def restore_newest(root: Path, abstract_state, damaged=None) -> tuple[object, dict, int] | None:
    """The newest checkpoint that restores: (state, meta, step), or None when there is none. A damaged
    one (cut short, a file missing or unreadable) is skipped; ``damaged(step, reason)`` hears of each."""
    for step in reversed(steps(root)):
        try:
            state, meta = restore(root, step, abstract_state)
            return state, meta, step
        except Exception as exc:  # Orbax and the file system raise many kinds; any means it cannot be used
            if damaged is not None:
                damaged(step, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return None


def restore(root: Path, step: int, abstract_state) -> tuple[object, dict]:
    import orbax.checkpoint as ocp

    path = dict(_dirs(root)).get(step, root / f"step_{step:08d}")
    meta = json.loads((path / "meta.json").read_text())
    # restored onto the template's devices and shardings: a checkpoint saved under one mesh loads under another
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state
    )
    state = ocp.StandardCheckpointer().restore((path / "state").absolute(), abstract)
    return state, meta
