"""Checkpoints: Orbax's CheckpointManager saves them, in the background while training goes on, and
keeps the newest K, every M-th and the steps asked for; moelab makes local saves durable, replaces a
step saved again without a gap, and falls back past a damaged checkpoint on resume.

The folder (``train.checkpoint_dir``; by default ``<run>/ckpt``) is any path Orbax's file layer
writes: a local folder, or an object store such as ``gs://bucket/run`` (etils' epath for files,
TensorStore's drivers for arrays). It holds::

    step_XXXXXXXX/                a complete checkpoint; nothing else is ever loaded
        state/                    the train state's arrays (Orbax, OCDBT)
        meta/meta.json            step, metrics cursor, skipped steps, NaN guard, config hash, seed
        _CHECKPOINT_METADATA      Orbax's record of the save
        commit_success.txt        written last: on an object store, the mark that the save completed
    step_XXXXXXXX.orbax-checkpoint-tmp   a save under way, or cut short (cleared when a run opens the folder)
    step_XXXXXXXX.replaced        the old checkpoint of a step saved again, until the new one is complete
    step_XXXXXXXX.damaged         one a resume found damaged, kept for a look

What holds:

- A checkpoint is complete or absent: its arrays and meta are written into one temporary folder
  that is named complete at once; on a local disk by Orbax's rename, made after every file and
  folder in it is synced (and the folder and its parent synced after, so the rename is durable
  too); on an object store by Orbax's commit file, written last (only it says complete there).
- There is no moment without a complete checkpoint: old ones are pruned only after the new one is
  complete, and a step saved again first sets its old checkpoint aside as ``.replaced``, which
  counts and restores until the new one is complete (a run opening the folder puts it back if the
  new one never completed).
- A background save returns once the arrays are copied off the device; the next save, ``wait`` and
  ``close`` wait for it (and raise its error, if it failed). ``on_complete`` hears of each save once
  it is complete, on the caller's thread (``poll``, ``wait``, the next ``save``).
- A resume takes the newest checkpoint that restores (``restore_newest``); ``damaged(step, reason)``
  hears of each one skipped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import jax

from moelab.errors import RunRefused
from moelab.paths import as_path, is_local
from moelab.train.ckpt_writer import ProcessWriter

STEP_DIR = re.compile(r"^step_(\d{8})(\.replaced)?$")
COMMIT = "commit_success.txt"  # Orbax's commit file (atomicity.COMMIT_SUCCESS_FILE)
META = "meta.json"
TMP = ".orbax-checkpoint-tmp"  # Orbax's temporary folders (atomicity.TMP_DIR_SUFFIX)


def _complete(p) -> bool:
    """A folder named like a checkpoint that holds one: Orbax's commit file, or (moelab's earlier
    layout, named complete by its rename) state/ beside meta.json."""
    return (p / COMMIT).exists() or ((p / META).exists() and (p / "state").exists())


def _dirs(root) -> list[tuple[int, object]]:
    root = as_path(root)
    if not root.exists():
        return []
    found: dict[int, object] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name):  # step_N before step_N.replaced
        m = STEP_DIR.match(p.name)
        if m and _complete(p):
            found.setdefault(int(m.group(1)), p)
    return sorted(found.items())


def steps(root) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    return [s for s, _ in _dirs(root)]


def read_meta(path) -> dict:
    """A checkpoint folder's meta (``meta/meta.json``, or ``meta.json`` in the earlier layout)."""
    path = as_path(path)
    f = path / "meta" / META
    return json.loads((f if f.exists() else path / META).read_text())


def meta_of(root, step: int) -> dict:
    """The meta of the checkpoint at ``step`` in ``root``."""
    return read_meta(dict(_dirs(root)).get(step, as_path(root) / f"step_{step:08d}"))


class ShapeMismatch(RunRefused):
    """A checkpoint whose arrays have other shapes than the state asked for: the config differs from
    the one it was saved with (not damage: its files are sound, and it is left as it is)."""


