"""Building blocks: RMSNorm, rotary embedding, grouped-query attention with an optional window, SwiGLU.

Layers are functions ``f(params, x, ...)`` over plain arrays; nothing holds state.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) over the last axis, in fp32, times an optional weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp: rotations over the original context (Peng et al. 2023)


def rope_frequencies(half: int, theta: float, scaling: tuple = ("none", 1.0, 0)) -> tuple[np.ndarray, float]:
    """The rotary angular frequencies (``half`` of them, float64) and the factor cos and sin are
    multiplied by, for a context ``s`` times the original ``L0``: ``scaling = (kind, s, L0)``.

    With f_i = theta^(-i/half):
    - ``none`` (or s <= 1): f_i, factor 1;
    - ``pi`` (position interpolation, Chen et al. 2023): f_i / s;
    - ``ntk`` (NTK-aware): theta is raised to theta * s^(rot / (rot - 2)), rot = 2 * half;
    - ``yarn`` (Peng et al. 2023): r_i = L0 * f_i / (2 pi) rotations over the original context,
      g_i = clip((r_i - 1) / (32 - 1), 0, 1); f_i * ((1 - g_i) / s + g_i) (slow dims interpolated,
      fast ones kept), and cos and sin times 0.1 ln s + 1 (the attention temperature)."""
    kind, s, base = scaling
    i = np.arange(half, dtype=np.float64)
    f = float(theta) ** (-i / half)
    if kind == "none" or s <= 1.0:
        return f, 1.0
    if kind == "pi":
        return f / s, 1.0
    if kind == "ntk":
        rot = 2 * half
        return (float(theta) * s ** (rot / (rot - 2))) ** (-i / half), 1.0
    if kind == "yarn":
        r = base * f / (2 * np.pi)
        g = np.clip((r - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0.0, 1.0)
        return f * ((1.0 - g) / s + g), 0.1 * float(np.log(s)) + 1.0
    raise ValueError(f"rope scaling {kind!r}: use one of {', '.join(ROPE_SCALINGS)}")


def rope(
    x: jax.Array,
    positions: jax.Array,
    fraction: float = 1.0,
    theta: float = 10000.0,
    scaling: tuple = ("none", 1.0, 0),
) -> jax.Array:
    """Rotate the first ``fraction`` of each head's dims (half-split pairing). x: [b, s, h, hd];
    ``positions``: [s] or [b, s]. ``scaling``: (kind, factor, original length), see ``rope_frequencies``."""
    hd = x.shape[-1]
    rot = int(hd * fraction)
    half = rot // 2
    f, mscale = rope_frequencies(half, theta, scaling)
    freqs = jnp.asarray(f, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [(b,) s, half]
    if angles.ndim == 2:
        angles = angles[None]
    cos = (jnp.cos(angles) * mscale)[:, :, None, :]
    sin = (jnp.sin(angles) * mscale)[:, :, None, :]
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


def segment_mask(segments: jax.Array, seq: int, window: int) -> jax.Array:
    """[b, s, s]: causal (and the window), and within one document: ``segments`` [b, s] numbers each
    position's document in its row."""
    return attention_mask(seq, window)[None] & (segments[:, :, None] == segments[:, None, :])


def document_segments(tokens: jax.Array, eot: int) -> jax.Array:
    """[b, s] -> each position's document in its row: the count of end-of-text tokens before it (an
    end-of-text token belongs to the document it ends)."""
    ends = (tokens == eot).astype(jnp.int32)
    return jnp.cumsum(ends, axis=1) - ends


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


FLASH_BLOCK = 512  # query and key rows per block of the flash path


def _block_mask(qi: jax.Array, kj: jax.Array, window: int) -> jax.Array:
    """Which (query, key) pairs of a block may attend: causal, and within the window. Positions in."""
    ok = kj[None, :] <= qi[:, None]
    if window:
        ok = ok & (qi[:, None] - kj[None, :] < window)
    return ok


def _key_blocks(i, block: int, window: int):
    """The key blocks [lo, hi) that query block i can see (block size ``block`` both ways)."""
    hi = i + 1
    lo = jnp.maximum(0, (i * block - window + 1) // block) if window else 0
    return lo, hi


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int = 0, block: int = FLASH_BLOCK) -> jax.Array:
    """Causal attention by blocks with an online softmax, forward and backward: no [s, s] buffer.

    q: [b, kv, g, s, hd] (already scaled), k and v: [b, kv, s, hd] -> [b, kv, g, s, hd]. Each query
    block visits only the key blocks it can see (causal, the window); the forward keeps the output
    and each row's log-sum-exp, and the hand-written backward recomputes each block's probabilities.
    The largest temporary is one block's [b, kv, g*block, block] scores. A sequence that is not a
    multiple of the block is padded at the end: causality hides the padded keys from real queries.
    """
    b, n_kv, g, s, hd = q.shape
    block = min(block, -(-s // 8) * 8)
    pad = -s % block
    if pad:
        q = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k, v))
    out = _flash(q, k, v, window, block)
    return out[:, :, :, :s] if pad else out


