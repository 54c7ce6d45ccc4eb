"""The language model: parameters, router-bias state, forward pass and loss.

Follow one token: embed -> per layer [RMSNorm -> attention -> +residual -> RMSNorm -> MoE ->
+residual] -> RMSNorm -> untied LM head. Layer weights are stacked on a leading [layers] axis.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moelab.config import ModelConfig, rope_scaling_of
from moelab.errors import UsageError
from moelab.model.layers import attention, rms_norm
from moelab.model.moe import moe_block
from moelab.parallel import mesh as pmesh

# kept in fp32 whatever the compute dtype: router maths and norm weights
FP32_PARAMS = ("router", "attn_norm", "mlp_norm", "latent_norm", "final_norm")


def _normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


def param_shapes(m: ModelConfig) -> dict:
    """Every parameter's shape; the layer entries carry a leading [n_layers] axis."""
    d, L, hd = m.d_model, m.n_layers, m.head_size
    din, f = m.expert_in_dim, m.expert_dim
    layers = {
        "attn_norm": (L, d),
        "wq": (L, d, m.n_heads * hd),
        "wk": (L, d, m.kv_heads_alloc * hd),
        "wv": (L, d, m.kv_heads_alloc * hd),
        "wo": (L, m.n_heads * hd, d),
        "mlp_norm": (L, d),
        "router": (L, d, m.n_routed),
        "w_gate": (L, m.n_routed, din, f),
        "w_up": (L, m.n_routed, din, f),
        "w_down": (L, m.n_routed, f, din),
    }
    if m.latent_dim:
        layers.update(latent_down=(L, d, m.latent_dim), latent_norm=(L, m.latent_dim), latent_up=(L, m.latent_dim, d))
    if m.n_shared:
        width = m.n_shared * m.shared_dim  # n shared experts side by side = one SwiGLU n times as wide
        layers.update(shared_gate=(L, d, width), shared_up=(L, d, width), shared_down=(L, width, d))
    return {"embed": (m.vocab_size, d), "layers": layers, "final_norm": (d,), "head": (d, m.vocab_size)}


def init_params(m: ModelConfig, key: jax.Array) -> dict:
    """Truncated normal with std 1/sqrt(fan_in); residual outputs also scaled by 1/sqrt(2 * layers)."""
    shapes = param_shapes(m)
    out_scale = 1.0 / math.sqrt(2 * m.n_layers)
    residual_out = ("wo", "w_down", "latent_up", "shared_down")
    names = sorted(shapes["layers"])
    keys = jax.random.split(key, len(names) + 2)
    layers = {}
    for k, name in zip(keys[: len(names)], names, strict=True):
        shape = shapes["layers"][name]
        if name.endswith("_norm"):
            layers[name] = jnp.ones(shape, jnp.float32)
            continue
        std = 1.0 / math.sqrt(shape[-2])
        if name in residual_out:
            std *= out_scale
        layers[name] = _normal(k, shape, std)
    return {
        "embed": _normal(keys[-2], shapes["embed"], 1.0),
        "layers": layers,
        "final_norm": jnp.ones(shapes["final_norm"], jnp.float32),
        "head": _normal(keys[-1], shapes["head"], 1.0 / math.sqrt(m.d_model)),
    }


def init_state(m: ModelConfig) -> dict:
    """Router biases: state saved with the model, updated from each batch, never by gradients."""
    return {"router_bias": jnp.zeros((m.n_layers, m.n_routed), jnp.float32)}


def count_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def cast_params(params: dict, dtype: jnp.dtype) -> dict:
    layers = {k: v if k in FP32_PARAMS else v.astype(dtype) for k, v in params["layers"].items()}
    return dict(params, layers=layers, embed=params["embed"].astype(dtype), head=params["head"].astype(dtype))


CUDNN_DTYPES = ("bfloat16", "float16")  # JAX's cuDNN attention takes only these


def backend_problems(m: ModelConfig) -> list[str]:
    """What this machine's JAX backend cannot run of ``m``, one line each (checked before a run starts)."""
    if m.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        return [
            f"model.attention_impl: cudnn needs an NVIDIA GPU and JAX runs on {jax.default_backend()}; "
            f"use auto (cudnn on a GPU, blocked here), blocked or xla"
        ]
    if m.attention_impl == "cudnn" and m.dtype not in CUDNN_DTYPES:
        return [
            f"model.attention_impl: cudnn takes bfloat16 or float16 and model.compute_dtype is {m.dtype}; "
            "set model.compute_dtype=bfloat16, or use auto (flash or blocked in float32)"
        ]
    return []


FLASH_MIN_SEQ = 2048  # auto: the flash path from this length off GPU (measured: 0.8x at 1024, 2.2x at 4096)


