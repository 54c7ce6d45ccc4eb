"""The jitted train step (donated state) and the evaluation step.

A step whose loss or gradients are not finite changes nothing: parameters, optimiser state and
router biases stay as they were, and ``finite`` is False in its metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moelab.config import Config
from moelab.model import init_params, init_state, loss_fn
from moelab.model.transformer import ce_terms, forward
from moelab.train import optim


def init_train_state(cfg: Config, opt: optax.GradientTransformation) -> dict:
    params = init_params(cfg.model, jax.random.PRNGKey(cfg.train.seed))
    return {"params": params, "opt_state": opt.init(params), "model_state": init_state(cfg.model)}


def _layer_summary(layers: dict) -> dict:
    """Per-layer lists and their means for the metrics line."""
    out = {}
    for key in ("dropped_frac", "spilled_frac", "max_mean_load", "router_entropy", "router_z", "bias_mean", "bias_std"):
        out[key] = jnp.mean(layers[key])
        out[f"{key}_per_layer"] = layers[key]
    out["expert_load"] = layers["expert_load"]
    return out


def make_train_step(cfg: Config, opt: optax.GradientTransformation, h: optim.Hyper, shardings=None):
    """``shardings``: the state's NamedShardings on a mesh (``parallel.mesh.tree_shardings``): the
    gradients are held to the parameters' (so XLA reduce-scatters them over ``data`` under FSDP
    rather than all-reducing whole copies) and the new state to the old state's."""
    m = cfg.model
    hold = (lambda tree, s: jax.lax.with_sharding_constraint(tree, s)) if shardings is not None else (lambda t, s: t)  # noqa: E731

    def step(state: dict, batch: jax.Array, data_step: jax.Array, poison: jax.Array, faults=None):
        """faults (fault injection): lr_scale, logit_z_scale, freeze_bias; None = none."""
        f = faults or {"lr_scale": 1.0, "logit_z_scale": 1.0, "freeze_bias": False}
        opt_state, _ = optim.set_lr(state["opt_state"], data_step, h, f["lr_scale"])
        lr = optim.applied_rate(opt_state)  # what the optimiser will apply, read from its state
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (metrics, new_model_state)), grads = grad_fn(
            state["params"], state["model_state"], batch[:, :-1], batch[:, 1:], m, logit_z_scale=f["logit_z_scale"]
        )
        new_model_state = jax.tree.map(
            lambda new, old: jnp.where(f["freeze_bias"], old, new), new_model_state, state["model_state"]
        )
        grads = hold(grads, shardings and shardings["params"])
        loss = jnp.where(poison, jnp.nan, loss)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(_):
            updates, new_opt_state = opt.update(grads, opt_state, state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt_state": new_opt_state,
                    "model_state": new_model_state}  # fmt: skip

        # a branch, not a select over every leaf: the select was a pass over the whole state (3% of
        # a CPU step at shape A)
        new_state = jax.lax.cond(finite, update, lambda _: state, None)
        new_state = hold(new_state, shardings)
        out = {
            "loss": loss,
            "ce": metrics["ce"],
            "logit_z": metrics["logit_z"],
            "aux_loss": metrics["aux_loss"],
            "router_z_loss": metrics["router_z"],
            "lr": lr,
            "grad_norm": grad_norm,
            "grad_norm_groups": optim.group_norms(grads),
            "param_norm_groups": optim.group_norms(new_state["params"]),
            "finite": finite,
            **_layer_summary(metrics["layers"]),
        }
        return new_state, out

    return jax.jit(step, donate_argnums=0)


def make_eval_step(cfg: Config):
    """(params, model_state, inputs, targets, mask) -> summed nats and token count, per dispatch."""
    m = cfg.model

    def nll(params, model_state, inputs, targets, mask, dispatch):
        hidden, _, _ = forward(params, model_state, inputs, m, dispatch)
        lse, tgt = ce_terms(params, hidden, targets, m.ce_chunk)
        return jnp.sum((lse - tgt) * mask), jnp.sum(mask)

    return jax.jit(nll, static_argnames="dispatch")
