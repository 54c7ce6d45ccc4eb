"""Ready-made steps: train a config, evaluate a checkpoint. Experiments compose them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.config import Config, config_from_dict, config_hash, load_config, step_dict
from moelab.errors import ConfigError, ExperimentError, RecordError
from moelab.lab.graph import Step, versioned
from moelab.lab.journal import RUNNING
from moelab.ladder.forecast import forecast
from moelab.ladder.law import DEFAULT_LAW
from moelab.ladder.plan import load_ladder, rung_config, rung_runs
from moelab.monitor.health import check_run
from moelab.runs import RunDir, load_run_config, read_jsonl
from moelab.train.branch import branch_config, branch_point, start_branch
from moelab.train.evaluate import evaluate_run
from moelab.train.init_from import init_overrides
from moelab.train.loop import train
from moelab.train.trackers import make_trackers


def step_config(cfg: dict):
    if "resolved" in cfg:  # a whole config, as a ladder's rule made it
        return config_from_dict(cfg["resolved"])
    return load_config(cfg["config"], list(cfg.get("overrides", [])))


def run_train(cfg: dict, out: Path) -> dict:
    if cfg.get("forecast") and not (out / "forecast.json").exists():
        # the registered forecast goes into the run before its first step: the loop monitors against it
        tmp = out / ".forecast.json.tmp"
        shutil.copyfile(cfg["forecast"], tmp)
        tmp.replace(out / "forecast.json")

    running = RUNNING.get()
    on_update = forecast_update_writer(running)
    stop = None
    if running is not None and running.lease is not None:
        # another runner took this step over while we stalled: stop training into it

        def stop() -> bool:
            return running.lease.lost

    config = step_config(cfg)
    trackers = []
    if config.train.trackers:  # mirrored live, tagged with the experiment and the step
        tags = [running.journal.path.parent.name, running.step] if running is not None else []
        trackers = make_trackers([], config, out, tags=tags)
    # a rerun of a failed step continues from its newest checkpoint, or starts over when it died before one
    return train(config, out, resume=True, restart=True, progress=cfg.get("progress", True), on_forecast_update=on_update,
                 stop=stop, trackers=trackers)  # fmt: skip


def forecast_update_writer(running):
    """What a training step calls with each refit of its forecast: a ``forecast_updated`` line in the
    experiment's journal, written only while the step's runner holds its lease (``Running.write``),
    so a runner that lost the step writes nothing more. None outside a lab step."""
    if running is None:
        return None

    def on_update(upd: dict) -> None:
        running.write("forecast_updated", at_step=upd["at_step"], law=upd["law"], final=upd["final"],
                      note="an update; the registered forecast stays what is judged")  # fmt: skip

    return on_update


def _estimate(cfg: dict) -> dict:
    c = step_config(cfg)
    tokens = accounting.run_tokens(c)
    return {"flops": accounting.run_train(c)["train_flops"], "tokens": tokens}


def train_step(
    name: str, config, overrides: list[str] = (), *, forecast=None, progress: bool = True, **resources
) -> Step:
    """Train ``config`` (a preset or YAML path with ``overrides``, or a Config object); all versioned.

    ``forecast``: ``output_of(a forecast step) / "forecast.json"``; the run is monitored against it
    (and against the rungs it came from) from its first step."""
    if isinstance(config, Config):
        fields = {"resolved": versioned(step_dict(config)), "name": config.name}
    else:
        static = isinstance(config, (str, Path)) and all(isinstance(o, str) for o in overrides)
        resolved = None
        if static:  # refused when the experiment loads, before any step runs (and in --dry-run alike)
            try:
                resolved = load_config(config, list(overrides))
            except ConfigError as exc:
                raise ExperimentError(f"step {name!r}: {'; '.join(exc.errors)}") from None
        fields = {"config": versioned(config), "overrides": versioned(list(overrides))}
        if resolved is not None and Path(str(config)).is_file():
            # a config file is named by its path: its contents (and its base:'s) are the step's identity
            # too, so an edited file is a new step, not a finished one reused
            fields["config_hash"] = versioned(config_hash(resolved))
    if forecast is not None:
        fields["forecast"] = versioned(forecast)
    return Step(
        name=name,
        fn=run_train,
        config={**fields, "progress": progress},
        resources=resources,
        estimate=_estimate,
    )


def _branch(cfg: dict, out: Path) -> dict:
    branch = branch_config(load_run_config(cfg["parent"]), cfg["at"], cfg["steps"], list(cfg.get("overrides", [])),
                           cfg.get("run_name", ""))  # fmt: skip
    if branch_point(out) is None:  # a rerun of a failed branch resumes it; a new one starts from the parent
        start_branch(cfg["parent"], cfg["at"], out, branch)
    return train(branch, out, resume=True, restart=True, progress=cfg.get("progress", True))


def branch_step(name: str, parent, at: int, steps: int, overrides: list[str] = (), *, run_name: str = "",
                progress: bool = True) -> Step:  # fmt: skip
    """A run from ``parent``'s checkpoint at step ``at`` (``output_of(a train step)``, trained with
    ``train.keep_steps`` naming ``at``) with a horizon of ``steps`` (moelab.train.branch); the parent
    is a dependency of the step, so the graph records it and the branch's identity follows it."""
    return Step(
        name=name,
        fn=_branch,
        config={
            "parent": versioned(parent),
            "at": versioned(int(at)),
            "steps": versioned(int(steps)),
            "overrides": versioned(list(overrides)),
            "run_name": run_name,
            "progress": progress,
        },  # fmt: skip
    )