def _rows(a: jax.Array, i, block: int) -> jax.Array:
    """Block i of a [b, kv, g, s, hd] array as [b, kv, g*block, hd] (a group's heads along the rows)."""
    b, n_kv, g, _, hd = a.shape
    return jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=3).reshape(b, n_kv, g * block, hd)


def _key_rows(a: jax.Array, j, block: int) -> jax.Array:
    """Key block j of a [b, kv, s, hd] array."""
    return jax.lax.dynamic_slice_in_dim(a, j * block, block, axis=2)


def _flash_scores(qi, kj, i, j, block: int, g: int, window: int):
    """One block's scores (fp32) and its mask, [b, kv, g*block, block]."""
    qpos = jnp.tile(i * block + jnp.arange(block), g)
    ok = _block_mask(qpos, j * block + jnp.arange(block), window)
    return jnp.einsum("bkqh,bkph->bkqp", qi, kj, preferred_element_type=jnp.float32), ok


def _flash_forward(q, k, v, window: int, block: int):
    b, n_kv, g, s, hd = q.shape
    n = s // block
    kb = partial(_key_rows, block=block)

    def query_block(i):
        qi = _rows(q, i, block)

        def key_block(j, carry):
            m, total, acc = carry
            sc, ok = _flash_scores(qi, kb(k, j), i, j, block, g, window)
            m_new = jnp.maximum(m, jnp.max(jnp.where(ok, sc, -jnp.inf), axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            pr = jnp.where(ok, jnp.exp(sc - m_safe[..., None]), 0.0)
            decay = jnp.exp(m - m_safe)  # 0 while the row has seen nothing (m = -inf)
            total = total * decay + jnp.sum(pr, axis=-1)
            acc = acc * decay[..., None] + jnp.einsum("bkqp,bkph->bkqh", pr.astype(v.dtype), kb(v, j),
                                                       preferred_element_type=jnp.float32)  # fmt: skip
            return m_new, total, acc

        lo, hi = _key_blocks(i, block, window)
        rows = (b, n_kv, g * block)
        init = (
            jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros(rows + (hd,), jnp.float32),
        )
        m, total, acc = jax.lax.fori_loop(lo, hi, key_block, init)
        out = (acc / total[..., None]).astype(q.dtype).reshape(b, n_kv, g, block, hd)
        return out, (m + jnp.log(total)).reshape(b, n_kv, g, block)

    outs, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, b, kv, g, block, ...]
    out = jnp.moveaxis(outs, 0, 3).reshape(b, n_kv, g, s, hd)
    return out, jnp.moveaxis(lse, 0, 3).reshape(b, n_kv, g, s)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, window: int, block: int):
    return _flash_forward(q, k, v, window, block)[0]


def _flash_fwd(q, k, v, window, block):
    out, lse = _flash_forward(q, k, v, window, block)
    return out, (q, k, v, out, lse)


