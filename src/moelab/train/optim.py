"""Optimisers (AdamW; Muon for matrices with Adam for the rest), schedules, and Marin's `lr: auto`.

Learning rate at step s is the rate applied by update s (0-indexed): linear warmup reaches the
peak at the last warmup step, and the linear schedule ends at ``min_lr_ratio * peak`` on the
run's last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from moelab.config import Config
from moelab.schedule import parse_replans

# no weight decay on these by default (norms have no bias terms to add)
NO_DECAY = ("embed", "attn_norm", "mlp_norm", "latent_norm", "final_norm")
# Muon orthogonalises these matrices: (reduction axis, output axis) of the stacked arrays
MUON_AXES = {
    "wq": (1, 2), "wk": (1, 2), "wv": (1, 2), "wo": (1, 2),
    "w_gate": (2, 3), "w_up": (2, 3), "w_down": (2, 3),
    "latent_down": (1, 2), "latent_up": (1, 2),
    "shared_gate": (1, 2), "shared_up": (1, 2), "shared_down": (1, 2),
}  # fmt: skip


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
    replans: tuple[tuple[int, int], ...] = ()  # (at step, new total steps), in order: see moelab.ladder.replan

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


def hyper(cfg: Config) -> Hyper:
    """The optimiser's numbers. ``lr: auto`` and the schedule's shape come from the run's first
    plan (before any re-plan): a re-planned run keeps its peak rate and changes only its decay."""
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


def _labels(params: dict, fn) -> dict:
    return {
        "embed": fn("embed", params["embed"]),
        "head": fn("head", params["head"]),
        "final_norm": fn("final_norm", params["final_norm"]),
        "layers": {k: fn(k, v) for k, v in params["layers"].items()},
    }


def decay_mask(params: dict) -> dict:
    return _labels(params, lambda name, _: name not in NO_DECAY)


MUON_STATIC = (
    "weight_decay_mask",
    "muon_weight_dimension_numbers",
    "ns_coeffs",
    "ns_steps",
    "nesterov",
    "adaptive",
    "preconditioning",
    "consistent_rms",
    "mu_dtype",
)


def make_optimizer(cfg: Config, h: Hyper) -> optax.GradientTransformation:
    """Learning rates are injected hyperparameters, set from the data step by ``set_lr``.

    The rate then follows the step even when the NaN guard skips an update (and the
    optimiser's own count stands still).
    """
    t = cfg.train
    if t.optimizer == "muon":
        # two optimisers over a partition of the parameters: Muon for the matrices it orthogonalises,
        # AdamW with the decay mask for the rest (optax's muon would decay its Adam branch unmasked:
        # norms and embeddings too)

        def dims(params):
            def one(name, _):
                axes = MUON_AXES.get(name)
                return None if axes is None else optax.contrib.MuonDimensionNumbers(*axes)

            return _labels(params, one)

        def labels(params):
            return _labels(params, lambda name, _: "muon" if name in MUON_AXES else "adam")

        muon = optax.inject_hyperparams(optax.contrib.muon, static_args=MUON_STATIC)(
            learning_rate=h.muon_lr,
            beta=h.beta1,
            weight_decay=t.weight_decay,
            weight_decay_mask=decay_mask,
            adam_b1=h.beta1,
            adam_b2=h.beta2,
            adam_weight_decay=0.0,  # it sees no Adam parameter: the partition gives those to AdamW
            muon_weight_dimension_numbers=dims,
        )
        adam = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=h.peak_lr, b1=h.beta1, b2=h.beta2, eps=h.eps, weight_decay=t.weight_decay, mask=decay_mask
        )
        opt = optax.partition({"muon": muon, "adam": adam}, labels)
    else:
        opt = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=h.peak_lr, b1=h.beta1, b2=h.beta2, eps=h.eps, weight_decay=t.weight_decay, mask=decay_mask
        )
    clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    return optax.chain(clip, opt)  # state: (clip state, injected-hyperparameter state)


def set_lr(opt_state, step, h: Hyper, scale=1.0):
    """The optimiser state with its rates set for data step ``step`` (times ``scale``, which fault
    injection raises); returns (state, adam rate)."""
    factor = lr_factor(step, h) * scale
    clip_state, inner = opt_state

    def with_rate(state, rate):
        hp = dict(state.hyperparams)
        hp["learning_rate"] = jnp.asarray(rate * factor, hp["learning_rate"].dtype)
        return state._replace(hyperparams=hp)

    if hasattr(inner, "inner_states"):  # Muon: its own rate for matrices, Adam's for the rest
        states = dict(inner.inner_states)
        states["muon"] = states["muon"]._replace(inner_state=with_rate(states["muon"].inner_state, h.muon_lr))
        states["adam"] = states["adam"]._replace(inner_state=with_rate(states["adam"].inner_state, h.peak_lr))
        inner = inner._replace(inner_states=states)
    else:
        inner = with_rate(inner, h.peak_lr)
    return (clip_state, inner), h.peak_lr * factor


def applied_rate(opt_state) -> jax.Array:
    """The rate the optimiser applies to the parameters outside Muon (Adam's), read from its state."""
    inner = opt_state[1]
    if hasattr(inner, "inner_states"):
        inner = inner.inner_states["adam"].inner_state
    return inner.hyperparams["learning_rate"]


GROUPS = {
    "embedding": ("embed",),
    "head": ("head",),
    "attention": ("wq", "wk", "wv", "wo"),
    "router": ("router",),
    "routed_experts": ("w_gate", "w_up", "w_down", "latent_down", "latent_up"),
    "shared_experts": ("shared_gate", "shared_up", "shared_down"),
    "norms": ("attn_norm", "mlp_norm", "latent_norm", "final_norm"),
}


def group_norms(tree: dict) -> dict:
    """L2 norm of each parameter group (embedding, head, attention, router, experts, norms)."""
    flat = {"embed": tree["embed"], "head": tree["head"], "final_norm": tree["final_norm"], **tree["layers"]}
    out = {}
    for group, names in GROUPS.items():
        leaves = [flat[n] for n in names if n in flat]
        if leaves:
            out[group] = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
    return out
