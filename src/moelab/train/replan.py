"""Re-planning a run's horizon: `moelab replan RUN_DIR --tokens NEW_TOTAL --reason TEXT`.

When a run is delayed (or given more compute), Marin re-plans instead of extending: from the
current step the learning-rate decay is re-timed to reach ``min_lr_ratio * peak`` at the new end
with no jump, the data mixture's phase boundaries that are still ahead move with the horizon, the
forecast is recomputed for the new horizon, and the change is an event with its reason.

The change lives in the run's config as ``train.replans``: ``AT:OLD->NEW`` means that from step AT
on the run's horizon is NEW steps instead of OLD; ``train.steps`` is the newest horizon. The
schedule (moelab.schedule.lr_factor) and the mixture (moelab.data.mixture) read it from there,
so a resumed run follows the new plan.

It lives with training, not the ladder: it rewrites a run (its config, its events, a new version of
its forecast) from its newest checkpoint on; the ladder's part is the forecast it asks for.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from moelab.config import config_hash, load_config, to_dict
from moelab.errors import ForecastError, ReplanError
from moelab.ladder import DEFAULT_LAW
from moelab.ladder.forecast import forecast
from moelab.runs import RunDir, load_run_config
from moelab.schedule import hyper, lr_factor, parse_replans, phase_boundaries  # noqa: F401 - the replan's own terms
from moelab.train import checkpoint

COVERED = 0.25  # a ladder's forecast is trusted for horizons within 25% of the planned one


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


MAX_STEPS = 2**31 - 1  # the step counter is an int32 in the optimiser's state


def replan(run_dir: str | Path, tokens: float, reason: str, ladder: list[str] | None = None) -> dict:
    """Change the run's horizon to ``tokens`` training tokens from its newest checkpoint on.

    Returns what changed: steps, learning rates at the change and at the new end, phase
    boundaries, the forecast, and a warning when the new horizon is more than 25% from the plan.
    """
    run = RunDir(run_dir)
    if not run.config.is_file():
        raise ReplanError(f"{run.path}: no config.json; is this a training run directory?")
    if not reason.strip():
        raise ReplanError("--reason: say why the horizon changes; it goes into the run's record")
    cfg = load_run_config(run.path)
    per_step = cfg.train.batch_size * cfg.model.seq_len
    if not math.isfinite(tokens) or tokens <= 0:
        raise ReplanError(f"--tokens: must be a finite number of tokens > 0, got {tokens}")
    if tokens / per_step >= MAX_STEPS:
        raise ReplanError(
            f"--tokens: {tokens:.6g} tokens is {tokens / per_step:.3g} steps of {per_step} tokens, beyond the "
            f"{MAX_STEPS:,} steps a run can count; give fewer"
        )
    new_steps = int(round(tokens / per_step))
    done = checkpoint.steps(run.ckpt)
    at = done[-1] if done else 0
    if new_steps <= at:
        raise ReplanError(
            f"--tokens: {tokens:.6g} tokens is {new_steps} steps of {per_step} tokens, not beyond the newest "
            f"checkpoint at step {at}; give more than {at * per_step} tokens"
        )
    old_steps = cfg.train.steps
    if new_steps == old_steps:
        raise ReplanError(f"--tokens: {tokens:.6g} tokens is the run's current horizon of {old_steps} steps")
    spec = f"{at}:{old_steps}->{new_steps}"
    new_cfg = load_config(cfg, [f"train.steps={new_steps}", f"train.replans=[{', '.join((*cfg.train.replans, spec))}]"])
    h_old, h_new = hyper(cfg), hyper(new_cfg)
    lr_old = lambda s: h_old.peak_lr * float(lr_factor(s, h_old))  # noqa: E731
    lr_new = lambda s: h_new.peak_lr * float(lr_factor(s, h_new))  # noqa: E731
    first_plan = h_new.steps
    off = new_steps / first_plan - 1
    warning = None
    if abs(off) > COVERED:
        warning = (
            f"the new horizon of {new_steps} steps is {off:+.0%} from the planned {first_plan}: past "
            f"{COVERED:.0%}, the ladder no longer covers the plan; re-run the ladder at this horizon to trust "
            "the forecast"
        )
    change = {
        "at_step": at,
        "old_steps": old_steps,
        "new_steps": new_steps,
        "old_tokens": old_steps * per_step,
        "new_tokens": new_steps * per_step,
        "reason": reason,
        "spec": spec,
        "lr_at_change": {"before": lr_old(at), "after": lr_new(at)},
        "lr_at_new_end": lr_new(new_steps - 1),
        "phase_starts": {
            "before": list(phase_boundaries(cfg.data.phase_starts, cfg.train)),
            "after": list(phase_boundaries(new_cfg.data.phase_starts, new_cfg.train)),
        },
        "warning": warning,
        "forecast": _reforecast(run.path, new_cfg, ladder, len(new_cfg.train.replans), reason),
        "time": time.time(),
    }
    # the config last: a failure above leaves the run as it was
    _write_atomic(run.config, json.dumps({"hash": config_hash(new_cfg), "config": to_dict(new_cfg)}, indent=1))
    run.event("replan", **change)
    return change


def _reforecast(run_dir: Path, cfg, ladder: list[str] | None, n: int, reason: str) -> dict:
    """The forecast for the new plan, from the rungs the old forecast used (or ``ladder``), by the
    old forecast's law: a joint law reads the re-planned schedule as it will run; the per-fraction
    form can only stretch its fractions over the new horizon. It is a new version of the run's
    forecast (forecast.vN.json; the old versions stay) and an event; ``registration`` is what the
    journals of experiments that include this run record (`moelab replan` writes it there)."""
    run = RunDir(run_dir)
    old = run.verified_forecast()  # a forecast changed after it was registered is refused here
    rungs = ladder or (old or {}).get("rungs")
    if not rungs:
        return {"status": "none", "note": "the run has no forecast.json and no --ladder was given"}
    law = (old or {}).get("law", "per-fraction" if old else DEFAULT_LAW)  # a forecast without a law is Marin's form
    try:
        fc = forecast(rungs, cfg, law=law, e=(old or {}).get("e"), target_name=(old or {}).get("target", cfg.name),
                      agg=(old or {}).get("metric", "macro" if old else "mix"))  # fmt: skip
    except ForecastError as exc:
        raise ReplanError(f"--ladder: {exc}; pass the rungs' run directories with --ladder") from None
    fc.update(replan=n)
    if old is not None and not run.forecast_versions():
        run.register_forecast("before replan")  # a forecast placed by hand, never launched with
    _write_atomic(run.forecast, json.dumps(fc, indent=1))
    reg = run.register_forecast("replan", replan=n, reason=reason, law=law)
    entry = {"hash": reg["hash"], "version": reg["version"], "path": str(run_dir / reg["path"]), "law": law,
             "target": fc["target"], "target_steps": fc["target_steps"], "final_loss": fc["loss"][-1],
             "band": [fc["low"][-1], fc["high"][-1]], "reason": f"replan: {reason}"}  # fmt: skip
    return {"status": "recomputed", "law": law, "path": str(run.forecast), "version": reg["version"], "hash": reg["hash"],
            "target_flops": fc["target_flops"], "points": len(fc["fractions"]), "final": fc["loss"][-1],
            "registration": entry}  # fmt: skip
