"""Routers (fp32): softmax or sigmoid top-k, balancing biases, aux and z losses, router metrics.

The bias is state, not a parameter: it only shifts which experts are *selected*; gate weights
come from the unbiased scores. A new bias is computed from each batch and used on the next step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.parallel import mesh as pmesh


class Routing(NamedTuple):
    logits: jax.Array  # [t, e] fp32, unbiased
    scores: jax.Array  # [t, e] softmax probabilities or sigmoid scores
    order: jax.Array  # [t, k + spill_choices] experts by bias-adjusted preference, best first
    idx: jax.Array  # [t, k] chosen experts = order[:, :k]
    log_scores: jax.Array  # [t, e] log of scores, computed as such (no underflow at any logit)
    log_norm: jax.Array  # [t] gate of expert e for token t = exp(log_scores[t, e] - log_norm[t])
    gates: jax.Array  # [t, k]


def route(logits: jax.Array, bias: jax.Array, m: ModelConfig, runtime: pmesh.Runtime = pmesh.ONE) -> Routing:
    """Pick top-k experts on bias-adjusted logits; gates from unbiased scores, renormalised.

    The renormalisation is done in log space: a token whose sigmoid scores all underflow (every
    logit below about -88 in fp32) still gets gates that sum to ``routed_scale``, in the ratio of
    its scores, never zeros or a division by zero."""
    logits = logits.astype(jnp.float32)
    if m.router == "softmax":
        log_scores = jax.nn.log_softmax(logits, axis=-1)
        target_sum = 1.0
    else:
        log_scores = jax.nn.log_sigmoid(logits)
        target_sum = m.routed_scale
    scores = jnp.exp(log_scores)
    adjusted = logits + jax.lax.stop_gradient(bias)[None, :]
    # the top k and the next ``spill_choices`` (spill walks those), not a full sort of the experts
    n_experts = logits.shape[-1]
    n = n_experts if m.spill_choices == 0 else min(n_experts, m.top_k + m.spill_choices)
    _, order = pmesh.per_device(runtime, lambda a: jax.lax.top_k(a, n), adjusted)
    idx = order[:, : m.top_k]
    chosen = jnp.take_along_axis(log_scores, idx, axis=-1)
    log_norm = jax.nn.logsumexp(chosen, axis=-1) - jnp.log(jnp.float32(target_sum))
    return Routing(logits, scores, order, idx, log_scores, log_norm, jnp.exp(chosen - log_norm[:, None]))


def switch_aux_loss(log_scores: jax.Array, idx: jax.Array, n_experts: int) -> jax.Array:
    """Switch load-balancing loss for top-k: E * sum_e f_e * P_e, 1.0 when perfectly balanced.

    f_e: fraction of the t*k assignments sent to e; P_e: mean router probability of e (sigmoid
    scores are normalised per token first, from their logs: a row whose scores all underflow is
    still a distribution).
    """
    probs = jax.nn.softmax(log_scores, axis=-1)
    counts = jnp.zeros((n_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    f = counts / idx.size
    p = jnp.mean(probs, axis=0)
    return n_experts * jnp.sum(f * p)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def router_entropy(log_scores: jax.Array) -> jax.Array:
    """Mean entropy of each token's router distribution over log(E): 1.0 = uniform."""
    if log_scores.shape[-1] == 1:
        return jnp.ones((), jnp.float32)  # one expert: nothing to choose, call it uniform
    logp = jax.nn.log_softmax(log_scores, axis=-1)
    probs = jnp.exp(logp)
    ent = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    return jnp.mean(ent) / jnp.log(log_scores.shape[-1])