def _flash_bwd(window, block, res, d_out):
    q, k, v, out, lse = res
    b, n_kv, g, s, hd = q.shape
    n = s // block
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, kv, g, s]
    kb = partial(_key_rows, block=block)

    def query_block(i, carry):
        dq, dk, dv = carry
        qi, doi = _rows(q, i, block), _rows(d_out, i, block)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, i * block, block, axis=3).reshape(b, n_kv, g * block)
        delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3).reshape(b, n_kv, g * block)

        def key_block(j, carry):
            dqi, dk, dv = carry
            kj, vj = kb(k, j), kb(v, j)
            sc, ok = _flash_scores(qi, kj, i, j, block, g, window)
            pr = jnp.where(ok, jnp.exp(sc - lse_i[..., None]), 0.0)
            dp = jnp.einsum("bkqh,bkph->bkqp", doi, vj, preferred_element_type=jnp.float32)
            ds = (pr * (dp - delta_i[..., None])).astype(q.dtype)
            dqi = dqi + jnp.einsum("bkqp,bkph->bkqh", ds, kj, preferred_element_type=jnp.float32)
            upd = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, kb(a, j) + x, j * block, axis=2)  # noqa: E731
            dk = upd(dk, jnp.einsum("bkqp,bkqh->bkph", ds, qi, preferred_element_type=jnp.float32))
            dv = upd(dv, jnp.einsum("bkqp,bkqh->bkph", pr.astype(q.dtype), doi, preferred_element_type=jnp.float32))
            return dqi, dk, dv

        lo, hi = _key_blocks(i, block, window)
        dqi = jnp.zeros((b, n_kv, g * block, hd), jnp.float32)
        dqi, dk, dv = jax.lax.fori_loop(lo, hi, key_block, (dqi, dk, dv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dqi.reshape(b, n_kv, g, block, hd), i * block, axis=3)
        return dq, dk, dv

    zeros = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    dq, dk, dv = jax.lax.fori_loop(0, n, query_block, (zeros(q), zeros(k), zeros(v)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


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
    rope_scaling: tuple = ("none", 1.0, 0),
    query_chunks: int | None = None,
    impl: str = "blocked",
    flash_block: int = FLASH_BLOCK,
    fused_qkv: bool = True,
    segments: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query causal attention with RMS qk-norm and RoPE. x: [b, s, d] -> [b, s, d].

    ``query_chunks``: the queries in that many blocks, each scored only against the keys it can
    see (causal, and the window), so the masked upper triangle is mostly never computed; None
    picks ``auto_query_chunks(s)``, 1 is the plain (reference) path. ``impl``: ``blocked`` (this
    function's own path, the fastest on XLA:CPU at short sequences), ``flash`` (``flash_attention``:
    blocks with an online softmax, no [s, s] buffer forward or backward, for long sequences on
    CPU), or ``xla`` / ``cudnn`` through ``jax.nn.dot_product_attention`` (cudnn: the fused flash
    kernel on NVIDIA GPUs). ``fused_qkv``: q, k and v from one matmul on the concatenated weights
    (the same numbers; off under a mesh, where the three weights are sharded on their own).

    ``segments`` [b, s]: each position's document in a packed row; a query sees only keys of its own
    document (``segment_mask``). RoPE's scores depend on positions only through their difference, so
    a document attends as it would alone. With segments, ``blocked`` and ``flash`` run the dense
    reference path (an [s, s] mask per row), ``xla`` and ``cudnn`` take the mask.
    """
    b, s, _ = x.shape
    wq, wk, wv = p["wq"], group_kv(p["wk"], n_kv_alloc, n_kv), group_kv(p["wv"], n_kv_alloc, n_kv)
    if fused_qkv:  # one matmul: the backward transposes x once for the three weight gradients, not three times
        qkv = x @ jnp.concatenate([wq, wk, wv], axis=1)
        q, k, v = jnp.split(qkv, [wq.shape[1], wq.shape[1] + wk.shape[1]], axis=-1)
    else:
        q, k, v = x @ wq, x @ wk, x @ wv
    q, k, v = q.reshape(b, s, n_heads, head_dim), k.reshape(b, s, n_kv, head_dim), v.reshape(b, s, n_kv, head_dim)
    pos = jnp.arange(s)
    q = rope(rms_norm(q, eps=eps), pos, rope_fraction, rope_theta, rope_scaling)
    k = rope(rms_norm(k, eps=eps), pos, rope_fraction, rope_theta, rope_scaling)
    g = n_heads // n_kv
    if impl not in (
        "blocked",
        "flash",
    ):  # [b, s, heads, hd] in, grouped kv heads, causal, the window as local_window_size
        mask = None if segments is None else segment_mask(segments, s, window)[:, None]
        out = jax.nn.dot_product_attention(
            q, k, v, scale=head_dim**-0.5, is_causal=segments is None, implementation=impl, mask=mask,
            local_window_size=(window - 1, 0) if window and segments is None else None,
        )  # fmt: skip
        return out.reshape(b, s, n_heads * head_dim) @ p["wo"]
    # heads before positions: each (batch, kv head) is a plain matmul, which XLA:CPU runs about
    # 1.2x as fast as the [b, s, kv, g, s] layout, softmax included
    q = (q * head_dim**-0.5).reshape(b, s, n_kv, g, head_dim).transpose(0, 2, 3, 1, 4)  # [b, kv, g, s, hd]
    k = k.transpose(0, 2, 1, 3)  # [b, kv, s, hd]
    v = v.transpose(0, 2, 1, 3)
    if segments is not None:  # packed documents: the dense path, each row with its own mask
        ok = segment_mask(segments, s, window)[:, None, None]  # [b, 1, 1, s, s]
        scores = jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(jnp.where(ok, scores, -jnp.inf), axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgqs,bksh->bkgqh", probs, v)
    elif impl == "flash":
        out = flash_attention(q, k, v, window, flash_block)
    else:
        out = _query_chunks(q, k, v, window, query_chunks if query_chunks is not None else auto_query_chunks(s))
    out = out.reshape(b, n_heads, s, head_dim).transpose(0, 2, 1, 3).reshape(b, s, n_heads * head_dim)
    return out @ p["wo"]


def _chunk_spans(s: int, window: int, n_chunks: int) -> list[tuple[int, int, int, int]]:
    """Query chunk i covers rows [q0, q1) and sees keys [lo, hi): causal, and the window."""
    if s % n_chunks:
        raise ValueError(f"query_chunks={n_chunks} does not divide the sequence length {s}")
    c = s // n_chunks
    return [(i * c, (i + 1) * c, max(0, i * c - window + 1) if window else 0, (i + 1) * c) for i in range(n_chunks)]


def _chunk_bias(s: int, window: int, span: tuple[int, int, int, int], g: int) -> jax.Array:
    q0, q1, lo, hi = span
    return jnp.where(jnp.tile(attention_mask(s, window)[q0:q1, lo:hi], (g, 1)), 0.0, -1e30)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _query_chunks(q: jax.Array, k: jax.Array, v: jax.Array, window: int, n_chunks: int) -> jax.Array:
    """The blocked path's core: q [b, kv, g, s, hd] (scaled), k and v [b, kv, s, hd] -> [b, kv, g, s, hd].

    Each chunk's softmax is left unnormalised until after the product with v (a divide over
    [rows, hd], not [rows, keys]); the backward is written out (``_query_chunks_bwd``), with the
    row term of the softmax gradient taken from d_out and out ([rows, hd]) rather than from the
    [rows, keys] probabilities: fewer passes over the score blocks than autodiff makes.
    """
    return _query_chunks_fwd(q, k, v, window, n_chunks)[0]


def _query_chunks_fwd(q, k, v, window: int, n_chunks: int):
    b, n_kv, g, s, head_dim = q.shape
    outs, saved = [], []
    for span in _chunk_spans(s, window, n_chunks):
        q0, q1, lo, hi = span
        qi = q[:, :, :, q0:q1].reshape(b, n_kv, g * (q1 - q0), head_dim)  # a group's heads stacked along rows
        scores = jnp.einsum("bkqh,bkph->bkqp", qi, k[:, :, lo:hi], preferred_element_type=jnp.float32)
        scores = scores + _chunk_bias(s, window, span, g)
        e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        inv = 1.0 / jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("bkqp,bkph->bkqh", e.astype(v.dtype), v[:, :, lo:hi], preferred_element_type=jnp.float32)
        outs.append((o * inv).astype(q.dtype).reshape(b, n_kv, g, q1 - q0, head_dim))
        saved.append((e, inv))
    out = outs[0] if n_chunks == 1 else jnp.concatenate(outs, axis=3)
    return out, (q, k, v, out, saved)


def _query_chunks_bwd(window: int, n_chunks: int, res, d_out):
    q, k, v, out, saved = res
    b, n_kv, g, s, head_dim = q.shape
    dqs, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for span, (e, inv) in zip(_chunk_spans(s, window, n_chunks), saved, strict=True):
        q0, q1, lo, hi = span
        rows = g * (q1 - q0)
        qi = q[:, :, :, q0:q1].reshape(b, n_kv, rows, head_dim)
        do = d_out[:, :, :, q0:q1].reshape(b, n_kv, rows, head_dim).astype(jnp.float32)
        oi = out[:, :, :, q0:q1].reshape(b, n_kv, rows, head_dim).astype(jnp.float32)
        # probs = e * inv; d_scores = probs * (d_probs - rowsum(do * o)), with d_probs = do v^T
        do_inv = do * inv
        row = jnp.sum(do * oi, axis=-1, keepdims=True) * inv
        dv = dv.at[:, :, lo:hi].add(jnp.einsum("bkqp,bkqh->bkph", e, do_inv))
        dp = jnp.einsum("bkqh,bkph->bkqp", do_inv, v[:, :, lo:hi].astype(jnp.float32))
        ds = (e * (dp - row)).astype(q.dtype)
        dqs.append(jnp.einsum("bkqp,bkph->bkqh", ds, k[:, :, lo:hi], preferred_element_type=jnp.float32))
        dk = dk.at[:, :, lo:hi].add(jnp.einsum("bkqp,bkqh->bkph", ds, qi, preferred_element_type=jnp.float32))
    dq = [d.reshape(b, n_kv, g, -1, head_dim) for d in dqs]
    dq = dq[0] if n_chunks == 1 else jnp.concatenate(dq, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_query_chunks.defvjp(_query_chunks_fwd, _query_chunks_bwd)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """silu(x W_gate) * (x W_up) W_down. x: [..., d]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
