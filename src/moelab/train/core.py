"""The training loop's core: step after step over an explicit run state (``RunState``); all else it
does (checkpoints, the NaN guard, evaluations, health checks, forecast refits, trackers, timing,
progress) is callbacks (``train.callbacks``, whose docstring gives the hooks and their order).

Batches are a pure function of (seed, step), the state is checkpointed with the metrics cursor,
so a run resumed from a checkpoint writes exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import traceback

from moelab.errors import Interrupted, RunError
from moelab.progress import phase
from moelab.runs import append_jsonl


class Loop:
    """The steps from ``rs.start`` to ``rs.steps``, calling ``callbacks``' hooks in their order."""

    def __init__(self, rs, callbacks):
        self.rs, self.callbacks = rs, list(callbacks)
        self.program = None  # the compiled step of the phase that runs now
        self.flops_per_token = 0.0  # its training FLOPs per token

    def emit(self, hook: str, *args):
        """Call ``hook`` on every callback that has it, in order; the first value one returns (or None)."""
        out = None
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                got = fn(self, *args)
                if out is None:
                    out = got
        return out

    def record(self, rec: dict) -> None:
        """A metrics line: appended to metrics.jsonl, then to the callbacks (trackers, health checks)."""
        append_jsonl(self.rs.run.metrics, rec)
        self.emit("on_record", rec)

    def evaluate(self, done: int) -> dict:
        """The held-out evaluation after step ``done``: recorded, an ``eval`` event, then ``after_eval``."""
        rec = self.rs.held_out(done)
        self.record(rec)
        self.rs.run.event("eval", step=done, loss=rec["loss"]["macro"], loss_dropless=rec["loss_dropless"]["macro"])
        self.emit("after_eval", done)
        return rec

    def run(self) -> None:
        """Every step from the start: its batch, the update, then the callbacks. A failure is recorded
        (a ``failure`` event) and raised; ``close`` is called either way."""
        rs, ended = self.rs, False
        s = rs.start
        try:
            self.emit("on_start")
            while s < rs.steps:
                self.emit("before_step", s)
                if s in rs.skip:  # a batch the NaN guard ruled out: no update, evals and checkpoints as usual
                    s += 1
                    self.emit("after_step", s, None)
                    phase("steps")
                    continue
                batch = rs.batch(s)
                now = rs.at_length(s)
                self.program, self.flops_per_token = now["step"], now["flops_per_token"]
                self.emit("before_update", s)
                rs.state, metrics = rs.update(now["step"], s, batch)
                finite = bool(metrics["finite"])
                self.emit("after_update", s, finite)
                if not finite and (back := self.emit("on_nonfinite", s, metrics)) is not None:
                    s = back  # restored: on from the checkpoint's step
                    continue
                s += 1
                self.emit("after_step", s, metrics)
                phase("steps")  # (a step that follows; the last one's is empty)
            self.emit("on_end")
            ended = True
        except RunError as exc:
            rs.run.event("failure", error=str(exc))
            raise
        except Interrupted as exc:  # Ctrl-C or SIGTERM: stopped at a step boundary with its checkpoint
            rs.run.event("interrupted", step=s, saved=True, message=str(exc))
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: at once, the newest complete checkpoint kept
            rs.run.event("interrupted", step=s, saved=False)
            raise
        except BaseException as exc:
            rs.run.event("failure", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            raise
        finally:
            self.emit("close", ended)