def attention_impl(m: ModelConfig, seq: int) -> str:
    """``model.attention_impl``, with ``auto`` resolved: the fused cuDNN kernel on NVIDIA GPUs when the
    compute dtype is one it takes (bfloat16, float16), else moelab's blocked path for short sequences
    and its flash path (no [s, s] buffer) for long ones (float32 on a GPU included: cuDNN refuses it)."""
    if m.attention_impl != "auto":
        return m.attention_impl
    if jax.default_backend() == "gpu" and m.dtype in CUDNN_DTYPES:
        return "cudnn"
    return "flash" if seq >= FLASH_MIN_SEQ else "blocked"


def transformer_layer(
    x: jax.Array,
    p: dict,
    bias: jax.Array,
    *,
    i: int,
    m: ModelConfig,
    dispatch: str,
    capture: bool,
    runtime: pmesh.Runtime = pmesh.ONE,
    segments: jax.Array | None = None,
):
    """One transformer layer: x [b, s, d] -> (x, this layer's metrics, its router bias for the next step).
    ``segments``: packed documents, each attending only within itself (``layers.attention``).

    Under FSDP the layer's weights are gathered here, inside any rematerialised region: a
    recomputed layer gathers them again rather than keeping every layer's whole weights alive."""
    p = pmesh.gathered(p, runtime)
    x = x + attention_block(x, p, i=i, m=m, runtime=runtime, segments=segments)
    h = rms_norm(x, p["mlp_norm"], m.norm_eps)
    with jax.named_scope("moe"):
        y, metrics, new_bias = moe_block(p, h, bias, m, dispatch, runtime)
    if capture:
        metrics = dict(metrics, moe_input=h)
    return x + y, metrics, new_bias


def attention_block(
    x: jax.Array, p: dict, *, i: int, m: ModelConfig, runtime: pmesh.Runtime = pmesh.ONE, segments=None
) -> jax.Array:
    """Layer ``i``'s attention on its normed input (what the layer adds to x), its weights gathered."""
    h = rms_norm(x, p["attn_norm"], m.norm_eps)
    with jax.named_scope("attention"):  # scopes name the profiler's ops (benchmarks/profile_step.py)
        return attention(
            p,
            h,
            n_heads=m.n_heads,
            n_kv_alloc=m.kv_heads_alloc,
            n_kv=m.layer_kv_heads(i),
            head_dim=m.head_size,
            window=0 if m.is_global(i) else m.sliding_window,
            rope_fraction=m.rope_fraction,
            rope_theta=m.rope_theta,
            rope_scaling=rope_scaling_of(m),
            eps=m.norm_eps,
            impl=attention_impl(m, x.shape[1]),
            fused_qkv=runtime.expert_mesh is None,
            segments=segments,
        )


SCAN_MIN_LAYERS = 12  # scan_layers: auto scans from this depth on CPU (measured: 6% slower unrolled at 4-8 layers)


def scans(m: ModelConfig) -> bool:
    """Whether the layers run as a ``lax.scan`` (``model.scan_layers``; ``remat: layer`` always does)."""
    if m.remat != "none" or m.scan_layers == "scan":
        return True
    if m.scan_layers == "unrolled":
        return False
    return jax.default_backend() != "cpu" or m.n_layers >= SCAN_MIN_LAYERS


def scan_blocks(m: ModelConfig) -> tuple[int, int]:
    """(layers per scanned block, layers scanned): whole periods of the local/global pattern, or
    (1, 0) when there are fewer than two periods or the pattern is not periodic (all unrolled)."""
    period = m.global_every if m.sliding_window and m.global_every > 0 else 1
    n_full = m.n_layers // period * period

    def same(i):
        return (m.is_global(i), m.layer_kv_heads(i)) == (m.is_global(i % period), m.layer_kv_heads(i % period))

    if n_full < 2 * period or not all(same(i) for i in range(n_full)):
        return 1, 0
    return period, n_full


