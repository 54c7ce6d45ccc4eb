"""The model section of a config: the network's shape, attention, experts, router, dispatch,
numerics and memory options, each field with its meaning, and the checks of its own fields."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.config.fields import (
    ATTENTION_IMPLS,
    BIAS_UPDATES,
    DISPATCHES,
    DROP_ORDERS,
    DTYPES,
    EP_TRANSPORTS,
    MATMUL_PRECISIONS,
    MOE_IMPLS,
    REMATS,
    ROPE_SCALINGS,
    ROUTERS,
    SCAN_LAYERS,
    _f,
)


@dataclass(frozen=True)
class ModelConfig:
    # shape
    d_model: int = _f(
        128,
        "Width of the residual stream (the model dimension). Embeddings, attention, router and shared experts work at it.",
    )
    n_layers: int = _f(4, "Transformer blocks, each attention then a mixture of experts (every layer is MoE).")
    n_heads: int = _f(4, "Query heads per attention layer. With head_dim 0 they must divide d_model.")
    n_kv_heads: int = _f(
        2,
        "Key/value heads of the global layers (of every layer without a sliding window). Grouped-query attention: must divide n_heads.",
    )
    n_kv_heads_local: int = _f(
        0,
        "Key/value heads of the sliding-window (local) layers; 0 = n_kv_heads. Must divide n_heads, and with a "
        "window it and n_kv_heads must divide one another.",
    )
    head_dim: int = _f(0, "Size of each attention head; 0 = d_model // n_heads. Must be even (rotary embedding).")
    vocab_size: int = _f(
        2048,
        "Tokens in the vocabulary: rows of the embedding and of the untied LM head. With no data.tokenizer it is "
        "the size of the byte-level BPE trained here, at least 257 (256 bytes and end-of-text).",
    )
    seq_len: int = _f(
        128,
        "Tokens per training sequence: the model's context. With a long-context phase, the longest of data.phase_seq_lens.",
    )
    # attention
    rope_fraction: float = _f(
        1.0,
        "Fraction of each head's dimensions that rotary embedding rotates, in (0, 1]. 1.0 or 0.5 in practice; the rotated part must be an even number of dimensions.",
    )
    rope_theta: float = _f(10000.0, "Base of the rotary embedding's frequencies (larger = slower rotation).")
    rope_scaling: str = _f(
        "ntk",
        "How RoPE stretches to a context longer than it was trained at (rope_original_len < seq_len). none, pi (position interpolation), ntk (NTK-aware base) or yarn (moelab.model.layers.rope_frequencies). A long-context phase (data.phase_seq_lens) sets the original length itself. ntk was chosen by the rule registered before benchmarks/rope_scaling.py ran (results/rope_scaling.json: none, ntk and yarn tied).",
        ROPE_SCALINGS,
    )
    rope_original_len: int = _f(
        0,
        "The shorter context RoPE was trained at, in tokens; 0 = seq_len (no scaling). Leave it 0 with "
        "data.phase_seq_lens, which sets it.",
    )
    sliding_window: int = _f(
        0,
        "Tokens a local layer's query attends to (sliding-window attention); 0 = every layer global. At most seq_len.",
    )
    global_every: int = _f(
        4,
        "With a sliding window, every n-th layer (and always the last) is global. The others are local; 0 = only the last layer is global.",
    )
    # experts
    n_routed: int = _f(8, "Routed experts per layer (SwiGLU), of which the router picks top_k per token.")
    top_k: int = _f(2, "Routed experts each token is sent to, at most n_routed.")
    expert_dim: int = _f(64, "Hidden width of each routed expert (SwiGLU).")
    n_shared: int = _f(
        1, "Shared experts per layer, which every token passes through beside its routed ones; 0 = none."
    )
    shared_dim: int = _f(128, "Hidden width of each shared expert (SwiGLU); must be > 0 when n_shared > 0.")
    latent_dim: int = _f(
        0,
        "Width of the routed experts' latent space; 0 = routed experts on the full width. The routed path projects d_model down to it (then RMSNorm), runs the experts there and projects back; router and shared experts stay on the full width. At most d_model.",
    )
    # router
    router: str = _f(
        "softmax",
        "Router scores, in fp32: softmax or sigmoid. softmax: top-k, gates renormalised to sum to 1. sigmoid: top-k on bias-adjusted logits, gates from the unbiased scores renormalised to routed_scale.",
        ROUTERS,
    )
    bias_update: str = _f(
        "none",
        "Balancing bias: quantile, sign or none. The bias is state, never trained: it changes which experts are picked, not the gates, and is computed from each batch for the next step. quantile (Marin): each expert's bias lets a top_k / n_routed fraction of the batch's tokens pick it. sign (DeepSeek-V3): +/- bias_rate by under- or over-load.",
        BIAS_UPDATES,
    )
    bias_rate: float = _f(0.001, "Step of the sign bias update (bias_update sign), added or subtracted each step.")
    routed_scale: float = _f(
        1.0,
        "Sum of a token's routed gates under the sigmoid router (Marin: 2.5). The softmax router's gates always sum to 1.",
    )
    aux_loss_coef: float = _f(
        0.0,
        "Weight of the Switch load-balancing loss in the training loss; 0 = left out. The loss is n_routed x the sum over experts of load share x mean probability, 1.0 when balanced; it is logged either way.",
    )
    router_z_loss_coef: float = _f(
        0.0,
        "Weight of the router z-loss in the training loss; 0 = left out. The loss is the mean over tokens of logsumexp(router logits)^2; it is logged either way.",
    )
    logit_z_loss: float = _f(
        0.0001,
        "Weight of the LM head's logit z-loss in the training loss; 0 = off. The loss is the mean of logsumexp(logits)^2; it keeps the output logits from drifting.",
    )
    # dispatch
    dispatch: str = _f(
        "dropless",
        "How tokens reach their experts in training: dropless, capacity or spill. dropless computes every assignment. capacity gives each expert ceil(capacity_factor x tokens x top_k / n_routed) slots per group and drops the overflow by drop_order. spill is capacity, but an overflowing assignment moves to the token's next-ranked expert with room, trying at most spill_choices.",
        DISPATCHES,
    )
    moe_impl: str = _f(
        "auto",
        "How dropless dispatch computes: ragged, blocks, loop or auto. ragged: jax.lax.ragged_dot (grouped matmuls); blocks: batched expert-pure blocks; loop: over the used blocks only; auto: ragged on GPU and TPU, loop or blocks on CPU by the experts' size.",
        MOE_IMPLS,
    )
    attention_impl: str = _f(
        "auto",
        "Attention path: blocked, flash, xla, cudnn or auto. blocked: moelab's causal query blocks (XLA:CPU's fastest below 2048 tokens); flash: blocks with an online softmax, no [seq, seq] buffer; xla or cudnn: jax.nn.dot_product_attention (cudnn = the fused flash kernel, NVIDIA GPU in bfloat16 or float16 only); auto: cudnn on NVIDIA GPUs in bfloat16, elsewhere blocked below 2048 tokens and flash from there.",
        ATTENTION_IMPLS,
    )
    eval_dispatch: str = _f(
        "",
        'Dispatch outside training (evaluation, sampling); "" = the same as dispatch. It lets a model trained with drops be evaluated dropless.',
        ("",) + DISPATCHES,
    )
    capacity_factor: float = _f(
        1.25,
        "Slots per expert for capacity and spill dispatch, as a multiple of an even share. Each expert gets ceil(capacity_factor x group tokens x top_k / n_routed) slots per capacity group, never more than the group's tokens; the expert-parallel transports use it too. A finite number > 0.",
    )
    drop_order: str = _f(
        "position",
        "Which assignments an over-full expert keeps: position or score. position: the first tokens are served first; score: the highest router scores are kept, the lowest dropped first.",
        DROP_ORDERS,
    )
    capacity_group: int = _f(
        0,
        "Tokens per capacity group (the unit capacity slots are counted over). 0 = each device's tokens (Marin's grouping: the whole batch on one device). Must divide train.batch_size x seq_len (and a micro-batch's tokens).",
    )
    spill_choices: int = _f(
        8,
        "Next-ranked experts an overflowing assignment tries under spill dispatch; 0 = all. The router takes each token's top top_k + spill_choices experts.",
    )
    ep_transport: str = _f(
        "fixed",
        "How tokens travel to their experts' devices under expert parallelism (mesh.expert > 1). fixed: slots per sender and expert; spill: fixed, with overflow moved to next-ranked experts at the sender; pooled_wave: one pool per destination device, sent in ep_waves waves (moelab.parallel.ep).",
        EP_TRANSPORTS,
    )
    ep_waves: int = _f(3, "Waves per exchange of the pooled_wave transport, at least 1.")
    # numerics
    norm_eps: float = _f(1e-6, "Epsilon of the RMS norms, added to the mean square before its square root.")
    compute_dtype: str = _f(
        "auto",
        "Dtype of activations and matmuls: float32, bfloat16 or auto. Parameters, optimizer state, router and norms stay float32. auto: bfloat16 on GPU and TPU (as Marin runs), float32 on CPU (XLA:CPU computes bf16 through fp32, slower); resolved when a run starts, and the run records the dtype it used.",
        DTYPES,
    )
    matmul_precision: str = _f(
        "default",
        "Precision of float32 matmuls: default, high or highest. default lets the hardware round them (TF32 on NVIDIA tensor cores, bf16 passes on TPU); highest keeps true float32. Set at the start of a run; MFU uses the peak of the precision that runs (moelab.train.loop.device_peak).",
        MATMUL_PRECISIONS,
    )
    # memory for large models
    remat: str = _f(
        "none",
        "Rematerialisation, to save activation memory: none, layer or each_layer. layer keeps only the input of each scanned block (a period of the local/global pattern) and recomputes the block in the backward pass; each_layer does the same, and the block's recomputation keeps its layers' inputs and recomputes them one at a time (a block's residuals never live at once; one more forward pass of compute).",
        REMATS,
    )
    scan_layers: str = _f(
        "auto",
        "Layers as a lax.scan over whole local/global periods: scan, unrolled or auto. Scanned, compile time does not grow with depth. auto: scan on an accelerator, or from 12 layers (SCAN_MIN_LAYERS) on CPU, where shallow models step faster unrolled.",
        SCAN_LAYERS,
    )
    ce_chunk: int = _f(
        0,
        "Tokens per chunk of the LM head's cross-entropy; 0 = one chunk. Chunked, the logits are never whole in memory.",
    )

    @property
    def dtype(self) -> str:
        """The compute dtype that runs here: ``compute_dtype``, with auto resolved for this backend."""
        return auto_dtype(None) if self.compute_dtype == "auto" else self.compute_dtype

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads_local(self) -> int:
        return self.n_kv_heads_local or self.n_kv_heads

    @property
    def kv_heads_alloc(self) -> int:
        """k/v heads allocated in every layer (Marin counts the local figure for all layers)."""
        return max(self.n_kv_heads, self.kv_heads_local) if self.sliding_window else self.n_kv_heads

    @property
    def expert_in_dim(self) -> int:
        return self.latent_dim or self.d_model

    def is_global(self, layer: int) -> bool:
        if not self.sliding_window:
            return True
        last = layer == self.n_layers - 1
        return last or (self.global_every > 0 and (layer + 1) % self.global_every == 0)

    def layer_kv_heads(self, layer: int) -> int:
        if not self.sliding_window:
            return self.n_kv_heads
        return self.n_kv_heads if self.is_global(layer) else self.kv_heads_local

    def layer_span(self, layer: int) -> int:
        """Keys a query attends to at most: the window on local layers, the sequence otherwise."""
        return self.seq_len if self.is_global(layer) else min(self.sliding_window, self.seq_len)

    def capacity(self, group_tokens: int) -> int:
        """Slots per expert per group: ceil(CF * T * k / E), and never more than the group's tokens."""
        return min(int(math.ceil(self.capacity_factor * group_tokens * self.top_k / self.n_routed)), group_tokens)

    def check(self) -> list[str]:
        """Problems with the model's own fields, each check beside what it guards: one line each."""
        p = _Problems("model")
        _check_values(self, p)
        _check_heads(self, p)
        _check_sizes(self, p)
        return p.lines


