"""Routers (fp32): softmax or sigmoid top-k, balancing biases, aux and z losses, router metrics.

The bias is state, not a parameter: it only shifts which experts are *selected*; gate weights
come from the unbiased scores. A new bias is computed from each batch and used on the next step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig


class Routing(NamedTuple):
    logits: jax.Array  # [t, e] fp32, unbiased
    scores: jax.Array  # [t, e] softmax probabilities or sigmoid scores
    order: jax.Array  # [t, k + spill_choices] experts by bias-adjusted preference, best first
    idx: jax.Array  # [t, k] chosen experts = order[:, :k]
    gate_scale: jax.Array  # [t] gate of expert e for token t = scores[t, e] * gate_scale[t]
    gates: jax.Array  # [t, k]


def route(logits: jax.Array, bias: jax.Array, m: ModelConfig) -> Routing:
    """Pick top-k experts on bias-adjusted logits; gates from unbiased scores, renormalised."""
    logits = logits.astype(jnp.float32)
    if m.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        target_sum = 1.0
    else:
        scores = jax.nn.sigmoid(logits)
        target_sum = m.routed_scale
    adjusted = logits + jax.lax.stop_gradient(bias)[None, :]
    # the top k and the next ``spill_choices`` (spill walks those), not a full sort of the experts
    n_experts = logits.shape[-1]
    n = n_experts if m.spill_choices == 0 else min(n_experts, m.top_k + m.spill_choices)
    _, order = jax.lax.top_k(adjusted, n)
    idx = order[:, : m.top_k]
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    gate_scale = target_sum / (jnp.sum(chosen, axis=-1) + 1e-20)
    return Routing(logits, scores, order, idx, gate_scale, chosen * gate_scale[:, None])


def switch_aux_loss(scores: jax.Array, idx: jax.Array, n_experts: int) -> jax.Array:
    """Switch load-balancing loss for top-k: E * sum_e f_e * P_e, 1.0 when perfectly balanced.

    f_e: fraction of the t*k assignments sent to e; P_e: mean router probability of e (sigmoid
    scores are normalised per token first).
    """
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    counts = jnp.zeros((n_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    f = counts / idx.size
    p = jnp.mean(probs, axis=0)
    return n_experts * jnp.sum(f * p)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def router_entropy(scores: jax.Array) -> jax.Array:
    """Mean entropy of each token's router distribution over log(E): 1.0 = uniform."""
    if scores.shape[-1] == 1:
        return jnp.ones((), jnp.float32)  # one expert: nothing to choose, call it uniform
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    ent = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(probs), 0.0), axis=-1)
    return jnp.mean(ent) / jnp.log(scores.shape[-1])


def expert_load(idx: jax.Array, n_experts: int) -> jax.Array:
    """Assignments the router asks of each expert (before capacity). [e]."""
    return jnp.zeros((n_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)


def quantile_bias(logits: jax.Array, bias: jax.Array, top_k: int) -> jax.Array:
    """Marin's quantile balancing: a new bias under which about t*k/E tokens pick each expert.

    Token t picks expert e iff logit[t,e] + b_e beats the k-th best bias-adjusted logit among
    t's other experts; the margin m[t,e] = logit[t,e] - that threshold. Setting b_e to minus the
    (1 - k/E) quantile of m[:, e] lets exactly a k/E fraction of tokens clear it. The result
    replaces the old bias, mean-centred (a shared shift changes no choice).
    """
    logits = logits.astype(jnp.float32)
    n_experts = logits.shape[-1]
    if top_k >= n_experts:
        return jnp.zeros_like(bias)
    adjusted = logits + bias[None, :]
    top, top_idx = jax.lax.top_k(adjusted, top_k + 1)
    chosen = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], top_idx[:, :top_k]].set(True)
    threshold = jnp.where(chosen, top[:, top_k : top_k + 1], top[:, top_k - 1 : top_k])
    margins = logits - threshold
    new = -jnp.quantile(margins, 1.0 - top_k / n_experts, axis=0)
    return new - jnp.mean(new)


def sign_bias(idx: jax.Array, bias: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's update: raise the bias of under-loaded experts by rate, lower over-loaded ones."""
    load = expert_load(idx, bias.shape[0])
    return bias + rate * jnp.sign(jnp.mean(load) - load)


def next_bias(r: Routing, bias: jax.Array, m: ModelConfig) -> jax.Array:
    if m.bias_update == "quantile":
        return quantile_bias(r.logits, bias, m.top_k)
    if m.bias_update == "sign":
        return sign_bias(r.idx, bias, m.bias_rate)
    return bias
