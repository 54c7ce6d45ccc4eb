"""What a run leaves on disk: config.json, metrics.jsonl, events.jsonl, ckpt/.

events.jsonl is append-only: launches, checkpoints, evals, skips, restores, resumes, failures,
the end. metrics.jsonl holds the surviving trajectory: on a resume or restore it is cut back to
the checkpoint's cursor, so a resumed run's metrics equal an uninterrupted run's.
"""

from __future__ import annotations

import functools
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
        from moelab.train.checkpoint import as_path

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


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__array__"):
        arr = np.asarray(x)
        return arr.item() if arr.ndim == 0 else arr.tolist()
    return x


def append_jsonl(path: Path, rec: dict) -> None:
    """One record appended whole (moelab.jsonl); a torn tail found before it is set aside beside the
    file and recorded as a ``torn_record`` event in the run's events.jsonl."""
    path = Path(path)
    torn = jsonl.append(path, _jsonable(rec))
    if torn is not None:
        jsonl.append(path.parent / "events.jsonl", {"time": time.time(), "event": "torn_record", **torn})


def read_jsonl(path: Path) -> list[dict]:
    """The file's whole records (a torn tail is not one; a bad line in the middle: RecordError)."""
    return jsonl.read(path)


def git_state() -> dict:
    root = Path(__file__).resolve().parents[3]
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


def matmul_peak(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 3, dtype: str = "float32") -> float:
    """Best FLOP/s of a square matmul in ``dtype`` (the model's compute dtype) over a few sizes, on
    one device: the machine's own peak for MFU."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in sizes:
        a = jnp.ones((n, n), jnp.dtype(dtype))
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


PEAK_MAX_AGE_S = 7 * 86400  # a machine's measured peak is measured again after a week


def cached_matmul_peak(dtype: str = "float32") -> float:
    """``matmul_peak`` measured once per machine, device kind, dtype and JAX version and kept in the
    cache (MOELAB_CACHE/peaks.json) for a week: a run's start does not wait seconds for it."""
    import platform

    import jax

    from moelab.data.sources import cache_root

    path = cache_root() / "peaks.json"
    key = f"{platform.node()}|{jax.devices()[0].device_kind}|{dtype}|{jax.__version__}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    hit = known.get(key)
    if isinstance(hit, dict) and time.time() - hit.get("time", 0) < PEAK_MAX_AGE_S and hit.get("flops", 0) > 0:
        return float(hit["flops"])
    peak = matmul_peak(dtype=dtype)
    known[key] = {"flops": peak, "time": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"peaks.json.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measured again next time
    return peak


def enable_compile_cache() -> None:
    """Keep compiled XLA programs on disk (MOELAB_CACHE/jax): a rerun or resume skips most compiling."""
    import jax

    from moelab.data.sources import cache_root

    path = cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path.absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@functools.cache
def code_fingerprint() -> str:
    """A hash of moelab's own source (every .py of the package, 75 files in 3 ms): a result kept in the
    cache names the code that computed it, so an edit is never answered by an older computation."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _memo_path(kind: str, key: dict) -> Path:
    """Where the cache keeps the result of computation ``kind`` for ``key``: the key with what else
    decides a result (moelab's code, the versions of JAX, jaxlib and NumPy, XLA's and JAX's settings in
    the environment, the backend and its devices, the machine) hashed into its name."""
    import jax

    from moelab.data.sources import cache_root

    env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}
    whole = {"kind": kind, "key": key, "code": code_fingerprint(), "env": env, "machine": platform.node(),
             "versions": [metadata.version(p) for p in ("jax", "jaxlib", "numpy")],
             "devices": [jax.default_backend(), *sorted({d.device_kind for d in jax.devices()}), jax.device_count()],
             "x64": bool(jax.config.jax_enable_x64)}  # fmt: skip
    name = hashlib.sha256(json.dumps(whole, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_root() / "memo" / kind / f"{name}.json"


def remembered(kind: str, key: dict):
    """The result ``remember`` kept for computation ``kind`` of ``key`` (and all the rest that decides
    it: ``_memo_path``), or None."""
    try:
        return json.loads(_memo_path(kind, key).read_text())["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember(kind: str, key: dict, value) -> None:
    """Keep ``value`` (JSON) as computation ``kind``'s result for ``key``, written whole or not at all;
    a cache that cannot be written is left alone (the computation runs again next time)."""
    path = _memo_path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"kind": kind, "time": time.time(), "value": _jsonable(value)}))
        tmp.replace(path)
    except OSError:
        pass


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