class _Problems:
    """The problems found in one section, one line each; a field is reported once, and a check that
    involves a field already reported is skipped."""

    def __init__(self, section: str):
        self.section = section
        self.lines: list[str] = []
        self.bad: set[str] = set()  # fields already reported

    def fail(self, name: str, msg: str) -> None:
        self.bad.add(name)
        self.lines.append(f"{self.section}.{name}: {msg}")

    def need(self, names: tuple[str, ...], ok, msg: str) -> None:
        """ok: a bool, or a callable evaluated only when none of the fields has already failed."""
        if self.bad.intersection(names):
            return
        if not (ok() if callable(ok) else ok):
            self.fail(names[0], msg)


def _check_values(m: ModelConfig, p: _Problems) -> None:
    """Each field on its own: its range, or its allowed values."""
    for n in (
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "seq_len",
        "n_routed",
        "top_k",
        "expert_dim",
        "norm_eps",
        "rope_theta",
        "routed_scale",
    ):
        p.need((n,), getattr(m, n) > 0, f"must be > 0, got {getattr(m, n)}")
    for n in (
        "n_kv_heads_local",
        "head_dim",
        "sliding_window",
        "global_every",
        "n_shared",
        "shared_dim",
        "latent_dim",
        "capacity_group",
        "spill_choices",
        "aux_loss_coef",
        "router_z_loss_coef",
        "logit_z_loss",
        "bias_rate",
        "ce_chunk",
        "rope_original_len",
    ):
        p.need((n,), getattr(m, n) >= 0, f"must be >= 0, got {getattr(m, n)}")
    for n, allowed in (
        ("router", ROUTERS),
        ("bias_update", BIAS_UPDATES),
        ("dispatch", DISPATCHES),
        ("moe_impl", MOE_IMPLS),
        ("attention_impl", ATTENTION_IMPLS),
        ("scan_layers", SCAN_LAYERS),
        ("drop_order", DROP_ORDERS),
        ("compute_dtype", DTYPES),
        ("matmul_precision", MATMUL_PRECISIONS),
        ("remat", REMATS),
        ("rope_scaling", ROPE_SCALINGS),
        ("eval_dispatch", ("",) + DISPATCHES),
    ):
        p.need((n,), getattr(m, n) in allowed, f"must be one of {', '.join(map(repr, allowed))}, got {getattr(m, n)!r}")
    p.need(
        ("capacity_factor",),
        0 < m.capacity_factor < math.inf,
        f"must be a finite number > 0, got {m.capacity_factor}",
    )
    p.need(("rope_fraction",), 0.0 < m.rope_fraction <= 1.0, f"must be in (0, 1], got {m.rope_fraction}")