def _scan_layers(
    params: dict, state: dict, x: jax.Array, m: ModelConfig, dispatch: str, capture: bool, runtime: pmesh.Runtime,
    segments: jax.Array | None = None,
):  # fmt: skip
    """Layers as a ``lax.scan`` over whole periods of the local/global pattern: the step compiles
    one period whatever the depth. Layers past the last whole period (and all of them when there
    are fewer than two periods, or the pattern is not periodic) are left to the caller, unrolled.

    With ``remat: layer`` each scan step keeps only its input for the backward pass and runs its
    layers again there. Unrolled, the recomputation depends only on forward values and XLA:CPU
    schedules it early, which keeps every activation alive: the checkpoint then saves nothing
    (measured). A loop's reverse pass cannot be hoisted. Returns x, the first layer not done,
    metrics and biases per layer.
    """
    period, n_full = scan_blocks(m)
    if not n_full:
        return x, 0, [], []
    fold = lambda a: a[:n_full].reshape((n_full // period, period) + a.shape[1:])  # noqa: E731

    offload = m.remat != "none" and runtime.offload_inputs
    policy = offload_policy() if offload else None

    def saved(fn):
        """``fn`` whose input is what its checkpoint keeps: in host memory when offloading."""
        if not offload:
            return fn
        return lambda x, *rest, **kw: fn(checkpoint_name(x, "block_input"), *rest, **kw)

    def body(x, xs):
        p_stack, bias_stack = xs
        metrics, biases = [], []
        for j in range(period):
            p = jax.tree.map(lambda a, j=j: a[j], p_stack)
            one = functools.partial(transformer_layer, i=j, m=m, dispatch=dispatch, capture=capture, runtime=runtime,
                                    **({} if segments is None else {"segments": segments}))  # fmt: skip
            if m.remat == "each_layer":  # each layer its own checkpoint: one layer's residuals at a time
                one = _remat_alone(one, offload)
            x, met, bias = one(x, p, bias_stack[j])
            metrics.append(met)
            biases.append(bias)
        return x, (jax.tree.map(lambda *a: jnp.stack(a), *metrics), jnp.stack(biases))

    if m.remat != "none":  # each_layer too: the period's recomputation runs its layers' own checkpoints
        body = jax.checkpoint(saved(body), policy=policy)
    x, (metrics, biases) = jax.lax.scan(body, x, (jax.tree.map(fold, params["layers"]), fold(state["router_bias"])))
    per_layer = jax.tree.map(lambda a: a.reshape((n_full,) + a.shape[2:]), metrics)
    layer_metrics = [jax.tree.map(lambda a, i=i: a[i], per_layer) for i in range(n_full)]
    return x, n_full, layer_metrics, list(biases.reshape((n_full,) + biases.shape[2:]))


def _remat_alone(one, offload: bool):
    """``one(x, p, bias)`` (a layer) rematerialised on its own, with an order the scheduler must keep:
    the forward pass keeps only its input (in host memory when offloading, as ``offload_policy``
    does), and the backward pass recomputes the layer only once its output's cotangent has arrived
    (an optimization barrier ties the two), so the layers of a scanned period are recomputed one at
    a time. Inside a scanned period that is itself rematerialised (``remat: each_layer``): with
    per-layer checkpoints alone XLA:CPU kept a period's layers' residuals together (307 GB compiled at
    the hero's width where one layer at a time plans 172)."""

    @jax.custom_vjp
    def layer(x, p, bias):
        return one(x, p, bias)

    def fwd(x, p, bias):
        kept = jax.device_put(x, jax.memory.Space.Host) if offload else x
        return one(x, p, bias), (kept, p, bias)

    def bwd(res, ct):
        kept, p, bias = res
        x = jax.device_put(kept, jax.memory.Space.Device) if offload else kept
        x, ct = jax.lax.optimization_barrier((x, ct))
        _, vjp = jax.vjp(one, x, p, bias)
        return vjp(ct)

    layer.defvjp(fwd, bwd)
    return layer


def offload_policy():
    """Save nothing on the device; offload the values named ``block_input`` to pinned host memory."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["block_input"],
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip


@jax.custom_vjp
def unstack(stacked: dict) -> list[dict]:
    """Per-layer weights from the [layers, ...] stacks. The same as slicing each layer, but the
    gradient is one ``stack`` of the layers' gradients: autodiff of each slice pads it to the full
    stack and adds, a pass over every layer's weights per layer (about 2% of shape B's step)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]


unstack.defvjp(
    lambda stacked: (unstack(stacked), None), lambda _, grads: (jax.tree.map(lambda *g: jnp.stack(g), *grads),)
)


