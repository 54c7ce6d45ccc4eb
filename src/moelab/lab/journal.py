"""An experiment's journal: append-only JSON lines, never rewritten.

declared (with a version number and the step graph), prediction_registered (with its hash), attempt
(each run of the graph: the first, one with another graph, one forced), step started / resumed /
finished / failed (with traceback) / blocked, lease taken over, change (what, why, at which step),
verdict (with its attempt). A declaration or prediction that changes is recorded as a new version;
the old one stays. What counts is what was on record before the experiment's first step started
(``record``): a later declaration or prediction is post hoc, and so is a verdict against it. The
verdict that counts is the first attempt's; a later attempt's is listed under it, never in its place.
"""

from __future__ import annotations

import contextlib
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

    @contextlib.contextmanager
    def _locked(self):
        """Two runners declaring (or starting an attempt) at once record it once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            yield

    def declare(self, exp: Experiment, steps: list[dict]) -> None:
        """Record the declaration (its text and the step graph the outcome comes from) and the
        prediction, once per version."""
        with self._locked():
            past = self.read()
            decl = exp.declaration()
            digest = hashlib.sha256(json.dumps(decl, sort_keys=True).encode()).hexdigest()[:12]
            declared = [e for e in past if e["event"] == "declared"]
            # a new version when the text or the graph changed, or any step did (status lists the current ones)
            if not declared or declared[-1]["hash"] != digest or declared[-1].get("steps") != steps:
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

    def begin_attempt(self, graph: dict[str, str], forced: list[str]) -> tuple[int, str | None]:
        """The number of the attempt this run is: the first run's is 1; a run whose graph (``Experiment.graph``)
        differs from the last attempt's, or that reruns (``forced``) a step of it, is the next, recorded
        with what changed; any other run continues the last attempt (a resume, a rerun that reuses).
        Returns (the number, why a new attempt began, or None when this run continues one)."""
        with self._locked():
            past = self.read()
            attempts = [e for e in past if e["event"] == "attempt"]
            if attempts:
                number, before = attempts[-1]["number"], attempts[-1]["graph"]
            elif any(e["event"] == "verdict" for e in past):  # judged before attempts were recorded
                number, before = 1, _legacy_graph(past, graph)
            else:
                number, before = 0, None
            changed = {k: [before.get(k), graph.get(k)] for k in sorted(set(before) | set(graph))
                       if before.get(k) != graph.get(k)} if before is not None else {}  # fmt: skip
            if number and not changed and not forced:
                return number, None
            why = ("the first run" if not number else
                   "; ".join(x for x in (f"steps changed: {', '.join(changed)}" if changed else "",
                                         f"forced: {', '.join(forced)}" if forced else "") if x))  # fmt: skip
            self.write("attempt", number=number + 1, graph=graph, changed=changed, forced=list(forced), why=why)
            return number + 1, why

    def record_verdict(self, v: dict) -> None:
        """A verdict, once per prediction, attempt and outcome (a rerun that changes nothing adds nothing)."""
        same = [e for e in self.read() if e["event"] == "verdict" and e.get("prediction_hash") == v["prediction_hash"]
                and e.get("attempt", 1) == v.get("attempt", 1)]  # fmt: skip
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

    def write(self, event: str, **fields) -> dict | None:
        """A journal line from the running step, written only while its runner holds the step's lease
        (checked under the lease's lock, so no takeover slips in between): a runner that lost the step
        writes nothing more. None when it wrote nothing."""
        done: list[dict] = []

        def act() -> None:
            done.append(self.journal.write(event, step=self.step, dir=self.dir, **fields))

        if self.lease is None:
            act()
        elif not self.lease.commit(act):
            return None
        return done[0]


RUNNING = contextvars.ContextVar("moelab_running_step", default=None)


def first_step_time(events: list[dict]) -> float | None:
    """When the experiment's first step started (or resumed): the line between before and after."""
    times = [e["time"] for e in events if e["event"] in ("step_started", "step_resumed")]
    return min(times) if times else None


DECLARED_TEXT = ("issue", "title", "goal", "hypothesis", "description")  # what a post-hoc declaration changes


def _legacy_graph(events: list[dict], graph: dict[str, str]) -> dict[str, str]:
    """The graph of a journal from before attempts were recorded: its newest declaration's steps."""
    declared = [e for e in events if e["event"] == "declared"]
    steps = {s["name"]: s["dir"].rpartition("-")[2] for s in (declared[-1].get("steps", []) if declared else [])}
    return {k: steps[k] for k in graph if k in steps}


def record(events: list[dict]) -> dict:
    """What counts and what is post hoc. ``declaration`` and ``prediction``: the newest of each on
    record before the first step started (None when there was none); ``post_hoc_declarations`` (those
    after it that change the text; one that only changes the graph is an attempt) and
    ``post_hoc_predictions``: those recorded after it; ``verdict``: the first verdict against the
    pre-registered prediction, the first attempt's, which is the one that counts; ``attempts``: every
    attempt with its verdict; ``later_verdicts``: a later attempt's verdict that differs from it;
    ``post_hoc_verdicts``: the newest against each post-hoc prediction (their ``verdict`` is written
    ``POST-HOC ...``, never a plain CONFIRMED or FALSIFIED)."""
    first = first_step_time(events)

    def split(kind: str) -> tuple[dict | None, list[dict]]:
        found = [e for e in events if e["event"] == kind]
        before = [e for e in found if first is None or e["time"] < first]
        return (before[-1] if before else None), [e for e in found if first is not None and e["time"] >= first]

    decl, after = split("declared")
    post_decl, prev = [], decl
    for d in after:
        if prev is None or any(d.get(k) != prev.get(k) for k in DECLARED_TEXT):
            post_decl.append(d)
        prev = d
    pred, post_pred = split("prediction_registered")
    verdicts = [e for e in events if e["event"] == "verdict"]
    counted = [v for v in verdicts if pred is not None and v.get("prediction_hash") == pred["hash"]]
    post_verdicts = []
    for p in post_pred:
        mine = [v for v in verdicts if v.get("prediction_hash") == p["hash"] and not v.get("pre_registered", True)]
        if mine:
            post_verdicts.append(mine[-1])
    attempts = [{**a, "verdict": next((v for v in reversed(counted) if v.get("attempt", 1) == a["number"]), None)}
                for a in events if a["event"] == "attempt"]  # fmt: skip
    head = counted[0] if counted else None
    return {
        "first_step": first,
        "declaration": decl,
        "prediction": pred,
        "post_hoc_declarations": post_decl,
        "post_hoc_predictions": post_pred,
        "verdict": head,
        "attempts": attempts,
        "later_verdicts": [
            v for v in counted[1:] if (v["verdict"], v["outcome"]) != (head["verdict"], head["outcome"])
        ],
        "post_hoc_verdicts": post_verdicts,
    }


def verdict_text(v: dict, first: dict | None) -> str:
    """A verdict as every view writes it: plain when it is the one that counts (or agrees with it),
    else with its attempt and the first attempt's verdict beside it ("CONFIRMED on attempt 2 after
    FALSIFIED on attempt 1"), never a bare CONFIRMED in place of what the first attempt found."""
    if first is None or v is first or v["verdict"] == first["verdict"]:
        return v["verdict"]
    n, m = v.get("attempt", 1), first.get("attempt", 1)
    where = f"on a rerun of attempt {n}" if n == m else f"on attempt {n}"
    return f"{v['verdict']} {where} after {first['verdict']} on attempt {m}"


def headline(rec: dict) -> str | None:
    """The verdict line of an experiment: the first attempt's verdict, then each later one that differs.
    When earlier attempts ended without a verdict (a step failed), the line says so: their outcome may
    have been seen, so a reader is told that the verdict is not the first attempt's."""
    first = rec["verdict"]
    if first is None:
        return None
    n = first.get("attempt", 1)
    without = [str(a["number"]) for a in rec["attempts"] if a["number"] < n]
    head = first["verdict"]
    if without:
        head += f" on attempt {n} (attempt{'s' if len(without) > 1 else ''} {', '.join(without)}: no verdict)"
    return "; ".join([head, *(verdict_text(v, first) for v in rec["later_verdicts"])])


def attempt_rows(rec: dict) -> list[dict]:
    """Each attempt at the registered prediction: its number, when (local time), why it began, its
    graph (step -> identity) and its verdict as every view writes it (``verdict_text``)."""
    return [
        {
            "number": a["number"],
            "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["time"])),
            "why": a["why"],
            "graph": a["graph"],
            "verdict": verdict_text(a["verdict"], rec["verdict"]) if a["verdict"] else None,
        }  # fmt: skip
        for a in rec["attempts"]
    ]


def judge(
    events: list[dict], current, outcome: float | None, known: list[dict] = (), attempt: int = 1
) -> tuple[dict | None, dict | None]:
    """(the verdict against the pre-registered prediction, a post-hoc verdict against ``current``
    when it is another prediction registered after the first step); either may be None. Both carry
    ``attempt``.

    ``known``: when each result that makes the outcome known started, and by which experiment
    (``Runner.outcome_origins``: the steps ``graph.knowable`` names). A prediction is pre-registered
    only if it was on record before any of them had started: one started before it (another
    experiment's, or this one's under an earlier prediction, finished or still running) makes the
    verdict POST-HOC, with the reason."""
    rec = record(events)
    official = None
    if rec["prediction"] is not None:
        p = rec["prediction"]
        official = {**verdict(Prediction(**p["prediction"]), outcome), "prediction_hash": p["hash"],
                    "prediction_version": p["version"], "pre_registered": True, "attempt": attempt}  # fmt: skip
        early = [k for k in known if k.get("started", k["produced"]) < p["time"]]
        if early:
            named = ", ".join(
                f"{k['step']} ({'by ' + k['experiment'] if k.get('experiment') else 'by an unknown run'}, "
                f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(k.get('started', k['produced'])))} UTC)"
                for k in early
            )
            official.update(verdict=f"POST-HOC {official['verdict']}", pre_registered=False,
                            why=f"{official['why']}; the outcome was knowable before the prediction was registered: "
                                f"{named} had started already",
                            known_before=[k["step"] for k in early])  # fmt: skip
    late = None
    post = [p for p in rec["post_hoc_predictions"] if p["hash"] == current.digest()]
    if post and (rec["prediction"] is None or rec["prediction"]["hash"] != current.digest()):
        v = verdict(current, outcome)
        late = {**v, "verdict": f"POST-HOC {v['verdict']}", "prediction_hash": post[-1]["hash"],
                "prediction_version": post[-1]["version"], "pre_registered": False, "attempt": attempt,
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


def status_rows(prefix: Path) -> list[dict]:
    """`moelab status`'s rows: each experiment whose journal is under ``prefix``: its current steps'
    statuses (their ``.status`` files; PENDING without one), its verdict and its attempts."""
    out = []
    for journal_path in sorted(Path(prefix).glob("experiments/*/journal.jsonl")):
        events = Journal(journal_path).read()
        declared = [e for e in events if e["event"] == "declared"]
        rec = record(events)
        steps = []
        for s in declared[-1]["steps"] if declared else []:
            status_path = Path(prefix) / f"{s['dir']}.status"
            status = json.loads(status_path.read_text())["status"] if status_path.exists() else "PENDING"
            steps.append({"name": s["name"], "dir": s["dir"], "status": status})
        out.append(
            {
                "experiment": journal_path.parent.name,
                "title": declared[-1]["title"] if declared else "",
                "version": len(declared),
                "steps": steps,
                "verdict": headline(rec),
                "attempts": attempt_rows(rec),
                "post_hoc_verdicts": [v["verdict"] for v in rec["post_hoc_verdicts"]],
            }
        )
    return out
