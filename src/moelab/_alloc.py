"""The `moelab` process's start and end: it starts again with transparent huge pages for glibc's heap, so
XLA:CPU's per-step buffers are not faulted in 4 KiB at a time, and it leaves at once when its command is done.

XLA:CPU allocates a step's temporaries on every execution. glibc hands large blocks out with
``mmap`` and returns them on ``free``, so each step touches hundreds of MB of fresh 4 KiB pages:
on shape A (``benchmarks/profile_step.py``) about 155,000 page faults and a third of a second of
kernel time per step. With glibc's ``glibc.malloc.hugetlb=1`` tunable the heap asks for 2 MiB
transparent huge pages: about 770 faults per step, the step about 1.15x faster on 2 cores, and
the same peak memory (keeping freed memory instead also removes the faults but costs 1.75x the
peak memory, so it is not used).

A tunable is read when the process starts, so the ``moelab`` command starts itself again with it
set (once, before anything heavy is imported). ``MOELAB_MALLOC=system`` turns this off; other C
libraries and kernels without transparent huge pages are left alone.

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
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepages_on(env=None) -> bool:
    """True if this process started with the tunable set."""
    env = os.environ if env is None else env
    return TUNABLE in env.get("GLIBC_TUNABLES", "").split(":")


def hugepage_env(env=None) -> dict | None:
    """The environment to restart with, or None where there is nothing to do."""
    env = dict(os.environ if env is None else env)
    if env.get("MOELAB_MALLOC", "hugepages") == "system" or hugepages_on(env):
        return None
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        if "[never]" in THP.read_text():
            return None
    except OSError:
        return None
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLE) if t)
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