def _check_heads(m: ModelConfig, p: _Problems) -> None:
    """Attention heads: how they divide d_model and one another, and what rotary embedding rotates."""
    if m.head_dim == 0:
        p.need(
            ("n_heads", "d_model"),
            lambda: m.d_model % m.n_heads == 0,
            f"{m.n_heads} does not divide model.d_model={m.d_model}; change one or set model.head_dim",
        )
    p.need(
        ("n_kv_heads", "n_heads"),
        lambda: m.n_heads % m.n_kv_heads == 0,
        f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}",
    )
    if m.n_kv_heads_local:
        p.need(
            ("n_kv_heads_local", "n_heads"),
            lambda: m.n_heads % m.n_kv_heads_local == 0,
            f"{m.n_kv_heads_local} does not divide model.n_heads={m.n_heads}",
        )
    if m.sliding_window:
        lo, hi = sorted((m.n_kv_heads, m.kv_heads_local))
        p.need(
            ("n_kv_heads_local", "n_kv_heads", "n_heads"),
            lambda: lo > 0 and hi % lo == 0,
            f"{m.kv_heads_local} and model.n_kv_heads={m.n_kv_heads} must divide one another",
        )
    if not p.bad.intersection(("head_dim", "n_heads", "d_model")):
        p.need(("head_dim",), m.head_size % 2 == 0, f"head size {m.head_size} must be even for rotary embeddings")
        p.need(
            ("rope_fraction", "head_dim"),
            lambda: int(m.head_size * m.rope_fraction) >= 2,
            f"{m.rope_fraction} of head size {m.head_size} rotates no dims; use 0.5 or 1.0",
        )
        p.need(
            ("rope_fraction", "head_dim"),
            lambda: int(m.head_size * m.rope_fraction) % 2 == 0,
            f"{m.rope_fraction} of head size {m.head_size} is not an even number of dims",
        )


