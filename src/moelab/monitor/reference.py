"""The learning-rate schedule as its definition reads, written apart from the code that trains.

The lr_schedule health check holds the rate the optimiser applied (read from its state) against
these numbers, not against `moelab.schedule.lr_factor`, which sets the rate: a bug in that
function would otherwise agree with itself. Plain Python, one step at a time, from the definition
in the README:

- warm-up: ``W = round(warmup_frac * S)`` steps (S: the first plan's horizon), step s at
  ``peak * (s + 1) / W``;
- ``linear``: from the peak at step W - 1 down to ``min_lr_ratio * peak`` at the last step;
  ``wsd``: the peak until ``round(S * (1 - decay_frac))``, then linearly down to the same floor at
  the last step; ``constant``: the peak;
- a re-plan at step A to a horizon T keeps every rate before A; from A on, a run that was still
  warming up or at its peak follows the same shape over T; one already decaying goes linearly from
  its rate at A to the floor at step T - 1.
"""

from __future__ import annotations

import numpy as np

from moelab.schedule import parse_replans


def _shape(s: int, kind: str, warmup: int, horizon: int, floor: float, decay_frac: float) -> float:
    if s < warmup:
        return (s + 1) / warmup
    if kind == "constant":
        return 1.0
    last = horizon - 1
    if kind == "wsd":
        begin = max(round(horizon * (1 - decay_frac)) - 1, warmup - 1, 0)
    else:  # linear
        begin = max(warmup - 1, 0)
    if s <= begin:
        return 1.0
    if s >= last:
        return floor
    return 1.0 - (s - begin) / max(last - begin, 1) * (1.0 - floor)


def reference_factors(train, steps: int | None = None) -> np.ndarray:
    """The multiplier of the peak rate at steps 0 .. steps - 1 (default: ``train.steps``) for a
    config's ``train`` section, by the definition above."""
    changes = parse_replans(train.replans, train.steps)
    first = changes[0][1] if changes else train.steps
    warmup = round(train.warmup_frac * first)
    kind, floor, frac = train.schedule, train.min_lr_ratio, train.decay_frac
    n = train.steps if steps is None else steps
    out = np.array([_shape(s, kind, warmup, first, floor, frac) for s in range(n)], np.float64)
    for at, _, total in changes:
        anchor = out[at] if at < n else _shape(at, kind, warmup, first, floor, frac)
        same = abs(anchor - _shape(at, kind, warmup, total, floor, frac)) < 1e-6
        for s in range(at, n):
            if same:
                out[s] = _shape(s, kind, warmup, total, floor, frac)
            else:
                out[s] = anchor + min(max((s - at) / max(total - 1 - at, 1), 0.0), 1.0) * (floor - anchor)
    return out
