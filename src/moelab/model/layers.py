"""Building blocks: RMSNorm, rotary embedding, grouped-query attention with an optional window, SwiGLU.

Layers are functions ``f(params, x, ...)`` over plain arrays; nothing holds state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) over the last axis, in fp32, times an optional weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, fraction: float = 1.0, theta: float = 10000.0) -> jax.Array:
    """Rotate the first ``fraction`` of each head's dims (half-split pairing). x: [b, s, h, hd]."""
    hd = x.shape[-1]
    rot = int(hd * fraction)
    half = rot // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [s, half]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:rot], x32[..., rot:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def attention_mask(seq: int, window: int) -> jax.Array:
    """Causal mask, limited to the last ``window`` keys (itself included) when window > 0. [s, s]."""
    i = jnp.arange(seq)[:, None]
    j = jnp.arange(seq)[None, :]
    mask = j <= i
    if window:
        mask = mask & (i - j < window)
    return mask


def group_kv(w: jax.Array, n_alloc: int, n_used: int) -> jax.Array:
    """A layer that uses fewer kv heads than are allocated averages them in groups. w: [d, n_alloc*hd].

    Marin allocates the local kv-head count in every layer; averaging the weights (not the
    outputs) keeps a global layer's cost at its own head count and trains every parameter.
    """
    if n_used == n_alloc:
        return w
    d = w.shape[0]
    hd = w.shape[1] // n_alloc
    return w.reshape(d, n_used, n_alloc // n_used, hd).mean(axis=2).reshape(d, n_used * hd)


def auto_query_chunks(seq: int) -> int:
    """Query blocks of at least 128 positions, at most 4: the attention core about 1.35x (seq 256)
    to 2x (seq 512) faster on XLA:CPU, forward and backward. Shorter sequences keep one block: the
    gain there is small and each block adds compile time (about 1 s for the tiny preset's step)."""
    for n in (4, 2):
        if seq % n == 0 and seq // n >= 128:
            return n
    return 1


def attention(
    p: dict,
    x: jax.Array,
    *,
    n_heads: int,
    n_kv_alloc: int,
    n_kv: int,
    head_dim: int,
    window: int,
    rope_fraction: float,
    rope_theta: float,
    eps: float,
    query_chunks: int | None = None,
    impl: str = "blocked",
) -> jax.Array:
    """Grouped-query causal attention with RMS qk-norm and RoPE. x: [b, s, d] -> [b, s, d].

    ``query_chunks``: the queries in that many blocks, each scored only against the keys it can
    see (causal, and the window), so the masked upper triangle is mostly never computed; None
    picks ``auto_query_chunks(s)``, 1 is the plain (reference) path. ``impl``: ``blocked`` (this
    function's own path, the fastest on XLA:CPU), or ``xla`` / ``cudnn`` through
    ``jax.nn.dot_product_attention`` (cudnn: the fused flash kernel on NVIDIA GPUs).
    """
    b, s, _ = x.shape
    q = (x @ p["wq"]).reshape(b, s, n_heads, head_dim)
    k = (x @ group_kv(p["wk"], n_kv_alloc, n_kv)).reshape(b, s, n_kv, head_dim)
    v = (x @ group_kv(p["wv"], n_kv_alloc, n_kv)).reshape(b, s, n_kv, head_dim)
    pos = jnp.arange(s)
    q = rope(rms_norm(q, eps=eps), pos, rope_fraction, rope_theta)
    k = rope(rms_norm(k, eps=eps), pos, rope_fraction, rope_theta)
    g = n_heads // n_kv
    if impl != "blocked":  # [b, s, heads, hd] in, grouped kv heads, causal, the window as local_window_size
        out = jax.nn.dot_product_attention(
            q, k, v, scale=head_dim**-0.5, is_causal=True, implementation=impl,
            local_window_size=(window - 1, 0) if window else None,
        )  # fmt: skip
        return out.reshape(b, s, n_heads * head_dim) @ p["wo"]
    # heads before positions: each (batch, kv head) is a plain matmul, which XLA:CPU runs about
    # 1.2x as fast as the [b, s, kv, g, s] layout, softmax included
    q = (q * head_dim**-0.5).reshape(b, s, n_kv, g, head_dim).transpose(0, 2, 3, 1, 4)  # [b, kv, g, s, hd]
    k = k.transpose(0, 2, 1, 3)  # [b, kv, s, hd]
    v = v.transpose(0, 2, 1, 3)
    n_chunks = query_chunks if query_chunks is not None else auto_query_chunks(s)
    if s % n_chunks:
        raise ValueError(f"query_chunks={n_chunks} does not divide the sequence length {s}")
    c = s // n_chunks
    mask = attention_mask(s, window)
    outs = []
    for i in range(n_chunks):  # chunk i's queries see keys [lo, hi) only: causal blocks never computed
        hi = (i + 1) * c
        lo = max(0, i * c - window + 1) if window else 0
        qi = q[:, :, :, i * c : hi].reshape(b, n_kv, g * c, head_dim)  # a group's heads stacked along queries
        scores = jnp.einsum("bkqh,bkph->bkqp", qi, k[:, :, lo:hi], preferred_element_type=jnp.float32)
        scores = scores + jnp.where(jnp.tile(mask[i * c : hi, lo:hi], (g, 1)), 0.0, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkqp,bkph->bkqh", probs, v[:, :, lo:hi]).reshape(b, n_kv, g, c, head_dim))
    out = outs[0] if n_chunks == 1 else jnp.concatenate(outs, axis=3)  # [b, kv, g, s, hd]
    out = out.reshape(b, n_heads, s, head_dim).transpose(0, 2, 1, 3).reshape(b, s, n_heads * head_dim)
    return out @ p["wo"]


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """silu(x W_gate) * (x W_up) W_down. x: [..., d]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