def _shapes(tree) -> dict[str, tuple]:
    """Each array's path (its keys and attribute names, joined by /) and shape."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        out[name] = tuple(getattr(leaf, "shape", ()))
    return out


def check_shapes(path, abstract_state) -> None:
    """ShapeMismatch when an array the state holds has another shape in the checkpoint at ``path`` (as
    Orbax's metadata records it); an unreadable metadata is left to the restore to report."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        handler = ocp.PyTreeCheckpointHandler()  # the arrays' own metadata (not the step's: no warning)
        try:
            md = handler.metadata(epath.Path(str(_abs(path / "state"))))
        finally:
            handler.close()
        saved = _shapes(getattr(md, "tree", md))
    except Exception:  # noqa: BLE001 - the restore that follows says what is wrong with its files
        return
    want = _shapes(abstract_state)
    order = sorted(want, key=lambda k: not k.startswith("params"))  # the weights first, then the optimizer's
    bad = [f"{k} {list(saved[k])} there, {list(want[k])} here" for k in order if k in saved and saved[k] != want[k]]
    if bad:
        raise ShapeMismatch(
            f"{path}: saved from another config: {len(bad)} arrays differ in shape ({'; '.join(bad[:2])}"
            f"{'; ...' if len(bad) > 2 else ''}); resume with the config it was saved with (the checkpoint is left as it is)"
        )


def restore(root, step: int, abstract_state) -> tuple[object, dict]:
    """(state, meta) of the checkpoint at ``step``, the arrays placed as ``abstract_state``'s are (its
    devices and shardings: a checkpoint saved under one mesh loads under another). ShapeMismatch when
    its arrays have other shapes than ``abstract_state``'s."""
    import orbax.checkpoint as ocp

    path = dict(_dirs(root)).get(step, as_path(root) / f"step_{step:08d}")
    meta = read_meta(path)
    check_shapes(path, abstract_state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state
    )
    # read by path, not through the manager, so that a .replaced checkpoint and the earlier layout restore too
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(_abs(path / "state"), abstract)
    return state, meta


def restore_newest(root, abstract_state, damaged=None) -> tuple[object, dict, int] | None:
    """The newest checkpoint that restores: (state, meta, step), or None when there is none. A damaged
    one (cut short, a file missing or unreadable) is skipped; ``damaged(step, reason)`` hears of each."""
    for step in reversed(steps(root)):
        try:
            state, meta = restore(root, step, abstract_state)
            return state, meta, step
        except ShapeMismatch:  # another config's checkpoint, not a damaged one
            raise
        except Exception as exc:  # Orbax and the file system raise many kinds; any means it cannot be used
            if damaged is not None:
                damaged(step, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return None


def _abs(p):
    return p.absolute() if isinstance(p, Path) else p


# ---------------------------------------------------------------------- durability on a local disk


def _fsync_tree(path) -> None:
    """Every file and folder under ``path`` (and ``path``) synced to disk."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            _fsync(os.path.join(dirpath, f))
        _fsync(dirpath)


def _fsync_top(path) -> None:
    """The files directly in ``path``, and ``path``, synced to disk (not its sub-folders)."""
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            _fsync(entry.path)
    _fsync(path)


def _fsync(path) -> None:
    """A file or a folder synced to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage(name: str, step: int) -> None:
    """A point inside a save, for tests that stop a save there: start (nothing written), set_aside
    (an old checkpoint of the step renamed .replaced), written (arrays and meta in the temporary
    folder), synced (synced, not yet renamed), committed (named complete and synced; not yet pruned)."""


def _temporary_path_class(local: bool, hook: Callable[[str, int], None]):
    """Orbax's temporary folder, named complete as described above; ``hook("in_save", step)`` runs
    when the arrays and meta are written and the checkpoint is not yet complete (tests kill it there).

    Public Orbax only: the classes are ``orbax.checkpoint.path.atomicity``'s (in Orbax's API
    reference), given through ``CheckpointManagerOptions.temporary_path_class``, the way that module's
    docstring configures them. Each wraps Orbax's own ``finalize`` (its commit: the commit time in
    ``_CHECKPOINT_METADATA``, the commit file, the rename) and adds nothing inside it. Why this
    option: its replacement, ``atomicity_options``, picks only between Orbax's two classes, and a
    handler's ``finalize`` runs before the commit with no point after it; neither can sync the
    parent folder after the rename and before pruning, nor stop a save at ``in_save`` (upstream
    limit, orbax-checkpoint 0.12). Were the option dropped, ``Checkpoints()`` fails at once with a
    TypeError (tests/test_checkpoint.py)."""
    from orbax.checkpoint.path import atomicity

    def step_of(final) -> int | None:  # None: an item's folder inside a step's (state/, meta/)
        m = STEP_DIR.match(final.name)
        return int(m.group(1)) if m else None

    class DurableRename(atomicity.AtomicRenameTemporaryPath):
        """Orbax's rename, with every file and folder synced before it, and the folder and its parent
        after. What Orbax's commit writes just before its rename (the commit time into
        ``_CHECKPOINT_METADATA``; in later releases, 0.12.8 for one, ``commit_success.txt`` again)
        is synced after it, before the save counts as complete or anything is pruned. A crash in
        between can leave a renamed folder whose ``_CHECKPOINT_METADATA`` is short, which Orbax reads
        as none: state/ and meta/, all that a restore reads, and the commit file were synced before
        the rename."""

        async def finalize(self):
            tmp, final = self.get(), self.get_final()
            step = step_of(final)
            if step is None:  # synced with the step's folder
                return await super().finalize()
            hook("in_save", step)
            _stage("written", step)
            # the commit file in every Orbax release moelab allows (0.12.0's commit writes none), synced
            # with the rest: its text is what Orbax's later releases write there themselves
            (tmp / COMMIT).write_text(f"Checkpoint commit was successful to {final}")
            await asyncio.to_thread(_fsync_tree, os.fspath(tmp))
            _stage("synced", step)
            await super().finalize()
            await asyncio.to_thread(_fsync_top, os.fspath(final))
            await asyncio.to_thread(_fsync, os.fspath(final.parent))
            _stage("committed", step)

    class CommitFile(atomicity.CommitFileTemporaryPath):
        """Orbax's commit file (an object store has no rename): written last, after every object."""

        async def finalize(self):
            step = step_of(self.get_final())
            if step is None:
                return await super().finalize()
            hook("in_save", step)
            _stage("written", step)
            await super().finalize()
            _stage("committed", step)

    return DurableRename if local else CommitFile


# ---------------------------------------------------------------------- a run's checkpoints


class Checkpoints:
    """One run's checkpoint folder, saved through Orbax's CheckpointManager.

    ``background``: ``save`` returns once the arrays are copied off the device and the writing goes
    on in a thread; otherwise it returns when the checkpoint is complete. Retention: the newest
    ``keep_last`` (all when 0), every ``keep_every``-th step (none when 0) and ``keep_steps`` stay;
    the others go once a newer checkpoint is complete. ``on_complete(info)`` hears of each complete
    save (step, path, started, completed, seconds, background), on the caller's thread.
    ``fault_hook(point, step)``: see ``_temporary_path_class``. ``writer``: ``thread`` (Orbax's own
    background thread) or ``process`` (``moelab.train.ckpt_writer``: a process at idle priority
    writes each save, from a copy of the state in shared memory, through a Checkpoints of its own)."""

    def __init__(
        self,
        root,
        keep_last: int = 1,
        keep_every: int = 0,
        keep_steps: Iterable[int] = (),
        background: bool = True,
        on_complete: Callable[[dict], None] | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
        writer: str = "thread",
    ):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as pp

        self.root, self.local, self.background = as_path(root), is_local(root), background
        self.on_complete, self.fault_hook = on_complete, fault_hook
        self.primary = jax.process_index() == 0  # in a multi-process job every process writes its shards
        self._pending: dict | None = None  # the save in flight
        self.writer = None  # writer "process": the saves go to moelab.train.ckpt_writer's process
        if writer == "process":
            if fault_hook is not None:
                raise ValueError("a fault hook inside a save needs the thread writer (train.checkpoint_writer: thread)")
            self.writer = ProcessWriter(functools.partial(Checkpoints, root, keep_last, keep_every, tuple(keep_steps),
                                                          background=False))  # fmt: skip
        elif writer != "thread":
            raise ValueError(f"train.checkpoint_writer: must be thread or process, got {writer!r}")
        if self.primary:
            self.root.mkdir(parents=True, exist_ok=True)
            self._recover()
        _sync("ckpt-open")
        self.manager = None
        if self.writer is not None:  # the writer's own Checkpoints holds the manager
            return
        keep = [pp.LatestN(n=keep_last or None), pp.CustomSteps(steps=list(keep_steps))]
        if keep_every:
            keep.append(pp.EveryNSteps(interval_steps=keep_every))
        options = ocp.CheckpointManagerOptions(
            step_name_format=ocp.step.standard_name_format(step_prefix="step", step_format_fixed_length=8),
            preservation_policy=pp.AnyPreservationPolicy(policies=keep),
            enable_async_checkpointing=background,
            temporary_path_class=_temporary_path_class(self.local, self._hook),
            save_root_metadata=False,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(META)}
        self.manager = ocp.CheckpointManager(_abs(self.root), options=options, item_handlers=handlers)

    def _hook(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    def _recover(self) -> None:
        """What a process that died during a save left: its temporary folder (and moelab's earlier
        ``.partial`` ones; on an object store, step folders without a commit file) removed; a .replaced
        checkpoint whose successor never completed put back, one whose successor did removed."""
        if not self.root.exists():  # an object store has no empty folders
            return
        for p in list(self.root.iterdir()):
            if (
                p.name.endswith(".partial")
                or TMP in p.name
                or (not self.local and STEP_DIR.match(p.name) and not p.name.endswith(".replaced") and not _complete(p))
            ):
                _rmtree(p)
        for p in list(self.root.iterdir()):
            if p.name.endswith(".replaced") and STEP_DIR.match(p.name):
                final = p.with_name(p.name.removesuffix(".replaced"))
                if final.exists():
                    _rmtree(p)
                else:
                    p.rename(final)
                    if self.local:
                        _fsync(self.root)

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first (a save in flight is waited for)."""
        self.wait()
        return steps(self.root)

    def save(self, step: int, state, meta: dict) -> None:
        """Start (background) or make the checkpoint of ``step``: ``state``'s arrays and ``meta``."""
        import orbax.checkpoint as ocp

        self.wait()  # one save at a time
        if self.writer is not None:  # set aside, written and pruned there, as below
            self._pending = {"step": step, "started": time.time(), "replaced": None}
            self.writer.send(step, state, meta)
            if not self.background:
                self.wait()
            return
        final = self.root / f"step_{step:08d}"
        old = final.with_name(final.name + ".replaced")
        _stage("start", step)
        if final.exists():  # saved again: the old one set aside, and counted, until the new one is complete
            if self.primary:
                if old.exists():
                    _rmtree(old)
                final.rename(old)
                if self.local:
                    _fsync(self.root)
            _sync(f"ckpt-aside-{step}")
            self.manager.reload()
            _stage("set_aside", step)
        self._pending = {"step": step, "started": time.time(), "replaced": old if old.exists() else None}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)
        if not self.background:
            self.wait()

    def poll(self) -> None:
        """Report a background save that has completed (never waits)."""
        if self._pending is not None and not self.in_flight():
            self.wait()

    def in_flight(self) -> bool:
        """Whether a save is still being written (complete ones not yet reported are not)."""
        if self.writer is not None:
            return self._pending is not None and not self.writer.ready()
        return self.manager.is_saving_in_progress()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and report it; its error, if it failed, is raised here."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        if self.writer is not None:
            self.writer.result()  # raises the writer's error
        else:
            self.manager.wait_until_finished()  # raises the background save's error
            self.manager.check_for_errors()
        if self.primary and pending["replaced"] is not None and pending["replaced"].exists():
            _rmtree(pending["replaced"])
        _sync(f"ckpt-done-{pending['step']}")
        now = time.time()
        if self.on_complete is not None:
            self.on_complete(
                {
                    "step": pending["step"],
                    "path": str(self.root / f"step_{pending['step']:08d}"),
                    "started": pending["started"],
                    "completed": now,
                    "seconds": now - pending["started"],
                    "background": self.background,
                }
            )

    def saving(self) -> bool:
        """Whether a save is in flight (or complete and not yet reported)."""
        return self._pending is not None

    def abandon(self) -> None:
        """``close`` for a run that is failing: waits all the same, and raises nothing (the run's own
        error is the one to report; a save that failed left no checkpoint)."""
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Wait for the save in flight and release Orbax's threads."""
        try:
            self.wait()
        finally:
            if self.writer is not None:
                self.writer.close()
            else:
                self.manager.close()


def _rmtree(p) -> None:
    if isinstance(p, Path):
        import shutil

        shutil.rmtree(p, ignore_errors=True)
    else:
        p.rmtree(missing_ok=True)


def save(root, step: int, state, meta: dict, keep_last: int, keep_every: int, fault_hook=None, keep_steps=()) -> object:
    """One synchronous save (the checkpoint complete on return); returns its folder."""
    ckpts = Checkpoints(root, keep_last, keep_every, keep_steps, background=False, fault_hook=fault_hook)
    try:
        ckpts.save(step, state, meta)
    finally:
        ckpts.close()
    return as_path(root) / f"step_{step:08d}"


def _sync(name: str) -> None:
    """A barrier across the processes of a multi-process job (nothing in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
