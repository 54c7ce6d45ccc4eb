"""The `moelab` process's start and end: it starts again with transparent huge pages for glibc's heap, so
XLA:CPU's per-step buffers are not faulted in 4 KiB at a time, and it leaves at once when its command is done.

XLA:CPU allocates a step's temporaries on every execution. glibc hands large blocks out with ``mmap``
and returns them on ``free``, so each step touches its memory anew: on shape A
(``benchmarks/profile_step.py``) about 155,000 page faults and a third of a second of kernel time per
step. With ``glibc.malloc.hugetlb=1`` (issue 29) the heap asks for 2 MiB transparent huge pages: about
770 faults per step, the step about 1.15x faster on 2 cores, and the same peak memory.

That still leaves, on shape B, 2,600 huge-page faults and 1.6-1.9 s of kernel time in an 8.2 s step
(issue 42). ``MOELAB_MALLOC=keep`` adds the tunables of ``KEEP``: one heap for every thread
(``arena_max=1``), large blocks from it rather than mapped apart (``mmap_max=0``), freed memory kept in
it (a 64 GiB trim threshold). No faults after the first step, and a shape-B step 12-20% faster; but
compilation and the tokenizer's training, whose many threads now share one heap, are much slower (a
cold first step 34 s against 47 s), and peak memory grows where the heap fragments (shape A +34%). So
it is a choice for long runs at large shapes, not the default (benchmarks/results/vs_transformers.json).

``MOELAB_MALLOC`` chooses: ``hugepages`` (the default), ``keep`` or ``system`` (glibc as it is). A
tunable is read when the process starts, so the ``moelab`` command starts itself again with them set
(once, before anything heavy is imported), and the processes it starts inherit them. Other C libraries
and kernels without transparent huge pages are left alone.

At its end the command runs the exit handlers and leaves (``leave``) instead of tearing down every
module and XLA's client object by object: a second or more after a training run on 2 cores, for nothing.
"""

from __future__ import annotations

import atexit
import os
import platform
import sys
import threading
from pathlib import Path

from moelab.progress import phase

TUNABLE = "glibc.malloc.hugetlb=1"
KEEP = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=68719476736")
MODES = ("hugepages", "keep", "system")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepages_on(env=None) -> bool:
    """True if this process started with the tunable set."""
    env = os.environ if env is None else env
    return TUNABLE in env.get("GLIBC_TUNABLES", "").split(":")


def hugepage_env(env=None) -> dict | None:
    """The environment to restart with, or None where there is nothing to do."""
    env = dict(os.environ if env is None else env)
    mode = env.get("MOELAB_MALLOC", "hugepages")
    if mode not in MODES:
        raise SystemExit(f"moelab: MOELAB_MALLOC={mode!r}: give one of {', '.join(MODES)} (moelab/_alloc.py)")
    if mode == "system" or hugepages_on(env):
        return None
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        if "[never]" in THP.read_text():
            return None
    except OSError:
        return None
    more = (TUNABLE, *KEEP) if mode == "keep" else (TUNABLE,)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), *more) if t)
    return env


def restart_with_hugepages(argv: list[str]) -> None:
    """Replace this process by ``python -m moelab ARGV`` with the tunable set; returns if not needed."""
    env = hugepage_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "moelab", *argv], env)


def leave(code: int) -> None:
    """End the process with ``code`` now that the command is done: its exit handlers (JAX's, a distributed
    job's shutdown, multiprocessing's, logging's) run and the streams are flushed, then ``os._exit``. With
    another thread still running, the interpreter's own exit (which waits for it) instead."""
    phase("exit")  # MOELAB_TIMING=1: what follows is the interpreter's shutdown
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`moelab ... | head`): nothing more to say
            pass
    os._exit(int(code or 0))
