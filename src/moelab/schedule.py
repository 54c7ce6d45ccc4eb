"""A run's plan over its steps, as the config gives it: re-planned horizons (``train.replans``), the
mixture's phase boundaries, the steps it is evaluated at, and the learning rate's plan (``hyper``,
``lr_factor``). Plain functions of the config's numbers, used by the config's own checks, the
optimiser, the mixture, the loop, the health checks and the forecasts.

Learning rate at step s is the rate applied by update s (0-indexed): linear warmup reaches the
peak at the last warmup step, and the linear schedule ends at ``min_lr_ratio * peak`` on the
run's last step. ``lr_factor`` works on plain numbers and on traced arrays (jax is imported when it
is first called, so that reading a config stays light).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Hyper:
    """The numbers an optimiser is built from, after `lr: auto` is resolved."""

    peak_lr: float
    muon_lr: float
    beta1: float
    beta2: float
    eps: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float
    schedule: str
    decay_frac: float  # WSD: the last fraction of the run decays
    replans: tuple[tuple[int, int], ...] = ()  # (at step, new total steps), in order: see moelab.train.replan

    @property
    def total_steps(self) -> int:
        """The run's horizon now: the last re-plan's total, or the planned steps."""
        return self.replans[-1][1] if self.replans else self.steps


def marin_lr(total_tokens: float, d_model: int, tokens_per_batch: float) -> dict:
    """Marin's compute-scaled heuristic (shared/reference/marin_hero.json)."""
    adam = min(0.05, 0.087571 * total_tokens**-0.3461 * d_model**-0.3448 * math.sqrt(tokens_per_batch))
    beta2 = min(max(0.999 ** (tokens_per_batch / 131072), 0.95), 0.9999)
    eps = 9.676e-18 * math.sqrt(total_tokens / tokens_per_batch)
    return {"adam_lr": adam, "muon_lr": 13 / 3 * adam, "beta2": beta2, "eps": eps}


def hyper(cfg) -> Hyper:
    """The optimiser's numbers for a Config. ``lr: auto`` and the schedule's shape come from the run's
    first plan (before any re-plan): a re-planned run keeps its peak rate and changes only its decay."""
    t = cfg.train
    changes = parse_replans(t.replans, t.steps)
    steps = changes[0][1] if changes else t.steps
    tokens_per_batch = t.batch_size * cfg.model.seq_len
    if t.lr == "auto":
        auto = marin_lr(steps * tokens_per_batch, cfg.model.d_model, tokens_per_batch)
        peak, beta2, eps = auto["adam_lr"], auto["beta2"], auto["eps"]
        muon = peak * t.muon_lr_ratio  # Marin's 13/3 is the field's default; a recipe may set another
    else:
        peak, muon, beta2, eps = float(t.lr), float(t.lr) * t.muon_lr_ratio, t.beta2, 1e-8
    peak, muon = peak * t.lr_scale, muon * t.lr_scale
    warmup = int(round(t.warmup_frac * steps))
    replans = tuple((at, new) for at, _, new in changes)
    return Hyper(peak, muon, t.beta1, beta2, eps, warmup, steps, t.min_lr_ratio, t.schedule, t.decay_frac, replans)


def _planned_factor(step, h: Hyper, steps: int):
    """The schedule's shape over a horizon of ``steps``."""
    import jax.numpy as jnp

    w = max(h.warmup_steps, 0)
    warm = (step + 1.0) / max(w, 1)
    last = steps - 1
    if h.schedule == "linear":
        start = w - 1 if w > 0 else 0
        frac = jnp.clip((step - start) / max(last - start, 1), 0.0, 1.0)
        after = 1.0 - frac * (1.0 - h.min_lr_ratio)
    elif h.schedule == "wsd":
        decay_start = int(round(steps * (1.0 - h.decay_frac)))
        start = max(decay_start - 1, w - 1, 0)
        frac = jnp.clip((step - start) / max(last - start, 1), 0.0, 1.0)
        after = 1.0 - frac * (1.0 - h.min_lr_ratio)
    else:  # constant
        after = jnp.ones_like(step)
    return jnp.where(step < w, warm, after)


def lr_factor(step, h: Hyper):
    """Multiplier of the peak learning rate at ``step``; works on ints and traced arrays.

    A re-plan at step ``at`` to ``total`` steps keeps every rate before ``at``. From ``at`` on, a
    run still warming up or at its peak follows the same schedule over the new horizon; a run
    already decaying decays linearly from its rate at ``at`` to ``min_lr_ratio`` at the new last
    step, so the rate has no jump.
    """
    import jax
    import jax.numpy as jnp

    step = jnp.asarray(step, jnp.float32)

    def fn(s):
        return _planned_factor(s, h, h.steps)

    for at, total in h.replans:
        with jax.ensure_compile_time_eval():  # plain numbers, also while the train step is traced
            anchor = float(fn(jnp.float32(at)))
            shaped = float(_planned_factor(jnp.float32(at), h, total))
        if abs(anchor - shaped) < 1e-6:

            def new(s, total=total):
                return _planned_factor(s, h, total)
        else:

            def new(s, at=at, total=total, anchor=anchor):
                frac = jnp.clip((s - at) / max(total - 1 - at, 1), 0.0, 1.0)
                return anchor + frac * (h.min_lr_ratio - anchor)

        def fn(s, prev=fn, new=new, at=at):
            return jnp.where(s < at, prev(s), new(s))

    return fn(step)


def checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that waste the least time for a save that costs the run
    ``save_s`` seconds and a failure every ``mtbf_s`` seconds on average: Daly's first-order optimum
    (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
    Generation Computer Systems 22, 2006), sqrt(2 save_s mtbf_s) - save_s, Young's sqrt(2 save_s mtbf_s)
    less the save itself; mtbf_s when the save costs half the time between failures or more."""
    if save_s <= 0:
        return 0.0
    if save_s >= mtbf_s / 2:
        return float(mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) - save_s
