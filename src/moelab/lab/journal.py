"""An experiment's journal: append-only JSON lines, never rewritten.

declared (with a version number), prediction_registered (with its hash), step started /
resumed / finished / failed (with traceback) / blocked, lease taken over, change (what, why,
at which step), verdict. A declaration or prediction that changes is recorded as a new version;
the old one stays. What counts is what was on record before the experiment's first step started
(``record``): a later declaration or prediction is post hoc, and so is a verdict against it.
"""

from __future__ import annotations

import contextvars
import fcntl
import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

from moelab import jsonl
from moelab.lab.graph import Experiment, Prediction, verdict


class Journal:
    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict]:
        """Every whole record (a torn tail is not one; a bad line in the middle: RecordError)."""
        return jsonl.read(self.path)

    def write(self, event: str, **fields) -> dict:
        """One record, whole, locked (two runners may write at once) and synced to disk: a journal's
        records are commitments (registrations, verdicts, lease changes). A torn tail left by a crash
        is set aside first (journal.jsonl.torn) and recorded as a ``torn_record`` event."""
        rec = {"time": time.time(), "event": event, **fields}
        torn = jsonl.append(self.path, rec, default=str, lock=True)
        if torn is not None:
            jsonl.append(self.path, {"time": time.time(), "event": "torn_record", **torn}, lock=True)
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
        """A verdict, once per prediction and outcome (a rerun that changes nothing adds nothing)."""
        same = [e for e in self.read() if e["event"] == "verdict" and e.get("prediction_hash") == v["prediction_hash"]]
        if same and same[-1]["verdict"] == v["verdict"] and same[-1]["outcome"] == v["outcome"]:
            return
        self.write("verdict", **v)

    def change(self, what: str, why: str, step: int | None = None) -> dict:
        return self.write("change", what=what, why=why, at_step=step)


class Running(NamedTuple):
    """The step running in this thread: so that it can record what happens while it runs (a
    forecast's updates), not only what its outcome carries at the end, and stop when its runner
    has lost the step to another (``lease.lost``)."""

    journal: Journal
    step: str
    dir: str
    lease: object = None


RUNNING = contextvars.ContextVar("moelab_running_step", default=None)


def first_step_time(events: list[dict]) -> float | None:
    """When the experiment's first step started (or resumed): the line between before and after."""
    times = [e["time"] for e in events if e["event"] in ("step_started", "step_resumed")]
    return min(times) if times else None


def record(events: list[dict]) -> dict:
    """What counts and what is post hoc. ``declaration`` and ``prediction``: the newest of each on
    record before the first step started (None when there was none); ``post_hoc_declarations`` and
    ``post_hoc_predictions``: those recorded after it; ``verdict``: the newest verdict against the
    pre-registered prediction; ``post_hoc_verdicts``: the newest against each post-hoc prediction
    (their ``verdict`` is written ``POST-HOC ...``, never a plain CONFIRMED or FALSIFIED)."""
    first = first_step_time(events)

    def split(kind: str) -> tuple[dict | None, list[dict]]:
        found = [e for e in events if e["event"] == kind]
        before = [e for e in found if first is None or e["time"] < first]
        return (before[-1] if before else None), [e for e in found if first is not None and e["time"] >= first]

    decl, post_decl = split("declared")
    pred, post_pred = split("prediction_registered")
    verdicts = [e for e in events if e["event"] == "verdict"]
    counted = [v for v in verdicts if pred is not None and v.get("prediction_hash") == pred["hash"]]
    post_verdicts = []
    for p in post_pred:
        mine = [v for v in verdicts if v.get("prediction_hash") == p["hash"] and not v.get("pre_registered", True)]
        if mine:
            post_verdicts.append(mine[-1])
    return {
        "first_step": first,
        "declaration": decl,
        "prediction": pred,
        "post_hoc_declarations": post_decl,
        "post_hoc_predictions": post_pred,
        "verdict": counted[-1] if counted else None,
        "post_hoc_verdicts": post_verdicts,
    }


def judge(
    events: list[dict], current, outcome: float | None, known: list[dict] = ()
) -> tuple[dict | None, dict | None]:
    """(the verdict against the pre-registered prediction, a post-hoc verdict against ``current``
    when it is another prediction registered after the first step); either may be None.

    ``known``: when each result the outcome is computed from was produced, and by which experiment
    (``Runner.outcome_origins``). A prediction is pre-registered only if it was on record before all
    of them existed: a result reused from before it (another experiment's, or this one's under an
    earlier prediction) makes the verdict POST-HOC, with the reason."""
    rec = record(events)
    official = None
    if rec["prediction"] is not None:
        p = rec["prediction"]
        official = {**verdict(Prediction(**p["prediction"]), outcome), "prediction_hash": p["hash"],
                    "prediction_version": p["version"], "pre_registered": True}  # fmt: skip
        early = [k for k in known if k["produced"] < p["time"]]
        if early:
            named = ", ".join(
                f"{k['step']} ({'by ' + k['experiment'] if k.get('experiment') else 'by an unknown run'}, "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(k['produced']))} UTC)"
                for k in early
            )
            official.update(verdict=f"POST-HOC {official['verdict']}", pre_registered=False,
                            why=f"{official['why']}; the outcome was known before the prediction was registered: "
                                f"the results of {named} existed already",
                            known_before=[k["step"] for k in early])  # fmt: skip
    late = None
    post = [p for p in rec["post_hoc_predictions"] if p["hash"] == current.digest()]
    if post and (rec["prediction"] is None or rec["prediction"]["hash"] != current.digest()):
        v = verdict(current, outcome)
        late = {**v, "verdict": f"POST-HOC {v['verdict']}", "prediction_hash": post[-1]["hash"],
                "prediction_version": post[-1]["version"], "pre_registered": False,
                "why": f"{v['why']}; against a prediction registered after the first step started"}  # fmt: skip
    return official, late


def journals_of(run_dir: Path) -> list[tuple[Journal, str]]:
    """(journal, step name) of each experiment under the run's lab prefix whose steps include it."""
    out = []
    for path in sorted(run_dir.parent.glob("experiments/*/journal.jsonl")):
        journal = Journal(path)
        declared = [e for e in journal.read() if e["event"] == "declared"]
        steps = {s["dir"]: s["name"] for d in declared for s in d.get("steps", [])}
        if run_dir.name in steps:
            out.append((journal, steps[run_dir.name]))
    return out
