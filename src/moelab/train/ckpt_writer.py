"""A checkpoint writer in a process of its own, at idle priority (``train.checkpoint_writer: process``).

Why: a background save's threads in the training process made the steps beside it 2-4x slower on a
2-core machine (benchmarks/results/checkpoint_async.json), and neither fewer writer threads, idle
scheduling of those threads, nor compression off removed it: the training threads' kernel time
tripled while the save ran, as both fault pages into one address space. A plain file write from
another process at idle priority cost the steps 3%.

How: ``send`` copies the state's arrays off the device into one block of shared memory (the part the
step waits for) and hands the writer its layout and the meta; the writer, started once with
``spawn`` at the first save, under ``SCHED_IDLE`` and killed with its parent, rebuilds the tree as
NumPy views of that block and saves it through the ``Checkpoints`` it was given (synchronously:
Orbax's CheckpointManager with the same durability, retention and replacement as the thread writer),
then answers. The block is released when the answer is read. One save at a time.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
from multiprocessing import get_context, resource_tracker, shared_memory

import jax
import numpy as np

ALIGN = 64  # each array's offset in the block


def layout(arrays: list[np.ndarray]) -> tuple[list[tuple], int]:
    """(shape, dtype, offset) of each array in one block, and the block's size."""
    specs, off = [], 0
    for a in arrays:
        specs.append((a.shape, a.dtype, off))
        off += -(-a.nbytes // ALIGN) * ALIGN
    return specs, max(off, 1)


def views(buf, specs: list[tuple]) -> list[np.ndarray]:
    return [np.ndarray(shape, dtype, buffer=buf, offset=off) for shape, dtype, off in specs]


def _fill(buf, specs: list[tuple], arrays: list[np.ndarray]) -> None:
    """The arrays copied into the block (the views die with this frame, so the block can close)."""
    for dst, src in zip(views(buf, specs), arrays, strict=True):
        dst[...] = src


class ProcessWriter:
    """The parent's side: ``send`` a save, ``ready`` whether its answer came, ``result`` waits for it
    (raises RuntimeError with the writer's error), ``close`` ends the writer. ``make`` builds the
    writer's ``Checkpoints`` (picklable: a ``functools.partial`` of the class)."""

    def __init__(self, make):
        if jax.process_count() > 1:
            raise ValueError("train.checkpoint_writer: process takes a single-process job; use thread")
        self.make, self.proc, self.conn, self.block = make, None, None, None

    def _start(self) -> None:
        ctx = get_context("spawn")
        here, there = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(there, self.make), name="moelab-ckpt-writer", daemon=True)
        self.proc.start()
        there.close()
        self.conn = here

    def send(self, step: int, state, meta: dict) -> None:
        if self.proc is None:
            self._start()
        leaves, treedef = jax.tree.flatten(state)
        arrays = [np.asarray(jax.device_get(x)) for x in leaves]
        specs, size = layout(arrays)
        self.block = shared_memory.SharedMemory(create=True, size=size)
        # its name is the writer's to remove (at once, once it has it mapped): a run killed in a save
        # leaves nothing behind in /dev/shm, and Python's resource tracker has nothing to warn about
        resource_tracker.unregister(self.block._name, "shared_memory")
        _fill(self.block.buf, specs, arrays)
        del arrays
        self.conn.send((step, self.block.name, specs, pickle.dumps(treedef), meta))

    def ready(self) -> bool:
        return self.conn is not None and self.conn.poll()

    def result(self) -> None:
        try:
            got = self.conn.recv()
        except EOFError:
            got = ("error", f"the checkpoint writer process ended (exit code {self.proc.exitcode})")
        finally:
            self._release()
        if got[0] != "done":
            raise RuntimeError(f"the checkpoint writer process: {got[1]}")

    def _release(self) -> None:
        if self.block is not None:
            self.block.close()
            try:  # the writer removed the name when it mapped the block; not if it never did
                shared_memory._posixshmem.shm_unlink(self.block._name)
            except FileNotFoundError:
                pass
            self.block = None

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout=60)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc = None
        self._release()


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG): never an orphan writing on."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _idle() -> None:
    """SCHED_IDLE for this process's thread (Orbax's and TensorStore's threads, made later, inherit it)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _save(ck, step: int, buf, specs: list[tuple], treedef, meta: dict) -> None:
    """The tree of views saved (they die with this frame, so the block can close after)."""
    ck.save(step, jax.tree.unflatten(treedef, views(buf, specs)), meta)


def serve(conn, make) -> None:
    """The writer: each request's tree saved through ``make()``'s Checkpoints, then ("done", step) or
    ("error", text); None or a closed pipe ends it."""
    _die_with_parent()
    _idle()
    jax.config.update("jax_platforms", "cpu")  # never the parent's accelerator
    ck = make()
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            step, name, specs, treedef, meta = msg
            block = shared_memory.SharedMemory(name=name)
            block.unlink()  # the name only (and its tracking): the memory stays while either side maps it
            try:
                _save(ck, step, block.buf, specs, pickle.loads(treedef), meta)
                conn.send(("done", step))
            except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            finally:
                block.close()
    finally:
        ck.close()
