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

from moelab.lab.graph import Experiment, Step, resolve
from moelab.lab.journal import RUNNING, Journal, Running, judge
from moelab.train.record import git_state, host, versions


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
        needed = {id(d) for s in keep for d in _closure(s)}
        return [s for s in steps if id(s) in needed]

    def result(self, step: Step) -> dict | None:
        path = self.out(step) / "outcome.json"
        return json.loads(path.read_text()) if path.exists() else None

    def origin(self, step: Step) -> dict:
        """When and by which experiment ``step``'s result was produced: its provenance (the end of the
        run that made it), or, for an output without one, the outcome file's time."""
        out = self.out(step)
        prov = out / "provenance.json"
        try:
            p = json.loads(prov.read_text())
            return {"step": step.name, "dir": step.dirname(), "produced": float(p["end"]),
                    "experiment": p.get("experiment")}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            made = out / "outcome.json"
            when = made.stat().st_mtime if made.exists() else time.time()
            return {"step": step.name, "dir": step.dirname(), "produced": when, "experiment": None}

    def _reused(self, step: Step) -> dict | None:
        """A finished result taken as it is: recorded (``step_reused``, naming what it reuses)."""
        o = self.origin(step)
        self.journal.write("step_reused", step=step.name, dir=step.dirname(), produced=o["produced"],
                           produced_by=o["experiment"])  # fmt: skip
        return self.result(step)

    def outcome_origins(self) -> list[dict]:
        """The origin of every result the predicted metric is computed from: its step and everything
        upstream of it."""
        name = self.exp.prediction.metric.partition(":")[0]
        step = next((s for s in self.exp.all_steps() if s.name == name), None)
        if step is None:
            return []
        seen, out = set(), []
        for s in _closure(step):
            if id(s) not in seen:
                seen.add(id(s))
                out.append(self.origin(s))
        return out

    def run(self) -> dict:
        self.journal.declare(self.exp, [{"name": s.name, "dir": s.dirname()} for s in self.exp.all_steps()])
        steps = self.selected()
        # a forced step runs again, and so does everything downstream of it in this run
        self._forced = set()
        for s in steps:
            if (self.force and self.force.search(s.name)) or any(id(d) in self._forced for d in s.deps()):
                self._forced.add(id(s))
        status: dict[int, str] = {}
        results: dict[str, dict] = {}
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
                    if all(d == "SUCCESS" for d in deps) and len(running) < self.max_concurrent:
                        running[self._submit(pool, s)] = s
                if not running:
                    continue
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    s = running.pop(fut)
                    status[id(s)], outcome = fut.result()
                    if outcome is not None:
                        results[s.name] = outcome
        finally:
            pool.shutdown(wait=True)
        summary = {"steps": {s.name: status[id(s)] for s in steps}, "verdict": None, "post_hoc_verdict": None}
        if all(v == "SUCCESS" for v in summary["steps"].values()) and len(steps) == len(self.exp.all_steps()):
            # judged against the prediction on record before the first step started; a prediction
            # registered later is judged apart, and its verdict says it is post hoc
            official, late = judge(
                self.journal.read(), self.exp.prediction, self.exp.outcome(results), known=self.outcome_origins()
            )
            for v in (official, late):
                if v is not None:
                    self.journal.record_verdict(v)
            summary["verdict"], summary["post_hoc_verdict"] = official, late
        return summary

    def _submit(self, pool, step: Step):
        if self.backend == "ray":
            from moelab.lab.ray_backend import submit

            return submit(pool, self, step)
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
        waited = False
        while not lease.try_acquire():
            if not waited:
                self.log(f"  {step.name}: another runner holds it; waiting")
                waited = True
            time.sleep(min(1.0, lease_timeout() / 10))
            if read_status(self.prefix, step) == "SUCCESS" and not forced:
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
            running = RUNNING.set(Running(self.journal, step.name, step.dirname(), lease))
            try:
                outcome = (call or step.fn)(config, attempt)
            except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then re-raised if fatal
                tb = traceback.format_exc()
                (attempt / "error.txt").write_text(tb)
                held = lease.holds()  # a runner that lost the lease leaves the status to the one that has it
                if held:
                    _write_atomic(status_path, {"status": "FAILED", "owner": self.owner, "time": time.time()})
                self.journal.write(
                    "step_failed",
                    step=step.name,
                    dir=step.dirname(),
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=tb,
                    attempt=attempt.name,
                    **({} if held else {"lease_lost": True, "owner": self.owner}),
                )
                self.log(f"  {step.name}: FAILED ({type(exc).__name__}: {exc})")
                if not isinstance(exc, Exception):
                    raise
                return "FAILED", None
            finally:
                RUNNING.reset(running)
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
                "end": time.time(),
            }
            _write_atomic(attempt / "provenance.json", provenance)
            _write_atomic(attempt / "outcome.json", outcome)
            summary = attempt / "summary.json"  # a training run's summary names its folder too
            if summary.is_file():
                with contextlib.suppress(ValueError):
                    _write_atomic(summary, _rebase(json.loads(summary.read_text()), str(attempt), str(out)))

            def commit() -> None:
                if out.exists():  # a partial output of the old layout, or a forced step's: kept aside, not lost
                    os.rename(out, out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
                os.rename(attempt, out)
                with contextlib.suppress(OSError):  # no other attempt left: no empty folder beside the output
                    attempts.rmdir()
                _write_atomic(status_path, {"status": "SUCCESS", "owner": self.owner, "time": time.time()})

            if not lease.commit(commit):  # another runner took the step over while this one stalled
                self.journal.write("lease_lost", step=step.name, dir=step.dirname(), owner=self.owner,
                                   note="taken over while this runner stalled; its attempt was not committed",
                                   set_aside=f"{attempts.name}/{attempt.name}")  # fmt: skip
                self.log(f"  {step.name}: lease lost to another runner; its attempt stays in {attempt}")
                now = read_status(self.prefix, step)
                return (now, self.result(step)) if now == "SUCCESS" else ("FAILED", None)
            for entry in entries:  # registrations, before anything downstream starts
                entry = dict(entry)
                self.journal.write(entry.pop("event"), step=step.name, dir=step.dirname(), **entry)
            self.journal.write("step_finished", step=step.name, dir=step.dirname(), seconds=time.time() - started)
            self.log(f"  {step.name}: done in {time.time() - started:.1f}s")
            return "SUCCESS", outcome
        finally:
            lease.release()


def _closure(step: Step) -> list[Step]:
    out = [step]
    for d in step.deps():
        out.extend(_closure(d))
    return out
