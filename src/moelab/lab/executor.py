"""Running an experiment's step graph: reuse, leases, status files, provenance and the journal.

Beside each output ``<prefix>/<name>-<hash>/`` sit ``<name>-<hash>.status`` (RUNNING, SUCCESS,
FAILED) and ``<name>-<hash>.lease`` (owner and heartbeat). A step is SUCCESS only after its
function returned and its outcome was written; a runner that finds a live lease waits, one
that finds a stale lease (no heartbeat for MOELAB_LEASE_TIMEOUT seconds) takes it over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from moelab.lab import ray_backend
from moelab.lab.graph import Experiment, Step, closure, knowable, resolve
from moelab.lab.journal import RUNNING, Journal, Running, headline, judge, record
from moelab.runs import git_state, host, versions


def lease_timeout() -> float:
    return float(os.environ.get("MOELAB_LEASE_TIMEOUT", "60"))


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _seed(attempt: Path, previous: Path | None) -> None:
    """Start an attempt folder from the newest earlier attempt (a training step resumes from its
    checkpoints): finished checkpoint files are linked (never written again), everything else is
    copied. The earlier attempt's runner may still be writing (it lost its lease but does not know
    yet): whatever vanishes or changes during the copy is its, and a checkpoint it had not finished
    (``*.partial``) is not taken."""
    attempt.mkdir(parents=True, exist_ok=True)
    if previous is None or not previous.is_dir():
        return
    for src in sorted(previous.rglob("*")):
        rel = src.relative_to(previous)
        if any(part.endswith(".partial") for part in rel.parts) or rel.name.startswith("outcome.lost-"):
            continue
        dst = attempt / rel
        try:
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif rel.parts[0] == "ckpt":
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        except (FileNotFoundError, FileExistsError):
            continue


def _rebase(obj, old: str, new: str):
    """``obj`` with every string that starts with the path ``old`` starting with ``new`` instead."""
    if isinstance(obj, str):
        return new + obj[len(old) :] if obj == old or obj.startswith(old + "/") else obj
    if isinstance(obj, dict):
        return {k: _rebase(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebase(v, old, new) for v in obj]
    return obj


def read_status(prefix: Path, step: Step) -> str:
    path = prefix / f"{step.dirname()}.status"
    try:
        return json.loads(path.read_text())["status"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return "PENDING"


class Lease:
    """A lease file with a heartbeat, and a lock file that makes every change to it atomic.

    Acquiring, taking over a stale lease, each heartbeat and the release all happen under an
    exclusive ``flock`` on ``<lease>.lock``, and the lease is always replaced by a rename: there is
    never a moment without a lease file, and a runner writes the lease only while it is the owner
    on record (its owner string is unique to it). A holder that stalls past the timeout (a frozen
    process, a long pause) finds another owner when it wakes: it stops claiming the lease, and the
    runner does not commit the step (``holds``)."""

    def __init__(self, path: Path, owner: str):
        self.path, self.owner = path, owner
        self.lock_path = path.with_name(f"{path.name}.lock")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict | None = None
        self.lost = False

    @contextlib.contextmanager
    def _locked(self):
        with open(self.lock_path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self) -> dict | None:
        """The lease on disk (None when there is none); one a crash left unreadable counts from its mtime."""
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            info = json.loads(text)
            if not isinstance(info, dict):
                raise ValueError
            return info
        except ValueError:
            return {"unreadable": text[:200], "heartbeat": mtime}

    def _write(self) -> None:
        record = {"owner": self.owner, "pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()}
        _write_atomic(self.path, record)

    def try_acquire(self) -> bool:
        with self._locked():
            held = self._read()
            if held is not None:
                if time.time() - float(held.get("heartbeat", 0)) <= lease_timeout():
                    return False  # alive: wait for it
                self.took_over = held  # stale: replaced in one rename, never removed first
            self._write()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return True

    def owned(self) -> bool:
        with self._locked():
            held = self._read()
            return held is not None and held.get("owner") == self.owner

    def holds(self) -> bool:
        """Still the owner on record: what a runner checks before it commits a step."""
        if not self.owned():
            self.lost = True
        return not self.lost

    def _beat(self) -> None:
        while not self._stop.wait(max(lease_timeout() / 4, 0.2)):
            with self._locked():
                held = self._read()
                if held is None or held.get("owner") != self.owner:  # taken over while we stalled
                    self.lost = True
                    return
                self._write()

    def commit(self, action) -> bool:
        """Run ``action`` (the rename that makes an attempt the step's output) only while still the
        owner on record, under the lock a takeover needs: no takeover can slip between the check and
        the rename. False, and nothing done, when the lease was lost."""
        with self._locked():
            held = self._read()
            if held is None or held.get("owner") != self.owner:
                self.lost = True
                return False
            action()
            return True

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        with self._locked():
            held = self._read()
            if held is not None and held.get("owner") == self.owner:
                self.path.unlink(missing_ok=True)


class Runner:
    def __init__(
        self,
        exp: Experiment,
        prefix: str | Path,
        *,
        only: str | None = None,
        force: str | None = None,
        max_concurrent: int = 1,
        backend: str = "local",
        log=print,
    ):
        self.exp, self.prefix = exp, Path(prefix)
        self.only = re.compile(only) if only else None
        self.force = re.compile(force) if force else None
        self.max_concurrent, self.backend, self.log = max(1, max_concurrent), backend, log
        self.journal = Journal(self.prefix / "experiments" / exp.name / "journal.jsonl")
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def out(self, step: Step) -> Path:
        return self.prefix / step.dirname()

    def selected(self) -> list[Step]:
        steps = self.exp.all_steps()
        if not self.only:
            return steps
        keep = [s for s in steps if self.only.search(s.name)]
        needed = {id(d) for s in keep for d in closure(s)}
        return [s for s in steps if id(s) in needed]

    def result(self, step: Step) -> dict | None:
        path = self.out(step) / "outcome.json"
        return json.loads(path.read_text()) if path.exists() else None

    def origin(self, step: Step) -> dict:
        """When ``step``'s result was started and produced, and by which experiment: its provenance (the
        first start of any attempt at it, and the end of the run that made it), or, for an output without
        one, the outcome file's time for both. A step still running, or never run, started now at the
        earliest."""
        out = self.out(step)
        try:
            p = json.loads((out / "provenance.json").read_text())
            return {"step": step.name, "dir": step.dirname(), "produced": float(p["end"]),
                    "started": float(p.get("first_start", p["start"])), "experiment": p.get("experiment")}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            made = out / "outcome.json"
            when = made.stat().st_mtime if made.exists() else time.time()
            return {"step": step.name, "dir": step.dirname(), "produced": when, "started": when, "experiment": None}

    def _reused(self, step: Step) -> dict | None:
        """A finished result taken as it is: recorded (``step_reused``, naming what it reuses)."""
        o = self.origin(step)
        self.journal.write("step_reused", step=step.name, dir=step.dirname(), produced=o["produced"],
                           produced_by=o["experiment"])  # fmt: skip
        return self.result(step)

    def outcome_origins(self) -> list[dict]:
        """The origin of every result that makes the predicted metric known once started: the metric's
        step and what it reads, not through a forecast (``graph.knowable``)."""
        step = self.exp.metric_step()
        return [self.origin(s) for s in knowable(step)] if step is not None else []

    def run(self) -> dict:
        self.journal.declare(self.exp, [{"name": s.name, "dir": s.dirname()} for s in self.exp.all_steps()])
        steps = self.selected()
        # a forced step runs again, and so does everything downstream of it in this run
        self._forced = set()
        for s in steps:
            if (self.force and self.force.search(s.name)) or any(id(d) in self._forced for d in s.deps()):
                self._forced.add(id(s))
        graph = self.exp.graph()
        forced = [s.name for s in steps if id(s) in self._forced and s.name in graph]
        attempt, why = self.journal.begin_attempt(graph, forced)
        if why is not None and attempt > 1:
            self.log(f"  attempt {attempt} at the registered prediction ({why}); the first attempt's verdict "
                     "stays the one that counts")  # fmt: skip
        status: dict[int, str] = {}
        results: dict[str, dict] = {}
        lost = False
        pool = ThreadPoolExecutor(self.max_concurrent)
        running = {}
        try:
            while len(status) < len(steps):
                for s in steps:
                    if id(s) in status or any(f is s for f in running.values()):
                        continue
                    deps = [status.get(id(d)) for d in s.deps()]
                    if any(d in ("FAILED", "BLOCKED") for d in deps):
                        status[id(s)] = "BLOCKED"
                        self.journal.write(
                            "step_blocked",
                            step=s.name,
                            dir=s.dirname(),
                            because=[d.name for d in s.deps() if status.get(id(d)) != "SUCCESS"],
                        )
                        self.log(f"  {s.name}: not run, a dependency failed")
                        continue
                    if all(d == "SUCCESS" for d in deps) and len(running) < self.max_concurrent and not lost:
                        running[self._submit(pool, s)] = s
                if not running:
                    if lost:  # presumed dead by another runner, which carries on: this one starts nothing more
                        break
                    continue
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    s = running.pop(fut)
                    status[id(s)], outcome = fut.result()
                    lost = lost or status[id(s)] == "LOST"
                    if outcome is not None:
                        results[s.name] = outcome
        finally:
            pool.shutdown(wait=True)
        summary = {"steps": {s.name: status.get(id(s), "STOPPED") for s in steps}, "attempt": attempt,
                   "verdict": None, "this_attempt": None, "post_hoc_verdict": None, "headline": None,
                   "lost": [s.name for s in steps if status.get(id(s)) == "LOST"]}  # fmt: skip
        if all(v == "SUCCESS" for v in summary["steps"].values()) and len(steps) == len(self.exp.all_steps()):
            # judged against the prediction on record before the first step started; a prediction
            # registered later is judged apart, and its verdict says it is post hoc
            official, late = judge(self.journal.read(), self.exp.prediction, self.exp.outcome(results),
                                   known=self.outcome_origins(), attempt=attempt)  # fmt: skip
            for v in (official, late):
                if v is not None:
                    self.journal.record_verdict(v)
            rec = record(self.journal.read())  # the verdict that counts is the first attempt's, not this one's
            summary.update(verdict=rec["verdict"], this_attempt=official, post_hoc_verdict=late, headline=headline(rec))
        return summary

    def _lost(self, step: Step, attempt: Path, how: str) -> str:
        """A step this runner lost to another while it stalled: the other runner took it over (its
        ``lease_taken_over`` is on record) and carries the experiment on. Nothing goes into the journal
        or the step's status from here; a note stays in this runner's own attempt folder."""
        _write_atomic(attempt / "lease_lost.json", {"owner": self.owner, "time": time.time(), "step": step.name,
                                                    "how": how})  # fmt: skip
        self.log(f"  {step.name}: this runner lost its lease to another while it stalled ({how}); it writes "
                 f"nothing more and stops; its attempt stays in {attempt}")  # fmt: skip
        return "LOST"

    def _submit(self, pool, step: Step):
        if self.backend == "ray":
            return ray_backend.submit(pool, self, step)
        return pool.submit(self.run_step, step)

    def run_step(self, step: Step, call=None) -> tuple[str, dict | None]:
        """Run one step unless a complete output exists; returns (status, outcome)."""
        forced = id(step) in getattr(self, "_forced", set())
        out = self.out(step)
        status_path = self.prefix / f"{step.dirname()}.status"
        if read_status(self.prefix, step) == "SUCCESS" and not forced:
            return "SUCCESS", self._reused(step)
        self.prefix.mkdir(parents=True, exist_ok=True)
        lease = Lease(self.prefix / f"{step.dirname()}.lease", self.owner)
        if self._wait_for(step, lease, forced):
            return "SUCCESS", self._reused(step)
        try:
            before = read_status(self.prefix, step)
            if before == "SUCCESS" and not forced:  # finished by another runner while we waited
                return "SUCCESS", self._reused(step)
            if lease.took_over:
                self.journal.write("lease_taken_over", step=step.name, dir=step.dirname(), stale=lease.took_over)
            if forced and out.exists():  # keep the old output beside the new one: nothing is lost
                old = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
                os.rename(out, old)
                self.journal.write("step_forced", step=step.name, dir=step.dirname(), previous_output=old.name)
                before = "PENDING"
            kind = "step_resumed" if before in ("FAILED", "RUNNING") else "step_started"
            # every attempt writes into a folder of its own; only the owner's commit (one rename, under
            # the lease) makes it the step's output, so a runner that lost its lease writes nothing the
            # new owner reads (fencing). A resumed step starts from the newest earlier attempt's files.
            attempts = self.prefix / f"{step.dirname()}.attempts"
            attempt = attempts / re.sub(r"[^A-Za-z0-9_.-]", "-", self.owner)
            earlier = [d for d in attempts.glob("*") if d.is_dir() and d != attempt] if attempts.is_dir() else []
            if out.is_dir() and before != "SUCCESS":  # a step left by a runner from before attempt folders
                earlier.append(out)
            resuming = before in ("FAILED", "RUNNING")  # a fresh or forced step starts from nothing
            previous = max(earlier, key=lambda d: d.stat().st_mtime) if earlier and resuming else None
            _write_atomic(status_path, {"status": "RUNNING", "owner": self.owner, "time": time.time()})
            self.journal.write(kind, step=step.name, dir=step.dirname(), previous=before, attempt=attempt.name,
                               **({"from_attempt": previous.name} if previous is not None else {}))  # fmt: skip
            self.log(f"  {step.name}: {'resuming' if kind == 'step_resumed' else 'running'} into {out}")
            _seed(attempt, previous)
            config = resolve(step.config, lambda s: str(self.out(s)))
            started = time.time()
            if not (attempt / "started.json").is_file():  # a resumed attempt keeps the first one's start
                _write_atomic(attempt / "started.json", {"time": started, "owner": self.owner})
            first_start = json.loads((attempt / "started.json").read_text())["time"]
            running = RUNNING.set(Running(self.journal, step.name, step.dirname(), lease))
            try:
                outcome = (call or step.fn)(config, attempt)
            except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then re-raised if fatal
                result = self._failed(step, attempt, lease, status_path, exc)
                if not isinstance(exc, Exception):
                    raise
                return result, None
            finally:
                RUNNING.reset(running)
            outcome, entries = self._record(step, attempt, out, config, started, first_start, outcome)

            def commit() -> None:
                if out.exists():  # a partial output of the old layout, or a forced step's: kept aside, not lost
                    os.rename(out, out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
                os.rename(attempt, out)
                with contextlib.suppress(OSError):  # no other attempt left: no empty folder beside the output
                    attempts.rmdir()
                for entry in entries:  # registrations, before anything downstream can start
                    entry = dict(entry)
                    self.journal.write(entry.pop("event"), step=step.name, dir=step.dirname(), **entry)
                self.journal.write("step_finished", step=step.name, dir=step.dirname(), seconds=time.time() - started)
                _write_atomic(status_path, {"status": "SUCCESS", "owner": self.owner, "time": time.time()})

            # under the lease's lock and only while this runner holds it: one that lost the step while it
            # stalled commits nothing and writes no journal line
            if not lease.commit(commit):
                return self._lost(step, attempt, "finished, not committed"), None
            self.log(f"  {step.name}: done in {time.time() - started:.1f}s")
            return "SUCCESS", outcome
        finally:
            lease.release()

    def _wait_for(self, step: Step, lease: Lease, forced: bool) -> bool:
        """Take the step's lease, waiting while another runner holds it; True (the lease not taken) when
        the step was finished meanwhile."""
        waited = False
        while not lease.try_acquire():
            if not waited:
                self.log(f"  {step.name}: another runner holds it; waiting")
                waited = True
            time.sleep(min(1.0, lease_timeout() / 10))
            if read_status(self.prefix, step) == "SUCCESS" and not forced:
                return True
        return False

    def _failed(self, step: Step, attempt: Path, lease: Lease, status_path: Path, exc: BaseException) -> str:
        """A step's function raised (called while its exception is handled): the traceback in the attempt's
        error.txt, FAILED in the step's status and the journal; LOST where this runner no longer holds it."""
        tb, error = traceback.format_exc(), f"{type(exc).__name__}: {exc}"
        (attempt / "error.txt").write_text(tb)

        def failed() -> None:  # only while this runner holds the step: one that lost it writes nothing
            _write_atomic(status_path, {"status": "FAILED", "owner": self.owner, "time": time.time()})
            self.journal.write("step_failed", step=step.name, dir=step.dirname(),
                               error=error, traceback=tb, attempt=attempt.name)  # fmt: skip

        if lease.commit(failed):
            self.log(f"  {step.name}: FAILED ({error})")
            return "FAILED"
        return self._lost(step, attempt, error)

    def _record(self, step: Step, attempt: Path, out: Path, config, started: float, first_start: float, outcome):
        """A finished attempt's provenance.json and outcome.json (and its summary's paths) naming the step's
        output; returns (the outcome, the journal entries it asks for)."""
        # what names the attempt folder names the step's output once committed
        outcome = _rebase(dict(outcome or {}), str(attempt), str(out))
        entries = outcome.pop("journal", [])
        provenance = {
            "step": step.name,
            "experiment": self.exp.name,  # who produced this result first (a reuse does not change it)
            "identity": step.identity(),
            "config": config,
            "git": git_state(),
            "versions": versions(),
            "host": host(),
            "attempt": attempt.name,
            "start": started,
            "first_start": first_start,  # when the result became knowable (journal.judge)
            "end": time.time(),
        }
        _write_atomic(attempt / "provenance.json", provenance)
        _write_atomic(attempt / "outcome.json", outcome)
        summary = attempt / "summary.json"  # a training run's summary names its folder too
        if summary.is_file():
            with contextlib.suppress(ValueError):
                _write_atomic(summary, _rebase(json.loads(summary.read_text()), str(attempt), str(out)))
        return outcome, entries
