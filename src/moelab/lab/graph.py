"""Experiments as code: a declaration, a pre-registered prediction, and a graph of steps.

A step's identity is a hash of its name, the fields of its config marked ``versioned(...)``
and its dependencies' identities; its output lives at ``<prefix>/<name>-<hash>``. Changing an
unversioned field (a log interval, say) reuses the output; changing a versioned one, or anything
upstream, makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Versioned:
    value: Any


def versioned(value: Any) -> Versioned:
    """Mark a config field as part of the step's identity."""
    return Versioned(value)


@dataclass(frozen=True)
class OutputRef:
    step: Step
    sub: str = ""  # a path inside the step's output

    def __truediv__(self, sub: str) -> OutputRef:
        return OutputRef(self.step, f"{self.sub}/{sub}".strip("/"))


def output_of(step: Step, sub: str = "") -> OutputRef:
    """The output directory of ``step`` (or a path inside it), resolved when the consumer runs."""
    return OutputRef(step, sub)


@dataclass(frozen=True, eq=False)
class Step:
    name: str
    fn: Callable[[dict, Any], dict | None]  # fn(config, output_dir) -> outcome numbers, or None
    config: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)  # e.g. {"num_cpus": 2}, for the Ray backend
    estimate: Callable[[dict], dict] | None = None  # config -> {"flops": ..., "tokens": ...} for --dry-run
    # its output is a prediction (a forecast registered before what it forecasts runs), not an outcome:
    # what it was made from does not make an outcome read through it known (``knowable``)
    forecast: bool = False

    def deps(self) -> list[Step]:
        found: list[Step] = []

        def walk(v):
            if isinstance(v, OutputRef):
                if v.step not in found:
                    found.append(v.step)
            elif isinstance(v, Versioned):
                walk(v.value)
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)

        walk(self.config)
        return found

    def identity(self) -> str:
        """sha256 of the name, the versioned fields and the dependencies' identities (12 hex)."""
        blob = {
            "name": self.name,
            "versioned": _versioned_part(self.config),
            "deps": sorted(d.identity() for d in self.deps()),
        }
        return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def dirname(self) -> str:
        return f"{self.name}-{self.identity()}"


def _versioned_part(v: Any, inside: bool = False):
    """The versioned fields of a config, with output references replaced by their step's identity."""
    if isinstance(v, Versioned):
        return _versioned_part(v.value, True)
    if isinstance(v, OutputRef):
        return {"output_of": v.step.identity(), "sub": v.sub}
    if isinstance(v, dict):
        out = {k: _versioned_part(x, inside) for k, x in sorted(v.items())}
        return {k: x for k, x in out.items() if x is not _SKIP}
    if isinstance(v, (list, tuple)):
        return [_versioned_part(x, inside) for x in v]
    return v if inside else _SKIP


_SKIP = object()