def forward(
    params: dict,
    state: dict,
    tokens: jax.Array,
    m: ModelConfig,
    dispatch: str | None = None,
    capture: bool = False,
    runtime: pmesh.Runtime = pmesh.ONE,
    segments: jax.Array | None = None,
):
    """tokens: [b, s] int -> (hidden [b, s, d] after the final norm, per-layer metrics, new state).

    ``segments`` [b, s]: the documents packed in each row (``layers.document_segments``); each attends
    only within itself.

    ``runtime``: the mesh, FSDP and the step's tracing flags (``parallel.mesh.Runtime``; one device by default).

    ``capture``: the metrics also hold each MoE block's input (``moe_input``, [layers, b, s, d]),
    for studies that replay the routing (benchmarks/drops_vs_context.py)."""
    dispatch = dispatch or m.dispatch
    dtype = jnp.dtype(m.dtype)
    if dtype != jnp.float32:
        params = cast_params(params, dtype)
    x = pmesh.gathered({"embed": params["embed"]}, runtime)["embed"][tokens]
    layer_metrics = []
    new_bias = []
    first = 0
    if segments is not None and m.remat == "each_layer":
        raise UsageError("packed documents (conversations) and model.remat: each_layer: use remat layer or none")
    if scans(m):
        x, first, layer_metrics, new_bias = _scan_layers(params, state, x, m, dispatch, capture, runtime, segments)
    rest = params["layers"] if not first else jax.tree.map(lambda a: a[first:], params["layers"])
    for i, p in enumerate(unstack(rest) if first < m.n_layers else [], start=first):  # unrolled: local and
        one = functools.partial(
            transformer_layer, i=i, m=m, dispatch=dispatch, capture=capture, runtime=runtime,
            **({} if segments is None else {"segments": segments}),
        )  # layers differ  # fmt: skip
        if m.remat != "none":
            one = jax.checkpoint(one)
        x, metrics, bias = one(x, p, state["router_bias"][i])
        layer_metrics.append(metrics)
        new_bias.append(bias)
    metrics = jax.tree.map(lambda *a: jnp.stack(a), *layer_metrics)
    x = rms_norm(x, params["final_norm"], m.norm_eps)
    return x, metrics, {"router_bias": jnp.stack(new_bias)}


def logits_of(params: dict, hidden: jax.Array, runtime: pmesh.Runtime = pmesh.ONE) -> jax.Array:
    head = pmesh.gathered({"head": params["head"]}, runtime)["head"].astype(hidden.dtype)
    return jnp.einsum("bsd,dv->bsv", hidden, head, preferred_element_type=jnp.float32)


def ce_terms(
    params: dict, hidden: jax.Array, targets: jax.Array, chunk: int = 0, runtime: pmesh.Runtime = pmesh.ONE
) -> tuple[jax.Array, jax.Array]:
    """Each token's log-partition and target logit, [b, s] each, in fp32.

    ``chunk`` > 0: ``chunk`` tokens at a time, each chunk's logits recomputed in the backward pass,
    so no more than [chunk, vocab] logits exist at once. The same numbers as chunk 0 (tests).
    """
    b, s, d = hidden.shape
    n = b * s

    def terms(args):
        hc, tc = args
        logits = logits_of(params, hc, runtime)
        return jax.nn.logsumexp(logits, axis=-1), jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]

    if not chunk or chunk >= n:
        return terms((hidden, targets))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(n_chunks, 1, chunk, d)
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, 1, chunk)
    lse, tgt = jax.lax.map(jax.checkpoint(terms), (h, t))
    return lse.reshape(-1)[:n].reshape(b, s), tgt.reshape(-1)[:n].reshape(b, s)


def total_loss(ce, logit_z, aux, router_z, m: ModelConfig, logit_z_scale=1.0):
    """Cross-entropy plus each z and aux term times its coefficient (router terms averaged over
    layers). A term whose coefficient is zero is left out, not multiplied by 0 (0 * NaN is NaN)."""
    loss = ce
    if m.logit_z_loss:
        loss = loss + logit_z_scale * m.logit_z_loss * logit_z
    if m.aux_loss_coef:
        loss = loss + m.aux_loss_coef * aux
    if m.router_z_loss_coef:
        loss = loss + m.router_z_loss_coef * router_z
    return loss


def loss_fn(
    params: dict,
    state: dict,
    inputs: jax.Array,
    targets: jax.Array,
    m: ModelConfig,
    *,
    mask: jax.Array | None = None,
    train: bool = True,
    logit_z_scale=1.0,
    runtime: pmesh.Runtime = pmesh.ONE,
    segments: jax.Array | None = None,
):
    """Cross-entropy + logit z-loss + router aux and z terms. Returns (loss, (metrics, new_state)).

    Router aux and z terms are averaged over layers before their coefficients apply.
    """
    dispatch = m.dispatch if train else (m.eval_dispatch or m.dispatch)
    hidden, layers, new_state = forward(params, state, inputs, m, dispatch, runtime=runtime, segments=segments)
    with jax.named_scope("head"):
        lse, target_logit = ce_terms(params, hidden, targets, m.ce_chunk, runtime)
    weight = jnp.ones_like(lse) if mask is None else mask.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(weight), 1.0)
    ce = jnp.sum((lse - target_logit) * weight) / denom
    logit_z = jnp.sum(lse**2 * weight) / denom
    aux = jnp.mean(layers["aux_loss"])
    router_z = jnp.mean(layers["router_z"])
    loss = total_loss(ce, logit_z, aux, router_z, m, logit_z_scale)
    metrics = {"loss": loss, "ce": ce, "logit_z": logit_z, "aux_loss": aux, "router_z": router_z, "layers": layers}
    return loss, (metrics, new_state)