def _finetune(cfg: dict, out: Path) -> dict:
    base = load_config(cfg["config"], list(cfg["overrides"]))
    spec = str(cfg["parent"]) + (f":{cfg['at']}" if cfg.get("at") is not None else "")
    config = load_config(cfg["config"], [*cfg["overrides"], *init_overrides(spec, base, "parent")])
    return train(config, out, resume=True, restart=True, progress=cfg.get("progress", True))


def finetune_step(name: str, parent, config, overrides: list[str] = (), *, at: int | None = None,
                  progress: bool = True) -> Step:  # fmt: skip
    """Fine-tune: train ``config`` (a preset or YAML path with ``overrides``) from the weights of
    ``parent`` (``output_of(a train step)``) at its checkpoint ``at`` (its newest by default), with its
    own optimizer, schedule and data (moelab.train.init_from); the parent is a dependency of the step,
    so the graph records it and the fine-tune's identity follows it."""
    return Step(
        name=name,
        fn=_finetune,
        config={
            "parent": versioned(parent),
            "at": versioned(None if at is None else int(at)),
            "config": versioned(config),
            "overrides": versioned(list(overrides)),
            "progress": progress,
        },  # fmt: skip
    )


def ladder_steps(ladder_path: str, *, progress: bool = True, prefix: str = "") -> tuple[list[Step], object]:
    """One training step per rung (and seed) of a ladder plan, and the target's config (None without one)."""
    ladder = load_ladder(ladder_path)
    rungs = [train_step(f"{prefix}{name}", cfg, progress=progress) for name, cfg in rung_runs(ladder)]
    target = rung_config(ladder, len(ladder.widths)) if ladder.target_width else None
    return rungs, target


def _forecast(cfg: dict, out: Path) -> dict:
    target = step_config(cfg["target"])
    fc = forecast(cfg["rungs"], target, law=cfg.get("law") or DEFAULT_LAW, e=cfg.get("e"), floor=cfg.get("floor"),
                  n_boot=cfg.get("n_boot") or 200, prior=cfg.get("prior"))  # fmt: skip
    text = json.dumps(fc, indent=1)
    tmp = out / ".forecast.json.tmp"
    tmp.write_text(text)
    tmp.replace(out / "forecast.json")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    final = {"loss": fc["loss"][-1], "low": fc["low"][-1], "high": fc["high"][-1], "fraction": fc["fractions"][-1]}
    return {
        "hash": digest,
        "law": fc["law"],
        "target": target.name,
        "target_flops": fc["target_flops"],
        "final": final,
        # the runner writes these into the experiment's journal before any step that needs this one starts
        "journal": [
            {
                "event": "forecast_registered",
                "hash": digest,
                "path": str(out / "forecast.json"),
                "law": fc["law"],
                "target": target.name,
                "target_steps": target.train.steps,
                "final_loss": final["loss"],
                "band": [final["low"], final["high"]],
                "rungs": list(cfg["rungs"]),
            }
        ],
    }


