"""What `moelab run`, `moelab issue` and `moelab change` do with an experiment file (`moelab status`
reads the journals alone: ``moelab.lab.journal.status_rows``)."""

from __future__ import annotations

import json
import math
import runpy
import time
from pathlib import Path

from moelab import accounting
from moelab.cache import matmul_peak
from moelab.errors import ExperimentError, RunRefused
from moelab.lab.executor import Runner, read_status
from moelab.lab.graph import Experiment, resolve
from moelab.lab.journal import Journal, attempt_rows, headline, record
from moelab.lab.steps import run_train, step_config
from moelab.runs import load_run_config


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"{path}: no such experiment file")
    try:
        namespace = runpy.run_path(str(path))
    except ExperimentError as exc:
        raise ExperimentError(f"{path}: {exc}") from None
    except Exception as exc:
        raise ExperimentError(f"{path}: fails to load ({type(exc).__name__}: {exc})") from None
    exp = namespace.get("experiment")
    if not isinstance(exp, Experiment):
        raise ExperimentError(f"{path}: defines no `experiment = Experiment(...)`")
    problem = prediction_problem(exp)
    if problem:
        raise ExperimentError(f"{path}: the prediction {problem}")
    return exp


def prediction_problem(exp: Experiment) -> str | None:
    """What makes the experiment's prediction unjudgeable, or None."""
    p = exp.prediction
    numbers = {
        "value": p.value,
        "low": p.low,
        "high": p.high,
        "falsify_low": p.falsify_low,
        "falsify_high": p.falsify_high,
    }
    for k, v in numbers.items():
        if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)):
            return f"{k}={v!r} is not a finite number"
    if not p.low <= p.high:
        return f"interval [{p.low:g}, {p.high:g}] has low above high"
    if not p.low <= p.value <= p.high:
        return f"value {p.value:g} is outside its own interval [{p.low:g}, {p.high:g}]"
    lo, hi = p.bounds()
    if lo > p.low or hi < p.high:
        return f"falsification bounds [{lo:g}, {hi:g}] must hold the interval [{p.low:g}, {p.high:g}]"
    step, sep, _ = p.metric.partition(":")
    names = [s.name for s in exp.all_steps()]
    if not sep or step not in names:
        return f"metric {p.metric!r} names no step of the experiment (STEP:key.path; steps: {', '.join(names)})"
    return None


def dry_run(runner: Runner, flops_per_s: float | None = None) -> list[dict]:
    """Each step's status, estimated FLOPs and time, and output path; runs nothing."""
    rate = flops_per_s or measured_rate(runner.prefix) or 0.3 * matmul_peak()
    rows = []
    for step in runner.selected():
        est = step.estimate(_resolved(runner, step)) if step.estimate else {}
        flops = est.get("flops")
        rows.append(
            {
                "step": step.name,
                "status": read_status(runner.prefix, step),
                "flops": flops,
                "seconds": flops / rate if flops else None,
                "output": str(runner.out(step)),
                "deps": [d.name for d in step.deps()],
            }
        )
    return rows


def _resolved(runner: Runner, step):
    return resolve(step.config, lambda s: str(runner.out(s)))


def measured_rate(prefix: Path) -> float | None:
    """Model FLOP/s achieved by earlier training steps under this prefix (their summaries)."""
    rates = []
    for summary in Path(prefix).glob("*/summary.json"):
        s = json.loads(summary.read_text())
        if s.get("mfu") and s.get("peak_flops"):
            rates.append(s["mfu"] * s["peak_flops"] * s.get("devices", 1))
    return max(rates) if rates else None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def issue_markdown(exp: Experiment, prefix: Path) -> str:
    """GitHub-issue markdown: description, goal, hypothesis, prediction, config, results and verdict."""
    runner = Runner(exp, prefix, log=lambda *_: None)
    events = Journal(runner.journal.path).read()
    rec = record(events)
    lines = [f"# {exp.title}", "", f"Experiment `{exp.name}`, issue #{exp.issue}.", ""]
    if exp.description:
        lines += [exp.description, ""]
    lines += [
        "## Goal",
        "",
        exp.goal,
        "",
        "## Hypothesis",
        "",
        exp.hypothesis,
        "",
        "## Pre-registered prediction",
        "",
    ]
    pre = rec["prediction"]
    if pre is not None:
        lines += [f"- {pre['text']}", f"- prediction hash `{pre['hash']}`, version {pre['version']}, registered "
                  f"{_when(pre['time'])}" + (f", before the first step started {_when(rec['first_step'])}" if rec["first_step"] else "")]  # fmt: skip
        if pre["hash"] != exp.prediction.digest():
            lines += [
                f"- the experiment file now predicts: {exp.prediction.describe()} (not registered before the run)"
            ]
    else:
        lines += [
            f"- {exp.prediction.describe()}",
            f"- prediction hash `{exp.prediction.digest()}` (registered when it first runs)",
        ]
    for p in rec["post_hoc_predictions"]:
        lines += [
            f"- POST HOC (registered {_when(p['time'])}, after the first step started): version {p['version']}: {p['text']}"
        ]
    lines += ["", "## Steps and configs", ""]
    lines += ["| step | output | config | parameters (total / active) | training FLOPs |", "|---|---|---|---|---|"]
    for step in exp.all_steps():
        cfg = _resolved(runner, step)
        params = flops = ""
        if step.estimate:
            c = step_config(cfg)
            a = accounting.count(c)
            params = f"{accounting.human(a.total_params)} / {accounting.human(a.active_params)}"
            flops = f"{step.estimate(cfg)['flops']:.3g}"
        shown = json.dumps({k: v for k, v in cfg.items() if k != "progress"})
        lines.append(f"| {step.name} | `{step.dirname()}` | `{shown}` | {params} | {flops} |")
    lines += ["", "## Results", ""]
    shown = [v for v in (rec["verdict"], *rec["post_hoc_verdicts"]) if v is not None]
    if shown:
        for v in shown:
            outcome = "no value" if v["outcome"] is None else f"{v['outcome']:.6g}"
            said = headline(rec) if v is rec["verdict"] else v["verdict"]
            lines += [
                f"**{said}**: {v['metric']} = {outcome} against the predicted {v['predicted']:g} ({v['why']}).",
                "",
            ]
        attempts = attempt_rows(rec)
        if len(attempts) > 1:
            lines += ["Attempts at the registered prediction (the first one's verdict counts):", ""]
            lines += [f"- attempt {a['number']}, {a['when']} ({a['why']}): {a['verdict'] or 'no verdict'}"
                      for a in attempts]  # fmt: skip
            lines += [""]
        failures = [e for e in events if e["event"] == "step_failed"]
        if failures:
            lines += [
                "",
                f"{len(failures)} failed attempt(s) on record: "
                + ", ".join(f"{e['step']} ({e['error']})" for e in failures),
            ]
    else:
        lines += ["Not run yet: `moelab run` records the outcome and the verdict in the journal."]
    return "\n".join(lines) + "\n"


def training_horizons(exp, prefix: Path | None = None) -> dict[str, int]:
    """Each training step of ``exp`` and the steps its run is planned for (as re-planned, where
    its run under ``prefix`` says so)."""
    out = {}
    for step in exp.all_steps():
        if step.fn is run_train:
            out[step.name] = step_config(resolve(step.config, lambda s: "")).train.steps
            run = Path(prefix or ".") / step.dirname()
            if prefix is not None and (run / "config.json").is_file():
                try:
                    out[step.name] = max(out[step.name], load_run_config(run).train.steps)
                except RunRefused:
                    pass
    return out
