"""What moelab keeps between runs under MOELAB_CACHE (.moelab_cache): the machine's measured matmul
peak, XLA's compiled programs and results remembered for the code and machine that computed them."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

from moelab.errors import UsageError
from moelab.jsonl import jsonable


def cache_root() -> Path:
    """MOELAB_CACHE (``.moelab_cache`` by default); a file there is refused in one line."""
    root = Path(os.environ.get("MOELAB_CACHE", ".moelab_cache"))
    if root.exists() and not root.is_dir():
        raise UsageError(f"MOELAB_CACHE: {root} is a file, not a folder; point it at a folder (or unset it)")
    return root


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
    import jax

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

    path = cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path.absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@functools.cache
def code_fingerprint() -> str:
    """A hash of moelab's own source (every .py of the package, 75 files in 3 ms): a result kept in the
    cache names the code that computed it, so an edit is never answered by an older computation."""
    root = Path(__file__).resolve().parents[0]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _memo_path(kind: str, key: dict) -> Path:
    """Where the cache keeps the result of computation ``kind`` for ``key``: the key with what else
    decides a result (moelab's code, the versions of JAX, jaxlib and NumPy, XLA's and JAX's settings in
    the environment, the backend and its devices, the machine) hashed into its name."""
    import jax

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
        tmp.write_text(json.dumps({"kind": kind, "time": time.time(), "value": jsonable(value)}))
        tmp.replace(path)
    except OSError:
        pass