def forecast_step(
    name: str,
    rungs: list,
    target,
    *,
    law: str | None = None,
    e: float | None = None,
    floor: dict | None = None,
    n_boot: int = 200,
    prior: dict | None = None,
) -> Step:
    """Forecast ``target`` (a Config) from ``rungs`` (``output_of(rung)`` each) by ``law`` (default:
    moelab.ladder.law.DEFAULT_LAW; ``per-fraction`` is Marin's form): forecast.json, its hash
    registered in the journal before the target trains. ``floor`` ({"sd", "dof"}): a run-to-run spread
    measured apart, pooled with the rungs' own (a ladder of too few seeds needs it). ``prior``: the
    recipe's prior file's content (moelab.ladder.prior.load_prior(...).to_dict()), which the prior
    laws need; hashed with the step, so a new prior is a new forecast."""
    return Step(
        name=name,
        fn=_forecast,
        forecast=True,
        config={
            "rungs": versioned(list(rungs)),
            "target": {"resolved": versioned(step_dict(target))},
            "law": versioned(law or DEFAULT_LAW),
            "e": versioned(e),
            "floor": versioned(floor),
            "n_boot": versioned(n_boot),
            **({"prior": versioned(prior)} if prior is not None else {}),  # absent: earlier steps' hashes kept
        },
    )


def _health(cfg: dict, out: Path) -> dict:
    run = Path(cfg["run"])
    fc = RunDir(run).verified_forecast()  # the run's newest registered forecast, unchanged since, or refused
    versions = RunDir(run).forecast_versions()
    running = RUNNING.get()
    if fc is not None and versions and running is not None:  # and every version of it is in the journal
        journal = running.journal
        registered = {e["hash"] for e in journal.read() if e["event"] == "forecast_registered"}
        missing = [v for v in versions if v["hash"] not in registered]
        if missing:
            raise RecordError(
                f"{run}/{missing[0]['path']}: forecast version {missing[0]['version']} (hash {missing[0]['hash']}) "
                f"is not registered in {journal.path}; the run was held to a forecast the experiment never registered"
            )
    recs = read_jsonl(run / "metrics.jsonl")
    mon, checks = check_run(run, fc)
    result = {"alerts": sum(f.level == "ALERT" for f in mon.findings), "checks": checks,
              "forecast_versions": [{k: v.get(k) for k in ("version", "hash", "source", "reason", "step")} for v in versions]}  # fmt: skip
    if fc:
        agg = fc.get("metric", "macro")  # what the forecast is of (older forecasts: the macro loss)
        actual = {r["step"]: r["loss_dropless"][agg] for r in recs if r.get("kind") == "eval"}
        points = [
            {"fraction": f, "step": s, "predicted": p, "low": lo, "high": hi, "actual": actual[s], "error": p / actual[s] - 1}
            for f, s, p, lo, hi in zip(fc["fractions"], fc["steps"], fc["loss"], fc["low"], fc["high"], strict=True)
            if s in actual
        ]  # fmt: skip
        if points:
            errs = np.array([p["error"] for p in points])
            late = np.array([abs(p["error"]) for p in points if p["fraction"] > 0.2 + 1e-9] or [np.nan])
            last = points[-1]
            result["forecast"] = {
                "law": fc.get("law", "per-fraction"),
                "metric": agg,
                "points": points,
                "final_error_pct": 100 * last["error"],
                "mean_abs_error_pct": float(100 * np.mean(np.abs(errs))),
                "max_abs_error_pct": float(100 * np.max(np.abs(errs))),
                "mean_abs_error_past_20_pct": float(100 * np.mean(late)),
                "max_abs_error_past_20_pct": float(100 * np.max(late)),
                "final_band_pct": [
                    100 * (last["low"] / last["predicted"] - 1),
                    100 * (last["high"] / last["predicted"] - 1),
                ],
                "inside_band": int(sum(p["low"] <= p["actual"] <= p["high"] for p in points)),
            }
    (out / "health.json").write_text(json.dumps(result, indent=1))
    return result


def health_step(name: str, run) -> Step:
    """The health summary of a finished run (``output_of(train)``), and its forecast's error."""
    return Step(name=name, fn=_health, config={"run": versioned(run)})


def _evaluate(cfg: dict, out: Path) -> dict:
    result = evaluate_run(cfg["run"], cfg.get("checkpoint"), progress=False)
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def eval_step(name: str, run, checkpoint: int | None = None) -> Step:
    """Evaluate a training step's newest (or a given) checkpoint: ``run`` is ``output_of(train)``."""
    return Step(name=name, fn=_evaluate, config={"run": versioned(run), "checkpoint": versioned(checkpoint)})
