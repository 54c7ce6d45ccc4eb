"""An experiment's journal: append-only JSON lines, never rewritten.

declared (with a version number), prediction_registered (with its hash), step started /
resumed / finished / failed (with traceback) / blocked, lease taken over, change (what, why,
at which step), verdict. A declaration or prediction that changes after the first run is
recorded as a new version; the old one stays.
"""

from __future__ import annotations

import contextvars
import fcntl
import hashlib
import json
import time
from pathlib import Path

from moelab.lab.graph import Experiment

# (journal, step name, step dir) of the step running in this thread, so that a step can record what
# happens while it runs (a forecast's updates), not only what its outcome carries at the end
RUNNING = contextvars.ContextVar("moelab_running_step", default=None)


class Journal:
    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def write(self, event: str, **fields) -> dict:
        rec = {"time": time.time(), "event": event, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # two runners may write at once
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            fcntl.flock(fh, fcntl.LOCK_UN)
        return rec

    def declare(self, exp: Experiment, steps: list[dict]) -> None:
        """Record the declaration and the prediction, once per version."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lk:  # two runners declaring at once record it once
            fcntl.flock(lk, fcntl.LOCK_EX)
            past = self.read()
            decl = exp.declaration()
            digest = hashlib.sha256(json.dumps(decl, sort_keys=True).encode()).hexdigest()[:12]
            declared = [e for e in past if e["event"] == "declared"]
            if not declared or declared[-1]["hash"] != digest:
                self.write("declared", version=len(declared) + 1, hash=digest, steps=steps, **decl)
            preds = [e for e in past if e["event"] == "prediction_registered"]
            pdigest = exp.prediction.digest()
            if not preds or preds[-1]["hash"] != pdigest:
                self.write(
                    "prediction_registered",
                    version=len(preds) + 1,
                    hash=pdigest,
                    prediction=exp.prediction.__dict__,
                    text=exp.prediction.describe(),
                )

    def record_verdict(self, v: dict) -> None:
        past = [e for e in self.read() if e["event"] in ("verdict", "prediction_registered")]
        last = past[-1] if past else None
        if last and last["event"] == "verdict" and last["verdict"] == v["verdict"] and last["outcome"] == v["outcome"]:
            return  # the same outcome, already judged
        self.write("verdict", **v)

    def change(self, what: str, why: str, step: int | None = None) -> dict:
        return self.write("change", what=what, why=why, at_step=step)
