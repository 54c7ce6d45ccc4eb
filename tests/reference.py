"""Slow, obviously-correct references the fast paths are held against.

Loops over tokens and their chosen experts one at a time, in plain jnp so jax.grad works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig


def _swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _rms(x, w=None, eps=1e-6):
    y = x / jnp.sqrt(jnp.mean(x * x) + eps)
    return y if w is None else y * w


def reference_choices(p: dict, x, bias, m: ModelConfig) -> np.ndarray:
    """Each token's top-k experts on bias-adjusted logits, from concrete arrays. [t, k]."""
    xt = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = xt @ np.asarray(p["router"], np.float64) + np.asarray(bias, np.float64)
    return np.argsort(-logits, axis=1, kind="stable")[:, : m.top_k]


def moe_reference(p: dict, x: jax.Array, bias: jax.Array, m: ModelConfig, keep=None, choices=None) -> jax.Array:
    """MoE block output for x: [b, s, d], one token and one expert at a time.

    keep: optional {(token, slot): bool}; an assignment marked False contributes nothing.
    choices: the experts each token picks (give them when p or x are traced, under jax.grad).
    """
    b, s, d = x.shape
    xt = x.reshape(b * s, d)
    if choices is None:
        choices = reference_choices(p, x, bias, m)
    outs = []
    for t in range(b * s):
        xv = xt[t]
        logits = xv @ p["router"]
        scores = jax.nn.softmax(logits) if m.router == "softmax" else jax.nn.sigmoid(logits)
        chosen = choices[t]
        total = sum(scores[e] for e in chosen)
        target = 1.0 if m.router == "softmax" else m.routed_scale
        h = _rms(xv @ p["latent_down"], p["latent_norm"], m.norm_eps) if m.latent_dim else xv
        y = jnp.zeros_like(h)
        for j, e in enumerate(chosen):
            if keep is not None and not keep[(t, j)]:
                continue
            y = y + (target * scores[e] / total) * _swiglu(h, p["w_gate"][e], p["w_up"][e], p["w_down"][e])
        if m.latent_dim:
            y = y @ p["latent_up"]
        if m.n_shared:
            y = y + _swiglu(xv, p["shared_gate"], p["shared_up"], p["shared_down"])
        outs.append(y)
    return jnp.stack(outs).reshape(b, s, d)


def rope_reference(x: np.ndarray, fraction: float, theta: float) -> np.ndarray:
    """Rotate pairs (i, i + half) of the first `fraction` of dims by angle pos * theta^(-i/half)."""
    b, s, h, hd = x.shape
    rot = int(hd * fraction)
    half = rot // 2
    out = x.astype(np.float64).copy()
    for pos in range(s):
        for i in range(half):
            a = pos * theta ** (-i / half)
            c, sn = np.cos(a), np.sin(a)
            x1, x2 = x[:, pos, :, i], x[:, pos, :, i + half]
            out[:, pos, :, i] = x1 * c - x2 * sn
            out[:, pos, :, i + half] = x2 * c + x1 * sn
    return out


def attention_reference(p, x, *, n_heads, n_kv, head_dim, window, rope_fraction, rope_theta, eps=1e-6):
    """Per head, per query, softmax over the keys it may see; kv head of query head h is h // (H / KV)."""
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    wq = np.asarray(p["wq"], np.float64)
    wk = np.asarray(p["wk"], np.float64)
    wv = np.asarray(p["wv"], np.float64)
    alloc = wk.shape[1] // head_dim
    if alloc != n_kv:  # average the allocated heads in groups, as the model does
        wk = wk.reshape(-1, n_kv, alloc // n_kv, head_dim).mean(2).reshape(-1, n_kv * head_dim)
        wv = wv.reshape(-1, n_kv, alloc // n_kv, head_dim).mean(2).reshape(-1, n_kv * head_dim)
    q = (x @ wq).reshape(b, s, n_heads, head_dim)
    k = (x @ wk).reshape(b, s, n_kv, head_dim)
    v = (x @ wv).reshape(b, s, n_kv, head_dim)
    q = q / np.sqrt(np.mean(q**2, -1, keepdims=True) + eps)
    k = k / np.sqrt(np.mean(k**2, -1, keepdims=True) + eps)
    q, k = rope_reference(q, rope_fraction, rope_theta), rope_reference(k, rope_fraction, rope_theta)
    out = np.zeros((b, s, n_heads, head_dim))
    group = n_heads // n_kv
    for bi in range(b):
        for h in range(n_heads):
            kh = h // group
            for i in range(s):
                lo = 0 if not window else max(0, i - window + 1)
                sc = np.array([q[bi, i, h] @ k[bi, j, kh] for j in range(lo, i + 1)]) / np.sqrt(head_dim)
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[bi, i, h] = sum(wj * v[bi, lo + n, kh] for n, wj in enumerate(w))
    return out.reshape(b, s, n_heads * head_dim) @ np.asarray(p["wo"], np.float64)


def forward_reference(params: dict, state: dict, tokens, m: ModelConfig) -> np.ndarray:
    """The whole model, layer by layer, from the references above: local layers see a window and
    their own kv-head count, the last layer and every global_every-th are global. Dropless."""
    x = np.asarray(params["embed"], np.float64)[np.asarray(tokens)]

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + m.norm_eps) * np.asarray(w, np.float64)

    for i in range(m.n_layers):
        p = {k: np.asarray(v[i]) for k, v in params["layers"].items()}
        glob = i == m.n_layers - 1 or not m.sliding_window or (m.global_every and (i + 1) % m.global_every == 0)
        kv = m.n_kv_heads if glob else (m.n_kv_heads_local or m.n_kv_heads)
        x = x + attention_reference(
            p,
            norm(x, p["attn_norm"]),
            n_heads=m.n_heads,
            n_kv=kv,
            head_dim=m.head_size,
            window=0 if glob else m.sliding_window,
            rope_fraction=m.rope_fraction,
            rope_theta=m.rope_theta,
            eps=m.norm_eps,
        )
        h = jnp.asarray(norm(x, p["mlp_norm"]), jnp.float32)
        jp = {k: jnp.asarray(v) for k, v in p.items()}
        x = x + np.asarray(moe_reference(jp, h, state["router_bias"][i], m), np.float64)
    return norm(x, params["final_norm"])


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr, nested ones (loops, shard_map, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)