def resolve(config: Any, output_path: Callable[[Step], str]) -> Any:
    """The config a step's function sees: markers removed, output references as paths."""
    if isinstance(config, Versioned):
        return resolve(config.value, output_path)
    if isinstance(config, OutputRef):
        base = output_path(config.step)
        return f"{base}/{config.sub}" if config.sub else base
    if isinstance(config, dict):
        return {k: resolve(v, output_path) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(resolve(v, output_path) for v in config)
    return config


def closure(step: Step) -> list[Step]:
    """``step`` and everything upstream of it, each once."""
    out: list[Step] = []

    def walk(s: Step) -> None:
        if all(x is not s for x in out):
            out.append(s)
            for d in s.deps():
                walk(d)

    walk(step)
    return out


def knowable(step: Step) -> list[Step]:
    """The steps whose results make ``step``'s outcome known once they have started: ``step`` and what
    it reads, transitively, but not through a forecast step. A target's forecast reads the rungs;
    the target's outcome is not known by the rungs having run, so a new target forecast from finished
    rungs is still a prediction. The target, or the step that judges it, having started is knowing."""
    out: list[Step] = []

    def walk(s: Step) -> None:
        if s.forecast or any(x is s for x in out):
            return
        out.append(s)
        for d in s.deps():
            walk(d)

    walk(step)
    return out


def topological(steps: list[Step]) -> list[Step]:
    """All steps and their dependencies, each after what it needs."""
    order: list[Step] = []
    state: dict[int, str] = {}

    def visit(s: Step) -> None:
        if state.get(id(s)) == "done":
            return
        if state.get(id(s)) == "visiting":
            raise ValueError(f"step {s.name}: its dependencies form a cycle")
        state[id(s)] = "visiting"
        for d in s.deps():
            visit(d)
        state[id(s)] = "done"
        order.append(s)

    for s in steps:
        visit(s)
    return order


@dataclass(frozen=True)
class Prediction:
    """A pre-registered prediction: ``metric`` (``step:path.in.its.outcome``) will be ``value``,
    within [low, high]. Outside [falsify_low, falsify_high] falsifies it; between the two intervals,
    or with no number to compare, the verdict is INCONCLUSIVE."""

    metric: str
    value: float
    low: float
    high: float
    rule: str = ""
    falsify_low: float | None = None
    falsify_high: float | None = None

    def bounds(self) -> tuple[float, float]:
        lo = self.low if self.falsify_low is None else self.falsify_low
        hi = self.high if self.falsify_high is None else self.falsify_high
        return lo, hi

    def describe(self) -> str:
        lo, hi = self.bounds()
        text = f"{self.metric} = {self.value:g} (interval [{self.low:g}, {self.high:g}])"
        falsify = f"falsified if outside [{lo:g}, {hi:g}]"
        return f"{text}; {self.rule or falsify}"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:12]


def verdict(pred: Prediction, outcome: float | None) -> dict:
    """CONFIRMED inside the interval, FALSIFIED outside the falsification bounds, else INCONCLUSIVE."""
    lo, hi = pred.bounds()
    if outcome is None or not math.isfinite(outcome):
        result, why = "INCONCLUSIVE", "no finite outcome to compare"
    elif pred.low <= outcome <= pred.high:
        result, why = "CONFIRMED", f"{outcome:.6g} is inside [{pred.low:g}, {pred.high:g}]"
    elif outcome < lo or outcome > hi:
        result, why = "FALSIFIED", f"{outcome:.6g} is outside [{lo:g}, {hi:g}]"
    else:
        result, why = (
            "INCONCLUSIVE",
            f"{outcome:.6g} is outside [{pred.low:g}, {pred.high:g}] but inside [{lo:g}, {hi:g}]",
        )
    return {"verdict": result, "metric": pred.metric, "predicted": pred.value, "outcome": outcome, "why": why}


@dataclass(frozen=True, eq=False)
class Experiment:
    issue: int
    slug: str
    title: str
    goal: str
    hypothesis: str
    prediction: Prediction
    steps: list[Step]
    description: str = ""

    @property
    def name(self) -> str:
        return f"exp{self.issue}_{self.slug}"

    def declaration(self) -> dict:
        return {
            "issue": self.issue,
            "title": self.title,
            "goal": self.goal,
            "hypothesis": self.hypothesis,
            "description": self.description,
            "graph": self.graph(),
        }

    def all_steps(self) -> list[Step]:
        return topological(self.steps)

    def metric_step(self) -> Step | None:
        """The step whose outcome the prediction reads (None when the metric names none)."""
        name = self.prediction.metric.partition(":")[0]
        return next((s for s in self.all_steps() if s.name == name), None)

    def graph(self) -> dict[str, str]:
        """The step graph the outcome comes from: each step of the metric's closure and its identity.
        Part of the declaration's identity: another graph is another attempt at the same prediction."""
        step = self.metric_step()
        return {s.name: s.identity() for s in closure(step)} if step is not None else {}

    def outcome(self, results: dict[str, dict]) -> float | None:
        """The predicted metric's value from the steps' outcomes: ``step:key.key``."""
        step, _, path = self.prediction.metric.partition(":")
        value: Any = results.get(step)
        for key in filter(None, path.split(".")):
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return float(value) if isinstance(value, (int, float)) else None
