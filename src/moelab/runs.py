"""What a run leaves on disk: config.json, metrics.jsonl, events.jsonl, ckpt/.

events.jsonl is append-only: launches, checkpoints, evals, skips, restores, resumes, failures,
the end. metrics.jsonl holds the surviving trajectory: on a resume or restore it is cut back to
the checkpoint's cursor, so a resumed run's metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from moelab import jsonl
from moelab.config import Config, config_from_dict
from moelab.errors import RecordError, RunRefused
from moelab.paths import as_path


def digest(text: str) -> str:
    """The hash a record names a file by (the first 12 hex of its sha256)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = self.path / "config.json"
        self.metrics = self.path / "metrics.jsonl"
        self.events = self.path / "events.jsonl"
        self._ckpt = None
        self.summary = self.path / "summary.json"

    @property
    def ckpt(self):
        """The run's checkpoint folder: its config's train.checkpoint_dir when set (any path Orbax's file
        layer takes: gs://...), else ``<run>/ckpt``."""
        if self._ckpt is not None:
            return self._ckpt
        try:
            where = json.loads(self.config.read_text())["config"]["train"].get("checkpoint_dir", "")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            where = ""
        if not where:
            return self.path / "ckpt"
        return as_path(where)

    @ckpt.setter
    def ckpt(self, where) -> None:
        self._ckpt = where

    def event(self, kind: str, **fields) -> dict:
        rec = {"time": time.time(), "event": kind, **fields}
        append_jsonl(self.events, rec)
        return rec

    def read_events(self) -> list[dict]:
        return read_jsonl(self.events)

    # ------------------------------------------------------------------ the learning-rate plan

    @property
    def lr_plan(self) -> Path:
        return self.path / "lr_plan.npy"

    def register_lr_plan(self, plan: np.ndarray, **fields) -> dict:
        """The rate each step should apply, as planned at this launch: lr_plan.npy and a ``schedule``
        event with its hash (a re-planned run's next launch registers its new plan)."""
        tmp = self.path / ".lr_plan.tmp.npy"
        np.save(tmp, np.asarray(plan, np.float64))
        os.replace(tmp, self.lr_plan)
        h = hashlib.sha256(self.lr_plan.read_bytes()).hexdigest()[:12]
        return self.event("schedule", hash=h, steps=len(plan), first=float(plan[0]), last=float(plan[-1]), **fields)

    def read_lr_plan(self) -> np.ndarray | None:
        return np.load(self.lr_plan) if self.lr_plan.is_file() else None

    # ------------------------------------------------------------------ the forecast the run is held to

    @property
    def forecast(self) -> Path:
        return self.path / "forecast.json"

    def forecast_versions(self) -> list[dict]:
        """The run's registered forecasts, oldest first: ``forecast`` events (version, hash, source)."""
        return [e for e in self.read_events() if e["event"] == "forecast"]

    def register_forecast(self, source: str, **fields) -> dict:
        """Record forecast.json as it is now as the run's next forecast version (its hash, and a copy
        forecast.vN.json); earlier versions stay."""
        text = self.forecast.read_text()
        version = len(self.forecast_versions()) + 1
        copy = self.path / f"forecast.v{version}.json"
        tmp = copy.with_name(f".{copy.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, copy)
        return self.event("forecast", version=version, hash=digest(text), source=source, path=copy.name, **fields)

    def verified_forecast(self) -> dict | None:
        """forecast.json, when it is the newest forecast the run registered (or the run registered
        none); RecordError, one line, when it was changed after it was registered."""
        if not self.forecast.is_file():
            return None
        text = self.forecast.read_text()
        versions = self.forecast_versions()
        if versions and digest(text) != versions[-1]["hash"]:
            raise RecordError(
                f"{self.forecast}: its hash {digest(text)} is not the registered forecast's {versions[-1]['hash']} "
                f"(version {versions[-1]['version']}); restore {versions[-1]['path']}, or re-forecast with `moelab replan`"
            )
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RecordError(
                f"{self.forecast}: not valid JSON; restore it from {self.path}/forecast.v*.json"
            ) from None

    def metrics_cursor(self) -> int:
        return self.metrics.stat().st_size if self.metrics.exists() else 0

    def truncate_metrics(self, cursor: int) -> None:
        if self.metrics.exists() and self.metrics.stat().st_size > cursor:
            with open(self.metrics, "r+b") as fh:
                fh.truncate(cursor)


def append_jsonl(path: Path, rec: dict) -> None:
    """One record appended whole (moelab.jsonl); a torn tail found before it is set aside beside the
    file and recorded as a ``torn_record`` event in the run's events.jsonl."""
    path = Path(path)
    torn = jsonl.append(path, jsonl.jsonable(rec))
    if torn is not None:
        jsonl.append(path.parent / "events.jsonl", {"time": time.time(), "event": "torn_record", **torn})


def read_jsonl(path: Path) -> list[dict]:
    """The file's whole records (a torn tail is not one; a bad line in the middle: RecordError)."""
    return jsonl.read(path)


def branch_point(run_dir: str | Path) -> dict | None:
    """The ``branch`` event of a run that was branched from another (parent, step), else None."""
    for e in read_jsonl(Path(run_dir) / "events.jsonl"):
        if e.get("event") == "branch":
            return e
    return None


def git_state() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": None, "dirty": None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("moelab", "jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def host() -> dict:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pid": os.getpid(),
    }


def load_run_config(run_dir: str | Path) -> Config:
    """A run directory's config.json, or RunRefused naming the directory."""
    run = RunDir(run_dir)
    if not run.config.is_file():
        raise RunRefused(f"{run_dir}: no config.json; is this a run directory?")
    try:
        saved = json.loads(run.config.read_text(encoding="utf-8"))
        data = saved["config"]
    except (ValueError, KeyError, TypeError):
        raise RunRefused(
            f"{run.config}: not a run's config (truncated or edited?); restore it, or train the run again"
        ) from None
    return config_from_dict(data, source=str(run.config))
