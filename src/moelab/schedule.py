"""A run's plan over its steps, as the config gives it: re-planned horizons (``train.replans``), the
mixture's phase boundaries, and the steps it is evaluated at. Plain functions of the config's
numbers, used by the config's own checks, the optimiser, the mixture, the loop and the forecasts.
"""

from __future__ import annotations

import re

SPEC = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*->\s*(\d+)\s*$")


def parse_replans(specs, steps: int) -> list[tuple[int, int, int]]:
    """``AT:OLD->NEW`` strings as (at, old, new), checked to chain into ``train.steps``."""
    out = []
    for spec in specs:
        m = SPEC.match(str(spec))
        if not m:
            raise ValueError(f"{spec!r} is not AT:OLD->NEW (for example 150:300->450)")
        at, old, new = (int(x) for x in m.groups())
        if out and old != out[-1][2]:
            raise ValueError(f"{spec!r}: starts from {old} steps but the previous re-plan ended at {out[-1][2]}")
        if out and at < out[-1][0]:
            raise ValueError(f"{spec!r}: step {at} comes before the previous re-plan's step {out[-1][0]}")
        if not 0 <= at < new or at > old:
            raise ValueError(f"{spec!r}: the step must lie within both horizons, before the new end")
        out.append((at, old, new))
    if out and out[-1][2] != steps:
        raise ValueError(f"the last re-plan ends at {out[-1][2]} steps but train.steps is {steps}")
    return out


def phase_boundaries(phase_starts, cfg_train) -> tuple[int, ...]:
    """First step of each mixture phase. A boundary already passed when the horizon changed stays
    where it was; one still ahead moves to its fraction of the new horizon (never into the past)."""
    changes = parse_replans(cfg_train.replans, cfg_train.steps)
    steps = changes[0][1] if changes else cfg_train.steps
    bounds = [int(round(f * steps)) for f in phase_starts]
    for at, _, new in changes:
        bounds = [b if b < at else max(at, int(round(f * new))) for b, f in zip(bounds, phase_starts, strict=True)]
    return tuple(bounds)


def eval_points(cfg, steps: int) -> set[int]:
    """The steps a run is evaluated at: 0, every ``train.eval_every`` (or every 5% of the run), the end."""
    every = cfg.train.eval_every
    if every:
        points = set(range(0, steps + 1, every))
    else:
        points = {int(round(k * steps / 20)) for k in range(21)}
    return points | {0, steps}
