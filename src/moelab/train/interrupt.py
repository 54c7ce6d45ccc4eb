"""Ctrl-C and SIGTERM during training: the run stops at the next step boundary with a checkpoint of
that step, complete before the process exits, says where in one line and exits 130
(``errors.Interrupted``); ``moelab train --resume`` continues from it to the numbers the
uninterrupted run writes. A second signal stops at once (``KeyboardInterrupt``), keeping what the
newest complete checkpoint holds.

In a multi-process job a signal may reach the processes at different steps (or reach one of them):
at each step boundary they all-gather the flag, so all of them save the same step and stop there.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np

from moelab.errors import Interrupted
from moelab.progress import phase, say

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """The loop's callback (``train.callbacks``): handlers for SIGINT and SIGTERM from ``on_start``
    to ``close`` (in the main thread only: a lab runner's training thread cannot hold them)."""

    def __init__(self):
        self.asked: str | None = None  # the signal's name, once one arrived
        self.before: dict = {}

    def on_start(self, loop) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self.before[sig] = signal.signal(sig, self._heard)

    def _heard(self, signum, frame) -> None:
        if self.asked is not None:  # the second: at once
            self._restore()
            raise KeyboardInterrupt
        self.asked = signal.Signals(signum).name
        say(f"{self.asked}: the run stops at the next step boundary, after saving a checkpoint there "
            "(send it again to stop at once, without one)", True)  # fmt: skip

    def _agreed(self) -> bool:
        """Whether this process (or, in a job, any process) was asked to stop."""
        if jax.process_count() == 1:
            return self.asked is not None
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.asked is not None))
        if np.any(flags) and self.asked is None:
            self.asked = "a signal to another process of the job"
        return bool(np.any(flags))

    def before_step(self, loop, s: int) -> None:
        if not self._agreed():
            return
        rs = loop.rs
        phase("checkpoint")
        say(f"saving a checkpoint at step {s} before stopping", rs.progress)
        if s not in rs.ckpts.steps():  # (a resumed run's first boundary has its checkpoint already)
            rs.save(s)
        rs.ckpts.wait()  # complete before the process exits
        raise Interrupted(
            f"stopped by {self.asked} at step {s} of {rs.steps}: checkpoint {rs.run.ckpt}/step_{s:08d} saved; "
            f"continue with: moelab train --resume --out {rs.run.path}"
        )

    def _restore(self) -> None:
        for sig, handler in self.before.items():
            signal.signal(sig, handler)
        self.before = {}

    def close(self, loop, ended: bool) -> None:
        self._restore()