def expert_load(idx: jax.Array, n_experts: int) -> jax.Array:
    """Assignments the router asks of each expert (before capacity). [e]."""
    return jnp.zeros((n_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)


def quantile_bias(logits: jax.Array, bias: jax.Array, top_k: int, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    """Marin's quantile balancing: a new bias under which about t*k/E tokens pick each expert.

    Token t picks expert e iff logit[t,e] + b_e beats the k-th best bias-adjusted logit among
    t's other experts; the margin m[t,e] = logit[t,e] - that threshold. Setting b_e to minus the
    (1 - k/E) quantile of m[:, e] lets exactly a k/E fraction of tokens clear it. The result
    replaces the old bias, mean-centred (a shared shift changes no choice).
    """
    if top_k >= logits.shape[-1]:
        return jnp.zeros_like(bias)
    return bias_from_margins(quantile_margins(logits, bias, top_k, runtime), top_k, runtime)


def quantile_margins(logits: jax.Array, bias: jax.Array, top_k: int, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    """Each token's margin over the threshold of every expert [t, e] (see ``quantile_bias``)."""
    logits = logits.astype(jnp.float32)
    n_experts = logits.shape[-1]
    if top_k >= n_experts:
        return jnp.zeros_like(logits)
    adjusted = logits + bias[None, :]
    top, top_idx = pmesh.per_device(runtime, lambda a: jax.lax.top_k(a, top_k + 1), adjusted)
    chosen = jnp.any(top_idx[:, :top_k, None] == jnp.arange(n_experts)[None, None, :], axis=1)  # no scatter
    threshold = jnp.where(chosen, top[:, top_k : top_k + 1], top[:, top_k - 1 : top_k])
    return logits - threshold


def bias_from_margins(margins: jax.Array, top_k: int, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    """The quantile bias from margins [t, e]: the tokens' order does not matter, so the margins of
    several micro-batches concatenated give the whole batch's bias."""
    n_experts = margins.shape[-1]
    if top_k >= n_experts:
        return jnp.zeros((n_experts,), jnp.float32)
    q = 1.0 - top_k / n_experts
    # on a mesh the tokens are split across devices: count instead of sorting them all in one place
    new = -(column_quantile(margins, q) if runtime.shards > 1 else jnp.quantile(margins, q, axis=0))
    return new - jnp.mean(new)


def _key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (negative floats' bits flipped, positives' sign bit set)."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _unkey(k: jax.Array) -> jax.Array:
    u = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def column_quantile(x: jax.Array, q: float) -> jax.Array:
    """Each column's ``q`` quantile of x [n, e], as ``jnp.quantile(x, q, axis=0)`` (linear
    interpolation between order statistics), from counts alone: the order statistic at rank
    floor(q * (n - 1)) is found exactly by bisection over the floats' 2^32 ordered bit patterns
    (32 rounds, each counting, per column, the values at or below a candidate), the next one as
    the smallest value above it. Nothing is sorted or gathered: with the rows split over devices
    each round sums [e] counts across them."""
    n = x.shape[0]
    pos = q * (n - 1)
    r_lo = int(pos // 1)
    r_hi = min(r_lo + 1, n - 1)
    keys = _key(x)

    def round_(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(keys <= mid[None, :], axis=0) >= r_lo + 1
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, round_, (jnp.min(keys, axis=0), jnp.max(keys, axis=0)))
    at_or_below = jnp.sum(keys <= lo[None, :], axis=0)
    above = jnp.min(jnp.where(keys > lo[None, :], keys, jnp.uint32(0xFFFFFFFF)), axis=0)
    k_hi = jnp.where(at_or_below >= r_hi + 1, lo, above)
    v_lo, v_hi = _unkey(lo), _unkey(k_hi)
    frac = pos - r_lo
    return v_lo + frac * (v_hi - v_lo)


def sign_bias(idx: jax.Array, bias: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's update: raise the bias of under-loaded experts by rate, lower over-loaded ones."""
    load = expert_load(idx, bias.shape[0])
    return bias + rate * jnp.sign(jnp.mean(load) - load)


def bias_stat(r: Routing, bias: jax.Array, m: ModelConfig, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    """What the bias update reads of a batch, in a form micro-batches combine: the quantile update's
    margins [t, e] (concatenated), the sign update's loads [e] (summed); nothing for none."""
    if m.bias_update == "quantile":
        return quantile_margins(r.logits, bias, m.top_k, runtime)
    if m.bias_update == "sign":
        return expert_load(r.idx, bias.shape[0])
    return jnp.zeros((0,), jnp.float32)


def bias_from_stat(stat: jax.Array, bias: jax.Array, m: ModelConfig, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    """The new bias from a whole batch's combined ``bias_stat``."""
    if m.bias_update == "quantile":
        return bias_from_margins(stat, m.top_k, runtime)
    if m.bias_update == "sign":
        return bias + m.bias_rate * jnp.sign(jnp.mean(stat) - stat)
    return bias


def aux_terms(log_scores: jax.Array, idx: jax.Array, n_experts: int) -> jax.Array:
    """The Switch aux loss's two batch means [2, e]: the share of assignments f and the mean
    probability P (``switch_aux_loss`` = E * sum f * P); both average over equal micro-batches."""
    probs = jax.nn.softmax(log_scores, axis=-1)
    return jnp.stack([expert_load(idx, n_experts) / idx.size, jnp.mean(probs, axis=0)])


def next_bias(r: Routing, bias: jax.Array, m: ModelConfig, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    if m.bias_update == "quantile":
        return quantile_bias(r.logits, bias, m.top_k, runtime)
    if m.bias_update == "sign":
        return sign_bias(r.idx, bias, m.bias_rate)
    return bias
