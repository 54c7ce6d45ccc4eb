"""Optimisers (AdamW; Muon for matrices with Adam for the rest), the rate set into their state each
step, and the parameter groups' norms.

The learning rate's plan (``Hyper``, ``hyper``, Marin's `lr: auto` in ``marin_lr``, ``lr_factor``)
is moelab.schedule's, importable from here as it always was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moelab.config import Config
from moelab.schedule import Hyper, hyper, lr_factor, marin_lr  # noqa: F401 - the plan, importable from here

# no weight decay on these by default (norms have no bias terms to add)
NO_DECAY = ("embed", "attn_norm", "mlp_norm", "latent_norm", "final_norm")
# Muon orthogonalises these matrices: (reduction axis, output axis) of the stacked arrays
MUON_AXES = {
    "wq": (1, 2), "wk": (1, 2), "wv": (1, 2), "wo": (1, 2),
    "w_gate": (2, 3), "w_up": (2, 3), "w_down": (2, 3),
    "latent_down": (1, 2), "latent_up": (1, 2),
    "shared_gate": (1, 2), "shared_up": (1, 2), "shared_down": (1, 2),
}  # fmt: skip


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
