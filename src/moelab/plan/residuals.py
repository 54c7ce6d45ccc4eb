"""What the backward pass keeps, traced: the residuals of a layer, an MoE block and the LM head at a
config's shapes (``jax.vjp`` on abstract values, nothing allocated), for the memory plan."""

from __future__ import annotations

import dataclasses
import math

from moelab.config import Config
from moelab.model.moe import moe_block
from moelab.model.transformer import (
    FP32_PARAMS,
    ce_terms,
    param_shapes,
    transformer_layer,
)


def itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def residuals(f, *args) -> list:
    """The abstract values ``jax.vjp(f, *args)`` keeps for the backward pass, its own arguments
    excluded, each once (with its memory space: ``f32<host>[...]`` is kept in host memory); traced
    on abstract shapes, nothing runs."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(args)

    def flat(*xs):
        return f(*jax.tree_util.tree_unflatten(tree, xs))

    closed, shapes = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True)(*leaves)
    n_res = len(jax.tree_util.tree_leaves(shapes[1]))
    jaxpr = closed.jaxpr
    args_in = {id(v) for v in jaxpr.invars}
    seen, out = set(), []
    for v in jaxpr.outvars[len(jaxpr.outvars) - n_res :]:
        if not hasattr(v, "aval") or id(v) in args_in or id(v) in seen or not hasattr(v.aval, "shape"):
            continue
        seen.add(id(v))
        out.append(v.aval)
    return out


def on_host(aval) -> bool:
    import jax

    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def residual_bytes(f, *args) -> int:
    """Bytes of what the backward pass of ``f`` keeps in device memory (offloaded residuals left out)."""
    return sum(math.prod(a.shape) * itemsize(a.dtype) for a in residuals(f, *args) if not on_host(a))


def traced_model(cfg: Config, expert: int):
    """The model config the activations are traced with: one device's dispatch with as many expert
    rows as the expert-parallel transport computes on. Dropless under EP exchanges in rounds and
    keeps only its input for the backward; one device's dropless, which keeps its t*k rows, is
    traced in its place (an upper bound)."""
    m = cfg.model
    if expert > 1 and m.dispatch != "dropless":
        m = dataclasses.replace(m, dispatch="capacity", capacity_group=0)
    return m


def layer_inputs(m, b: int):
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(m.dtype)
    shapes = param_shapes(m)["layers"]
    p = {k: jax.ShapeDtypeStruct(v[1:], jnp.float32 if k in FP32_PARAMS else dt) for k, v in shapes.items()}
    x = jax.ShapeDtypeStruct((b, m.seq_len, m.d_model), dt)
    return x, p, jax.ShapeDtypeStruct((m.n_routed,), jnp.float32)


def layer_residuals(cfg: Config, expert: int, b: int, layer: int) -> int:
    """What the backward pass keeps of layer ``layer`` at ``b`` sequences (one device's dispatch)."""

    m = traced_model(cfg, expert)

    def f(x, p, bias):
        y, metrics, _ = transformer_layer(x, p, bias, i=layer, m=m, dispatch=m.dispatch, capture=False)
        return y, metrics["aux_loss"], metrics["router_z"]

    return residual_bytes(f, *layer_inputs(m, b))


def moe_residuals(cfg: Config, b: int) -> int:
    """What the backward pass keeps of one MoE block at ``b`` sequences."""

    m = cfg.model

    def f(x, p, bias):
        y, metrics, _ = moe_block(p, x, bias, m, m.dispatch)
        return y, metrics["aux_loss"], metrics["router_z"]

    return residual_bytes(f, *layer_inputs(m, b))


def global_dispatch(cfg: Config, n_dev: int, expert: int, b: int) -> bool:
    """Whether each device runs the one-device dispatch over the whole batch: data parallel without
    expert parallelism, with dropless dispatch or a capacity group larger than a device's tokens
    (``capacity_group: 0`` is a device's tokens). XLA then partitions its sorts poorly and every
    device keeps the dispatch's buffers for all the mesh's tokens (measured against the compiler)."""
    m = cfg.model
    if expert > 1 or n_dev == 1 or m.n_routed == 0:
        return False
    return m.dispatch == "dropless" or m.capacity_group > b * m.seq_len


def head_residuals(cfg: Config, b: int) -> int:
    import jax
    import jax.numpy as jnp

    m = cfg.model
    dt = jnp.dtype(m.dtype)
    hidden = jax.ShapeDtypeStruct((b, m.seq_len, m.d_model), dt)
    head = jax.ShapeDtypeStruct((m.d_model, m.vocab_size), dt)
    targets = jnp.zeros((b, m.seq_len), jnp.int32)

    def f(hidden, head):
        lse, tgt = ce_terms({"head": head}, hidden, targets, m.ce_chunk)
        return jnp.sum(lse - tgt)

    return residual_bytes(f, hidden, head)