def _check_sizes(m: ModelConfig, p: _Problems) -> None:
    """The expert-parallel transport, and sizes bounded by other fields."""
    p.need(
        ("ep_transport",),
        m.ep_transport in EP_TRANSPORTS,
        f"must be fixed, spill or pooled_wave, got {m.ep_transport!r}",
    )
    p.need(("ep_waves",), m.ep_waves >= 1, f"must be >= 1, got {m.ep_waves}")
    p.need(("top_k", "n_routed"), m.top_k <= m.n_routed, f"{m.top_k} is larger than model.n_routed={m.n_routed}")
    p.need(
        ("latent_dim", "d_model"),
        m.latent_dim <= m.d_model,
        f"{m.latent_dim} is larger than model.d_model={m.d_model}",
    )
    p.need(
        ("sliding_window", "seq_len"),
        m.sliding_window <= m.seq_len,
        f"{m.sliding_window} is larger than model.seq_len={m.seq_len}",
    )
    p.need(
        ("rope_original_len", "seq_len"),
        m.rope_original_len <= m.seq_len,
        f"{m.rope_original_len} is longer than model.seq_len={m.seq_len}; it is the shorter context RoPE was trained at",
    )
    p.need(
        ("shared_dim", "n_shared"),
        m.n_shared == 0 or m.shared_dim > 0,
        f"must be > 0 when model.n_shared={m.n_shared}",
    )


def auto_dtype(backend: str | None) -> str:
    """``compute_dtype: auto`` on a backend (None = this process's JAX backend): bfloat16 on GPU and
    TPU, float32 on CPU."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return "float32" if backend == "cpu" else "bfloat16"


def rope_scaling_of(m: ModelConfig) -> tuple[str, float, int]:
    """(kind, factor, original length) of the model's RoPE (moelab.model.layers.rope_frequencies)."""
    if 0 < m.rope_original_len < m.seq_len:
        return m.rope_scaling, m.seq_len / m.rope_original_len, m.rope_original_len
    return "none", 1.0, m.seq_len
