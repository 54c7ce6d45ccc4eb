"""A run's speed against the device's peak (MFU) and its summary (summary.json)."""

from __future__ import annotations

import json
import math

import jax
import numpy as np

from moelab import accounting, devices
from moelab.cache import cached_matmul_peak
from moelab.config import Config, phase_config, phase_seq_lens
from moelab.progress import say
from moelab.runs import RunDir


def matmul_dtype(cfg: Config, backend: str | None = None) -> str:
    """The precision the matmuls run in: the compute dtype, except float32 on an NVIDIA GPU under
    model.matmul_precision default or high, which runs as TF32 on the tensor cores (so MFU against
    the float32 peak could pass 100%)."""
    m = cfg.model
    backend = backend or jax.default_backend()
    if m.dtype == "float32" and backend == "gpu" and m.matmul_precision != "highest":
        return "tensorfloat32"
    return m.dtype


def set_matmul_precision(cfg: Config) -> None:
    """model.matmul_precision, set explicitly for the run (JAX's own default otherwise depends on the backend)."""
    p = cfg.model.matmul_precision
    jax.config.update("jax_default_matmul_precision", None if p == "default" else p)


def device_peak(cfg: Config, progress: bool = False) -> tuple[float | None, str]:
    """One device's peak FLOP/s in the compute dtype, for MFU, and where it comes from:
    ``train.peak_flops``, the published table (moelab/devices.py) for a known accelerator, or the
    measured matmul rate on a CPU. None (MFU not reported) for an accelerator not in the table."""
    dtype = matmul_dtype(cfg)
    if cfg.train.peak_flops:
        return float(cfg.train.peak_flops), "train.peak_flops"
    kind = jax.devices()[0].device_kind
    published = devices.peak_flops(kind, dtype)
    if published:
        return published, f"published {dtype} peak of {devices.of_kind(kind).name}"
    if jax.default_backend() == "cpu":
        say(f"this machine's {dtype} matmul peak, for MFU (measured once a week)", progress)
        return cached_matmul_peak(dtype=dtype), f"measured {dtype} matmul rate of this CPU"
    say(f"no published {dtype} peak for {kind!r}: MFU is not reported; set train.peak_flops", progress)
    return None, "unknown"


def summarize(run: RunDir, cfg: Config, peak: float | None = None, peak_source: str = "") -> dict:
    recs = [json.loads(x) for x in run.metrics.read_text().splitlines() if x.strip()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    eval_recs = [r for r in recs if r["kind"] == "eval"]
    out = {"run": str(run.path), "steps": cfg.train.steps}
    if train_recs:
        tail = train_recs[-max(1, len(train_recs) // 4) :]
        out.update(
            final_loss=train_recs[-1]["loss"],
            dropped_frac=float(np.mean([r["dropped_frac"] for r in tail])),
            spilled_frac=float(np.mean([r["spilled_frac"] for r in tail])),
        )
        # steady-state speed: the steps that did not compile (none in a run of a step or two)
        timed = [r for r in tail if math.isfinite(r.get("tokens_per_s", math.nan))] or [
            r for r in train_recs if math.isfinite(r.get("tokens_per_s", math.nan))
        ]
        if timed:
            out["tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in timed]))
            n_dev = cfg.mesh.data * cfg.mesh.expert
            out["tokens_per_s_per_device"] = out["tokens_per_s"] / n_dev
            out["flops_per_s_per_device"] = (
                out["tokens_per_s_per_device"]
                * 3
                * accounting.count(phase_config(cfg, len(phase_seq_lens(cfg)) - 1)).forward_flops_per_token
            )
            out["mfu"] = float(np.median([r["mfu"] for r in timed]))
    if eval_recs:
        out["first_eval"] = {"loss": eval_recs[0]["loss"], "bpb": eval_recs[0]["bpb"]}
        out["final_eval"] = {k: eval_recs[-1][k] for k in ("loss", "bpb", "loss_dropless", "bpb_dropless")}
        if eval_recs[-1].get("tasks"):  # train.task_evals: the scores at the start and the end
            out["first_tasks"], out["final_tasks"] = eval_recs[0].get("tasks", {}), eval_recs[-1]["tasks"]
    if peak:
        out["peak_flops"] = peak  # one device's, in the compute dtype; MFU is per device
        out["peak_source"] = peak_source
    out["devices"] = cfg.mesh.data * cfg.mesh.expert
    return out
