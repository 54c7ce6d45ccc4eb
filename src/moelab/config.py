"""One frozen configuration per run: model, train, data and mesh sections.

Built from a preset name, a YAML file, a dict or Python, then ``--set a.b=value`` overrides,
and validated before any compute; every problem is one line that names its field.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from moelab.errors import ConfigError  # noqa: F401 - raised here, importable from here
from moelab.monitor.faults import parse as parse_fault
from moelab.schedule import parse_replans

ROUTERS = ("softmax", "sigmoid")
BIAS_UPDATES = ("none", "quantile", "sign")
DISPATCHES = ("dropless", "capacity", "spill")
MOE_IMPLS = ("auto", "ragged", "blocks", "loop")
ATTENTION_IMPLS = ("auto", "blocked", "flash", "xla", "cudnn")
SCAN_LAYERS = ("auto", "scan", "unrolled")
DROP_ORDERS = ("position", "score")
DTYPES = ("auto", "float32", "bfloat16")
OFFLOADS = ("none", "optimizer", "layer_inputs", "all")
MATMUL_PRECISIONS = ("default", "high", "highest")
REMATS = ("none", "layer", "each_layer")
ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")  # moelab.model.layers.rope_frequencies
EP_TRANSPORTS = ("fixed", "spill", "pooled_wave")  # moelab.parallel.ep
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("linear", "wsd", "constant")

BYTE_LEVEL_BASE = 257  # a byte-level BPE's first tokens: 256 bytes and end-of-text


def _f(default: Any, meaning: str, choices: tuple = ()) -> Any:
    """A config field with its meaning, and its allowed values where they are a fixed set: the one
    source of `moelab config --explain` and the generated reference (``explain``). Metadata enters no
    comparison, no ``to_dict`` and no hash."""
    meta = {"help": meaning, **({"choices": tuple(choices)} if choices else {})}
    return field(default=default, metadata=meta)


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
        m = self
        e: list[str] = []
        bad: set[str] = set()  # fields already reported; checks that involve them are skipped

        def fail(name: str, msg: str) -> None:
            bad.add(name)
            e.append(f"model.{name}: {msg}")

        def need(names: tuple[str, ...], ok, msg: str) -> None:
            """ok: a bool, or a callable evaluated only when none of the fields has already failed."""
            if bad.intersection(names):
                return
            if not (ok() if callable(ok) else ok):
                fail(names[0], msg)

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
            need((n,), getattr(m, n) > 0, f"must be > 0, got {getattr(m, n)}")
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
            need((n,), getattr(m, n) >= 0, f"must be >= 0, got {getattr(m, n)}")
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
            need(
                (n,), getattr(m, n) in allowed, f"must be one of {', '.join(map(repr, allowed))}, got {getattr(m, n)!r}"
            )
        need(
            ("capacity_factor",),
            0 < m.capacity_factor < math.inf,
            f"must be a finite number > 0, got {m.capacity_factor}",
        )
        need(("rope_fraction",), 0.0 < m.rope_fraction <= 1.0, f"must be in (0, 1], got {m.rope_fraction}")

        if m.head_dim == 0:
            need(
                ("n_heads", "d_model"),
                lambda: m.d_model % m.n_heads == 0,
                f"{m.n_heads} does not divide model.d_model={m.d_model}; change one or set model.head_dim",
            )
        need(
            ("n_kv_heads", "n_heads"),
            lambda: m.n_heads % m.n_kv_heads == 0,
            f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}",
        )
        if m.n_kv_heads_local:
            need(
                ("n_kv_heads_local", "n_heads"),
                lambda: m.n_heads % m.n_kv_heads_local == 0,
                f"{m.n_kv_heads_local} does not divide model.n_heads={m.n_heads}",
            )
        if m.sliding_window:
            lo, hi = sorted((m.n_kv_heads, m.kv_heads_local))
            need(
                ("n_kv_heads_local", "n_kv_heads", "n_heads"),
                lambda: lo > 0 and hi % lo == 0,
                f"{m.kv_heads_local} and model.n_kv_heads={m.n_kv_heads} must divide one another",
            )
        if not bad.intersection(("head_dim", "n_heads", "d_model")):
            need(("head_dim",), m.head_size % 2 == 0, f"head size {m.head_size} must be even for rotary embeddings")
            need(
                ("rope_fraction", "head_dim"),
                lambda: int(m.head_size * m.rope_fraction) >= 2,
                f"{m.rope_fraction} of head size {m.head_size} rotates no dims; use 0.5 or 1.0",
            )
            need(
                ("rope_fraction", "head_dim"),
                lambda: int(m.head_size * m.rope_fraction) % 2 == 0,
                f"{m.rope_fraction} of head size {m.head_size} is not an even number of dims",
            )
        need(
            ("ep_transport",),
            m.ep_transport in EP_TRANSPORTS,
            f"must be fixed, spill or pooled_wave, got {m.ep_transport!r}",
        )
        need(("ep_waves",), m.ep_waves >= 1, f"must be >= 1, got {m.ep_waves}")
        need(("top_k", "n_routed"), m.top_k <= m.n_routed, f"{m.top_k} is larger than model.n_routed={m.n_routed}")
        need(
            ("latent_dim", "d_model"),
            m.latent_dim <= m.d_model,
            f"{m.latent_dim} is larger than model.d_model={m.d_model}",
        )
        need(
            ("sliding_window", "seq_len"),
            m.sliding_window <= m.seq_len,
            f"{m.sliding_window} is larger than model.seq_len={m.seq_len}",
        )
        need(
            ("rope_original_len", "seq_len"),
            m.rope_original_len <= m.seq_len,
            f"{m.rope_original_len} is longer than model.seq_len={m.seq_len}; it is the shorter context RoPE was trained at",
        )
        need(
            ("shared_dim", "n_shared"),
            m.n_shared == 0 or m.shared_dim > 0,
            f"must be > 0 when model.n_shared={m.n_shared}",
        )
        return e


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(200, "Optimizer updates in the run (the horizon the learning-rate schedule is planned over).")
    batch_size: int = _f(
        16,
        "Sequences of model.seq_len tokens per step, over all devices. Must split evenly over mesh.data x mesh.expert.",
    )
    seed: int = _f(
        0,
        "Seed of the parameters' initialisation and of the data order, in [0, 2**32). Batches are a function of seed and step.",
    )
    data_seed: int = _f(
        -1,
        "Seed of the data order alone, in [0, 2**32); -1 = train.seed. Changes which batch each step reads and leaves the initialisation as train.seed makes it.",
    )
    optimizer: str = _f(
        "adamw",
        "Optimizer: adamw or muon. adamw: AdamW with decoupled weight decay; muon: Muon for the attention and expert matrices, AdamW for the rest (embeddings, head, router, norms).",
        OPTIMIZERS,
    )
    lr: float | str = _f(
        0.003,
        "Peak learning rate (AdamW's, reached at the end of warmup): a number, or auto. auto is Marin's compute-scaled heuristic, which also sets Adam's beta2 and epsilon from the run's tokens, batch and d_model.",
    )
    lr_scale: float = _f(
        1.0,
        "The peak rate (Adam's and Muon's) times this: a learning-rate sweep around a rule such as auto. A number > 0.",
    )
    warmup_frac: float = _f(0.01, "Fraction of the steps with a linear warmup to the peak rate, in [0, 1).")
    min_lr_ratio: float = _f(
        0.05,
        "Where the decay ends, as a fraction of the peak rate, in [0, 1]. The linear and wsd schedules reach it on the last step.",
    )
    schedule: str = _f(
        "linear",
        "Learning rate after warmup: linear, wsd or constant. linear decays from the peak to min_lr_ratio x peak over the rest of the run; wsd (warmup-stable-decay) holds the peak, then decays linearly over the last decay_frac of the run.",
        SCHEDULES,
    )
    weight_decay: float = _f(
        0.1, "Decoupled weight decay (AdamW and Muon), not applied to the embedding or the norms; >= 0."
    )
    beta1: float = _f(0.9, "Adam's first-moment decay (and Muon's momentum), in [0, 1).")
    beta2: float = _f(0.95, "Adam's second-moment decay, in [0, 1); with lr: auto the heuristic sets it instead.")
    grad_clip: float = _f(1.0, "Clip the gradients' global norm to this before the update; 0 = off.")
    muon_lr_ratio: float = _f(
        13 / 3, "Muon's learning rate over Adam's, with optimizer muon (Marin: 13/3). A number > 0."
    )
    decay_frac: float = _f(0.2, "The last fraction of the run that decays under the wsd schedule, in [0, 1].")
    log_every: int = _f(
        10, "Steps between lines of metrics.jsonl (and the progress line); the last step is always logged."
    )
    eval_every: int = _f(
        0,
        "Steps between held-out evaluations; 0 = every 5% of the run. Step 0 and the last step are always evaluated.",
    )
    eval_tokens: int = _f(8192, "Held-out tokens per domain per evaluation (the same windows every time).")
    checkpoint_every: int = _f(100, "Steps between checkpoints; the last step is always checkpointed.")
    keep_last: int = _f(
        2, "Newest checkpoints kept; older ones are deleted (unless keep_every or keep_steps keeps them)."
    )
    keep_every: int = _f(0, "Also keep every checkpoint at a multiple of this step for good; 0 = none.")
    keep_steps: tuple[int, ...] = _f(
        (), "Also checkpoint at these steps (in 1..steps) and keep them for good. Branch points for later runs."
    )
    nan_patience: int = _f(
        3,
        "Non-finite steps in a row (each skipped) before the run restores its last checkpoint.",
    )
    peak_flops: float = _f(
        0.0,
        "One device's peak FLOP/s in the compute dtype, for MFU. 0 = the published peak of a known accelerator (moelab.devices), or this CPU's measured matmul rate.",
    )
    poison_steps: tuple[int, ...] = _f((), "Testing aid: these steps' loss is made NaN, to exercise the NaN guard.")
    inject: tuple[str, ...] = _f(
        (),
        "Faults to inject, to test the health checks: KIND@STEP[:ARG]. Such as lr_spike@100:10; the kinds are in moelab.monitor.faults.",
    )
    replans: tuple[str, ...] = _f(
        (),
        "Horizon changes, AT:OLD->NEW steps (such as 150:300->450). Written by `moelab replan`; the last must end at steps.",
    )
    forecast_update_every: float = _f(
        0.1,
        "How often a joint-law forecast.json in the run is refit, as a fraction of the run; 0 = never. In [0, 1]; the refits use the run's own evaluations and are recorded beside the registered forecast, never over it.",
    )
    trackers: tuple[str, ...] = _f(
        (),
        "Trackers the metrics are mirrored to: wandb, tensorboard. `moelab train --tracker` adds to them; the run's own files stay the record.",
    )
    tracker_project: str = _f("", 'W&B project; "" = the environment\'s WANDB_PROJECT, else moelab.')
    tracker_entity: str = _f(
        "", "W&B entity (user or team); \"\" = the environment's WANDB_ENTITY, else W&B's default."
    )
    tracker_mode: str = _f(
        "",
        'W&B mode: online, offline or disabled; "" = the environment\'s WANDB_MODE, else offline.',
        ("", "online", "offline", "disabled"),
    )
    micro_batch: int = _f(
        0,
        "Sequences per micro-step (over all devices), for gradient accumulation; 0 = the whole batch. Must divide batch_size; the step runs batch_size / micro_batch micro-steps and one update, and metrics, drops, router balancing and z-losses are the whole batch's (moelab.train.step).",
    )
    offload: str = _f(
        "none",
        "Host offload (memory kind pinned_host): none, optimizer, layer_inputs or all. optimizer: AdamW/Muon state kept in host memory and moved in for the update; layer_inputs: with model.remat, each rematerialised block's (or layer's) input saved to host memory; all: both (Marin's strategy on GB200).",
        OFFLOADS,
    )
    async_checkpoint: bool = _f(
        True, "Save checkpoints in the background while training goes on. false: the step waits for each save."
    )
    checkpoint_dir: str = _f(
        "",
        "Where checkpoints go; \"\" = the run's ckpt/ folder. Else any path Orbax's file layer takes (such as gs://...).",
    )
    task_evals: tuple[str, ...] = _f(
        (),
        "Tasks scored by log-likelihood at every evaluation (moelab.eval.tasks). Built-in names (next_line, brackets, defined_name) or JSON-lines task files.",
    )
    task_eval_examples: int = _f(
        100, "Examples per task at each evaluation in the loop, evenly spread over its file; 0 = all."
    )

    def check(self) -> list[str]:
        """Problems with the training fields: one line each."""
        t = self
        e: list[str] = []
        for n in ("steps", "batch_size", "log_every", "checkpoint_every", "keep_last", "eval_tokens", "nan_patience"):
            if getattr(t, n) <= 0:
                e.append(f"train.{n}: must be > 0, got {getattr(t, n)}")
        if isinstance(t.lr, str):
            if t.lr != "auto":
                e.append(f"train.lr: must be a number or 'auto', got {t.lr!r}")
        elif t.lr <= 0:
            e.append(f"train.lr: must be > 0, got {t.lr}")
        if not (isinstance(t.lr_scale, (int, float)) and t.lr_scale > 0):
            e.append(f"train.lr_scale: must be a number > 0, got {t.lr_scale!r}")
        if t.optimizer not in OPTIMIZERS:
            e.append(f"train.optimizer: must be adamw or muon, got {t.optimizer!r}")
        if t.schedule not in SCHEDULES:
            e.append(f"train.schedule: must be linear, wsd or constant, got {t.schedule!r}")
        if not 0.0 <= t.warmup_frac < 1.0:
            e.append(f"train.warmup_frac: must be in [0, 1), got {t.warmup_frac}")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            e.append(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
        if not 0 <= t.seed < 2**32:
            e.append(f"train.seed: must be in [0, 2**32), got {t.seed}")
        if not (t.data_seed == -1 or 0 <= t.data_seed < 2**32):
            e.append(f"train.data_seed: must be -1 (= train.seed) or in [0, 2**32), got {t.data_seed}")
        for n in ("weight_decay", "grad_clip", "eval_every", "keep_every", "peak_flops"):
            if getattr(t, n) < 0:
                e.append(f"train.{n}: must be >= 0, got {getattr(t, n)}")
        for spec in t.inject:
            try:
                parse_fault(spec)
            except ValueError as exc:
                e.append(f"train.inject: {exc}")
        if t.replans:
            try:
                parse_replans(t.replans, t.steps)
            except ValueError as exc:
                e.append(f"train.replans: {exc}")
        bad = [k for k in t.keep_steps if not (isinstance(k, int) and 0 < k <= t.steps)]
        if bad:
            e.append(f"train.keep_steps: steps to checkpoint must lie in 1..train.steps={t.steps}, got {bad[0]!r}")
        if not 0.0 <= t.decay_frac <= 1.0:
            e.append(f"train.decay_frac: must be in [0, 1], got {t.decay_frac}")
        bad = [x for x in t.trackers if x not in ("wandb", "tensorboard")]
        if bad:
            e.append(f"train.trackers: {', '.join(map(str, bad))} is not a tracker; use wandb or tensorboard")
        if t.tracker_mode not in ("", "online", "offline", "disabled"):
            e.append(f"train.tracker_mode: {t.tracker_mode!r}: use online, offline or disabled (or leave it empty)")
        if not 0.0 <= t.forecast_update_every <= 1.0:
            e.append(
                f"train.forecast_update_every: must be in [0, 1] (a fraction of the run), got {t.forecast_update_every}"
            )
        if t.task_eval_examples < 0:
            e.append(f"train.task_eval_examples: must be >= 0 (0 = every example), got {t.task_eval_examples}")
        if not all(isinstance(x, str) and x.strip() for x in t.task_evals):
            e.append(f"train.task_evals: a list of built-in task names or task files, got {list(t.task_evals)!r}")
        if t.micro_batch < 0:
            e.append(f"train.micro_batch: must be >= 0 (0 = the whole batch), got {t.micro_batch}")
        elif t.micro_batch and t.batch_size > 0 and t.batch_size % t.micro_batch:
            e.append(
                f"train.micro_batch: {t.micro_batch} does not divide train.batch_size={t.batch_size}; "
                "use a divisor (or 0 for the whole batch)"
            )
        if t.offload not in OFFLOADS:
            e.append(f"train.offload: must be one of {', '.join(map(repr, OFFLOADS))}, got {t.offload!r}")
        if t.muon_lr_ratio <= 0:
            e.append(f"train.muon_lr_ratio: must be > 0, got {t.muon_lr_ratio}")
        for n in ("beta1", "beta2"):
            if not 0.0 <= getattr(t, n) < 1.0:
                e.append(f"train.{n}: must be in [0, 1), got {getattr(t, n)}")
        return e


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[str, ...] | dict[str, tuple[str, ...]] = _f(
        ("stdlib",),
        "What to train on: a list of sources, or a mapping of domain names to lists of paths. A source is 'stdlib', 'cheaders', a path or glob (a file, a folder, '/data/**/*.parquet') or 'name=path-or-glob' (entries with one name make one domain); see moelab.data.sources. Text, JSON lines, parquet and arrow, any compression.",
    )
    tokenizer: str = _f(
        "",
        'A tokenizer.json, or a folder holding one (a transformers model folder). "" = train a byte-level BPE of model.vocab_size tokens on the sources.',
    )
    text_field: str | dict[str, str] = _f(
        "text",
        "The field of JSON-lines, parquet and arrow records that holds the text. Or a mapping of domain names to fields.",
    )
    validation: tuple[str, ...] | dict[str, tuple[str, ...]] = _f(
        (),
        "Sources never trained on, evaluated beside the held-out split (the same forms as sources).",
    )
    bad_records: str = _f(
        "refuse",
        "What a bad shard, line or row does: refuse (stops the build) or skip (left out and counted).",
        ("refuse", "skip"),
    )
    workers: int = _f(
        0, "Processes that tokenize the shards; 0 = every core. The token store's bytes do not depend on it."
    )
    backend: str = _f(
        "local",
        "Where the shards are tokenized: local or ray. local: processes here; ray: one Ray task per unit of shards.",
        ("local", "ray"),
    )
    include: tuple[str, ...] = _f(
        (), "Folder sources: globs of the files to read; empty = every text file. Such as ['*.py', 'lib/**']."
    )
    exclude: tuple[str, ...] = _f((), "Folder sources: globs of the files to leave out.")
    held_out_fraction: float = _f(
        0.02,
        "Share of each domain's documents held out for evaluation, in [0, 1); 0 = none. A document is held out by a stable hash of its domain and name; a domain of few documents is split by position.",
    )
    max_bytes_per_domain: int = _f(
        0, "Bytes of text per domain: past this no more documents are added; 0 = every document."
    )
    mixture: tuple[dict[str, float], ...] = _f(
        (),
        "Domain weights, one mapping per phase; empty = each domain in proportion to its tokens. A single mapping applies to every phase; weights >= 0 with a positive sum.",
    )
    phase_starts: tuple[float, ...] = _f(
        (0.0, 0.8),
        "Where each phase of the mixture starts, as fractions of the run: 0.0 first, rising, below 1.0.",
    )
    phase_seq_lens: tuple[int, ...] = _f(
        (),
        "The sequence length of each phase: a long-context phase. Empty = model.seq_len throughout; one value = every phase. The longest must equal model.seq_len and lengths must not fall. The batch's tokens are held (train.batch_size counts sequences of model.seq_len), so a shorter phase holds more sequences; RoPE is scaled by length / the first length in a longer phase (model.rope_scaling), and the model samples and exports at the last.",
    )
    epoch_cap: float = _f(4.0, "Most passes over any domain's training tokens that the mixture may need; > 0.")
    epoch_cap_action: str = _f(
        "refuse",
        "What a mixture past epoch_cap does: refuse (the run stops before training) or warn.",
        ("refuse", "warn"),
    )

    def check(self) -> list[str]:
        """Problems with the data fields: one line each."""
        d = self
        e: list[str] = []
        for name in ("sources", "validation"):
            given = getattr(d, name)
            entries = [x for v in given.values() for x in v] if isinstance(given, dict) else list(given)
            if isinstance(given, dict) and any(not str(k).strip() or not v for k, v in given.items()):
                e.append(f"data.{name}: every domain needs a name and at least one path, got {dict(given)!r}")
            elif any(not str(x).strip() for x in entries):
                e.append(
                    f"data.{name}: an empty source (an unset shell variable?) in {list(entries)!r}; "
                    "name a file, a folder, a glob or 'stdlib'"
                )
        if not d.sources:
            e.append("data.sources: name at least one source (a path or 'stdlib')")
        if isinstance(d.text_field, dict) and not all(str(v).strip() for v in d.text_field.values()):
            e.append(f"data.text_field: every domain's field must be named, got {dict(d.text_field)!r}")
        if d.bad_records not in ("refuse", "skip"):
            e.append(f"data.bad_records: must be refuse or skip, got {d.bad_records!r}")
        if d.workers < 0:
            e.append(f"data.workers: must be >= 0 (0 = every core), got {d.workers}")
        if d.backend not in ("local", "ray"):
            e.append(f"data.backend: must be local or ray, got {d.backend!r}")
        for name in ("include", "exclude"):
            globs = getattr(d, name)
            if not all(isinstance(g, str) and g.strip() for g in globs):
                e.append(f"data.{name}: a list of file globs such as ['*.pl', 'lib/**'], got {list(globs)!r}")
        if isinstance(d.text_field, str) and not d.text_field.strip():
            e.append("data.text_field: must name the field that holds a document's text (default 'text')")
        if not 0.0 <= d.held_out_fraction < 1.0:
            e.append(f"data.held_out_fraction: must be in [0, 1), got {d.held_out_fraction}")
        if d.max_bytes_per_domain < 0:
            e.append(f"data.max_bytes_per_domain: must be >= 0, got {d.max_bytes_per_domain}")
        starts = list(d.phase_starts)
        if (
            not starts
            or starts[0] != 0.0
            or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
            or starts[-1] >= 1.0
        ):
            e.append(f"data.phase_starts: must start at 0.0 and rise below 1.0, got {starts}")
        if len(d.mixture) not in (0, 1, len(starts)):
            e.append(
                f"data.mixture: {len(d.mixture)} phases of weights for {len(starts)} data.phase_starts; give 1 or {len(starts)}"
            )
        for i, weights in enumerate(d.mixture):
            if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
                e.append(f"data.mixture[{i}]: weights must be >= 0 with a positive sum, got {weights}")
        if d.epoch_cap <= 0:
            e.append(f"data.epoch_cap: must be > 0, got {d.epoch_cap}")
        if d.epoch_cap_action not in ("refuse", "warn"):
            e.append(f"data.epoch_cap_action: must be refuse or warn, got {d.epoch_cap_action!r}")
        return e


@dataclass(frozen=True)
class MeshConfig:
    data: int = _f(1, "Devices along the mesh's data axis: each holds a share of the batch's sequences.")
    expert: int = _f(
        1,
        "Devices along the mesh's expert axis (expert parallelism). Each holds n_routed / expert routed experts and a share of the batch; must divide model.n_routed. mesh.data x mesh.expert = the devices a run uses.",
    )
    fsdp: bool = _f(
        True,
        "Shard parameters, gradients and optimizer state over the data axis too (ZeRO-3). Experts are also sharded over the expert axis; false = replicated over data.",
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(
        default_factory=ModelConfig,
        metadata={"help": "The network: its shape, attention, experts, router, dispatch, numerics and memory options."},
    )
    train: TrainConfig = field(
        default_factory=TrainConfig,
        metadata={
            "help": "The run: steps and batch, optimizer and learning-rate schedule, evaluation, checkpoints, "
            "trackers and memory placement."
        },
    )
    data: DataConfig = field(
        default_factory=DataConfig,
        metadata={
            "help": "What the model reads: sources and domains, the tokenizer, the held-out split, the mixture and "
            "its phases."
        },
    )
    mesh: MeshConfig = field(
        default_factory=MeshConfig,
        metadata={"help": "How the run spreads over devices: the data and expert axes, and FSDP sharding."},
    )
    name: str = _f(
        "", "A label for the config, shown by commands such as flops. A preset sets its own name; a file may set one."
    )

    def check_vocab(self) -> list[str]:
        """A tokenizer trained here is byte-level: its 256 bytes and the end-of-text token come first."""
        v = self.model.vocab_size
        if not self.data.tokenizer and 0 < v < BYTE_LEVEL_BASE:
            return [
                f"model.vocab_size: {v} is below the {BYTE_LEVEL_BASE} tokens a byte-level tokenizer starts "
                f"with (256 bytes and end-of-text); use {BYTE_LEVEL_BASE} or more"
            ]
        return []

    def check_mesh(self) -> list[str]:
        """Problems with the mesh, against the model and the batch (across sections): one line each."""
        cfg = self
        e: list[str] = []
        for n in ("data", "expert"):
            if getattr(cfg.mesh, n) <= 0:
                e.append(f"mesh.{n}: must be > 0, got {getattr(cfg.mesh, n)}")
        group, tokens = cfg.model.capacity_group, cfg.train.batch_size * cfg.model.seq_len
        if group > 0 and tokens > 0 and tokens % group:
            e.append(
                f"model.capacity_group: {group} does not divide the batch's {tokens} tokens "
                f"(train.batch_size x model.seq_len); use a divisor such as model.seq_len"
            )
        shards = cfg.mesh.data * cfg.mesh.expert
        mesh_ok = (
            cfg.mesh.expert > 0
            and cfg.mesh.data > 0
            and not (cfg.model.n_routed > 0 and cfg.model.n_routed % cfg.mesh.expert)
        )
        if mesh_ok and cfg.train.batch_size > 0 and cfg.train.batch_size % shards:
            e.append(
                f"train.batch_size: {cfg.train.batch_size} sequences do not split over mesh.data x mesh.expert = "
                f"{shards} devices; use a multiple of {shards}"
            )
        if cfg.train.offload in ("layer_inputs", "all") and cfg.model.remat == "none":
            e.append(
                f"train.offload: {cfg.train.offload} keeps each rematerialised block's input in host memory; "
                "set model.remat=layer or each_layer (or train.offload=optimizer)"
            )
        mb = cfg.train.micro_batch
        if mesh_ok and mb > 0 and cfg.train.batch_size % max(mb, 1) == 0 and mb % shards:
            e.append(
                f"train.micro_batch: {mb} sequences do not split over mesh.data x mesh.expert = {shards} devices; "
                f"use a multiple of {shards}"
            )
        if group > 0 and mb > 0 and (mb * cfg.model.seq_len) % group:
            e.append(
                f"model.capacity_group: {group} does not divide a micro-batch's {mb * cfg.model.seq_len} tokens "
                f"(train.micro_batch x model.seq_len); capacity groups are formed within a micro-batch"
            )
        if cfg.mesh.expert > 0 and cfg.model.n_routed > 0 and cfg.model.n_routed % cfg.mesh.expert:
            e.append(f"mesh.expert: {cfg.mesh.expert} does not divide model.n_routed={cfg.model.n_routed}")
        if cfg.mesh.expert > 1:
            e.extend(cfg._check_ep())
        return e

    def check_context(self) -> list[str]:
        """data.phase_seq_lens against the phases and model.seq_len: one line each."""
        lens, m = list(self.data.phase_seq_lens), self.model
        phases = len(self.data.phase_starts)
        if not lens or m.seq_len <= 0:
            return []
        where = f"data.phase_seq_lens: {lens}"
        if len(lens) not in (1, phases):
            return [f"{where}: give 1 length or one per phase ({phases} data.phase_starts)"]
        if any(x <= 0 for x in lens):
            return [f"{where}: every length must be > 0"]
        if any(b < a for a, b in zip(lens, lens[1:], strict=False)):
            return [f"{where}: lengths must not fall from phase to phase (a long-context phase comes late)"]
        if max(lens) != m.seq_len:
            return [
                f"{where}: the longest must equal model.seq_len={m.seq_len} (the model's context); set one or the other"
            ]
        if bad := [x for x in lens if m.seq_len % x or x % lens[0]]:
            return [
                f"{where}: {bad[0]} must divide model.seq_len={m.seq_len} and be a multiple of the first length {lens[0]}"
            ]
        if m.rope_original_len:
            return [f"model.rope_original_len: {m.rope_original_len} with {where}: the phases set it; leave it 0"]
        return []

    def _check_ep(self) -> list[str]:
        """Under expert parallelism the transport does the dispatch: a setting it would not honour is refused."""
        cfg = self
        m, e = cfg.model, []
        allowed = {"dropless": ("fixed",), "capacity": ("fixed", "pooled_wave"), "spill": ("spill",)}.get(
            m.dispatch, ()
        )
        if allowed and m.ep_transport not in allowed:
            why = {
                "dropless": "dropless exchanges every assignment; the transport matters to capacity and spill only",
                "capacity": "the spill transport would move overflow to next-ranked experts: set model.dispatch=spill",
                "spill": "only the spill transport spills; set model.ep_transport=spill",
            }[m.dispatch]
            e.append(
                f"model.ep_transport: {m.ep_transport} with model.dispatch={m.dispatch} under expert parallelism: {why}"
            )
        shards = cfg.mesh.data * cfg.mesh.expert
        per_device = cfg.train.batch_size * m.seq_len // shards if shards > 0 else 0
        if m.capacity_group not in (0, per_device):
            e.append(
                f"model.capacity_group: under expert parallelism each device's {per_device} tokens are one capacity "
                f"group; set 0 (or {per_device})"
            )
        if m.drop_order == "score" and m.ep_transport == "pooled_wave":
            e.append(
                "model.drop_order: pooled_wave fills receivers round-robin, not by score; use position, or fixed/spill"
            )
        return e


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "mesh": MeshConfig}


# ---------------------------------------------------------------- meanings (`moelab config --explain`, the reference)


def type_label(tp: Any, plural: bool = False) -> str:
    """A field's type as a YAML or JSON writer sees it: integer, number, boolean, string, list of ..."""
    if tp in (int, float, bool, str):
        return {int: "integer", float: "number", bool: "boolean", str: "string"}[tp] + ("s" if plural else "")
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list{'s' if plural else ''} of {type_label(typing.get_args(tp)[0], plural=True)}"
    if origin is dict:
        return f"mapping{'s' if plural else ''} of names to {type_label(typing.get_args(tp)[1], plural=True)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_label(a, plural) for a in typing.get_args(tp))
    return str(tp)


def show_value(value: Any) -> str:
    """A field's value as it is written in a JSON (or YAML flow) config: "ntk", 128, [], true."""
    return json.dumps(value, default=list)


def field_paths() -> list[str]:
    """Every config field by its dotted name, in the order of the classes: model.d_model, ..., name."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)] + ["name"]


def summary(meaning: str) -> str:
    """A meaning's first sentence: the one line a section's listing shows."""
    head = re.split(r"(?<=[.?!])\s+", meaning.strip(), maxsplit=1)[0]
    return head if head.endswith((".", "?", "!")) else head + "."


def explain(path: str) -> dict:
    """What a config field means, from the field itself: ``{name, type, default, help}`` and ``choices``
    where the values are a fixed set. A section name (``model``) gives ``{name, help, fields}``, its
    fields each explained. An unknown name is a ConfigError of one line naming the nearest names."""
    path = path.strip()
    top = {f.name: f for f in fields(Config)}
    if path in SECTIONS:
        return {
            "name": path,
            "help": top[path].metadata["help"],
            "fields": [explain(f"{path}.{f.name}") for f in fields(SECTIONS[path])],
        }
    section, _, key = path.rpartition(".")
    cls = SECTIONS.get(section) if section else Config
    found = {f.name: f for f in fields(cls)}.get(key) if cls is not None else None
    if found is None or (cls is Config and key in SECTIONS):
        raise ConfigError([_unknown_field(path)])
    tp = typing.get_type_hints(cls)[key]
    out = {"name": path, "type": type_label(tp), "default": found.default, "help": found.metadata.get("help", "")}
    if "choices" in found.metadata:
        out["choices"] = found.metadata["choices"]
    return out


def _unknown_field(path: str) -> str:
    names = field_paths()
    near = difflib.get_close_matches(path, names + list(SECTIONS), n=3, cutoff=0.75)
    last = path.rpartition(".")[2]  # top_k, or a misspelt key in the wrong section: its full names
    by_key: dict[str, list[str]] = {}
    for n in names:
        by_key.setdefault(n.rpartition(".")[2], []).append(n)
    for key in difflib.get_close_matches(last, list(by_key), n=3, cutoff=0.75):
        near += by_key[key]
    near = list(dict.fromkeys(near))[:4]
    section = path.partition(".")[0]
    if near:
        hint = f"did you mean {', '.join(near)}?"
    elif section in SECTIONS:
        hint = f"`moelab config --explain {section}` lists its fields"
    else:
        hint = f"the sections are {', '.join(SECTIONS)} (and the top-level name)"
    return f"{path}: no such config field; {hint}"


# ---------------------------------------------------------------- building from plain data


def _type_name(tp: Any) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list, each item {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        inner = typing.get_args(tp)[1]
        return "a mapping of names to " + {float: "numbers", str: "strings"}.get(inner, "lists of strings")
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return str(tp)


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, value converted to tp). Ints widen to floats; nothing else is guessed."""
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _NUMBER.match(value.strip()):  # YAML 1.1 reads 1e11 as a string
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    origin = typing.get_origin(tp)
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            return False, value
        out = []
        for v in value:
            ok, v2 = _coerce(v, inner)
            if not ok:
                return False, value
            out.append(v2)
        return True, tuple(out)
    if origin is dict:
        _, inner = typing.get_args(tp)
        if not isinstance(value, dict):
            return False, value
        conv = {}
        for k, v in value.items():
            ok, v2 = _coerce(v, inner)
            if not ok or not isinstance(k, str):
                return False, value
            conv[k] = v2
        return True, conv
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v2 = _coerce(value, arg)
            if ok:
                return True, v2
        return False, value
    raise TypeError(f"unsupported config field type {tp}")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def config_from_dict(data: dict, *, source: str = "config") -> Config:
    """Build and validate a Config from nested plain data; raise ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping of sections, got {_describe(data)}"])
    sections: dict[str, Any] = {}
    for key in data:
        if key not in SECTIONS and key != "name":
            errors.append(f"{key}: unknown key in {source} (known: name, {', '.join(SECTIONS)})")
    for name, cls in SECTIONS.items():
        raw = data.get(name, {}) or {}
        if not isinstance(raw, dict):
            errors.append(f"{name}: expected a mapping, got {_describe(raw)}")
            continue
        hints = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key not in known:
                errors.append(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
                continue
            ok, conv = _coerce(value, hints[key])
            if not ok:
                errors.append(f"{name}.{key}: expected {_type_name(hints[key])}, got {_describe(value)}")
                continue
            kwargs[key] = conv
        sections[name] = cls(**kwargs)
    cfg_name = data.get("name", "")
    if not isinstance(cfg_name, str):
        errors.append(f"name: expected a string, got {_describe(cfg_name)}")
        cfg_name = ""
    if errors:
        raise ConfigError(errors)
    cfg = Config(**sections, name=cfg_name)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    out = dataclasses.asdict(cfg)
    for key in ("sources", "validation", "mixture", "phase_starts"):
        value = out["data"][key]
        out["data"][key] = {k: list(v) for k, v in value.items()} if isinstance(value, dict) else list(value)
    return out


# fields added after runs were recorded: at these values they leave a config's hash as it was
HASH_NEUTRAL = {
    ("mesh", "fsdp"): True,
    ("model", "moe_impl"): "auto",
    ("train", "keep_steps"): (),
    ("train", "lr_scale"): 1.0,
    ("train", "data_seed"): -1,  # the data order follows train.seed, as before the field existed
    ("train", "trackers"): (),  # where the metrics are mirrored changes nothing the run computes
    ("train", "tracker_project"): "",
    ("train", "tracker_entity"): "",
    ("train", "tracker_mode"): "",
    ("model", "matmul_precision"): "default",  # what JAX did before the field existed
    ("data", "validation"): [],  # evaluated, never trained on: what a run computes otherwise is unchanged
    ("data", "bad_records"): "refuse",
    ("data", "workers"): 0,  # the token store's bytes are the same whatever the workers
    ("data", "backend"): "local",
    ("train", "micro_batch"): 0,
    ("train", "offload"): "none",  # where the state lives changes no number (tested equal)
    ("train", "async_checkpoint"): True,
    ("train", "checkpoint_dir"): "",
    ("data", "phase_seq_lens"): [],
    ("model", "rope_scaling"): "ntk",  # no effect without a longer context than RoPE's original
    ("model", "rope_original_len"): 0,
}  # spill_choices changes what spill does: it is hashed
# of those, the fields added after the lab's step identities were recorded (moelab.lab.steps): at their
# neutral value they leave out of a step's identity too, so a finished step is still found
LAB_NEUTRAL = {("train", "data_seed")}
# fields never hashed: what is evaluated beside the loss changes nothing a run trains
NEVER_HASHED = {("train", "task_evals"), ("train", "task_eval_examples")}


def step_dict(cfg: Config) -> dict:
    """``cfg`` as a lab step's identity holds it: ``to_dict`` without the LAB_NEUTRAL fields at their
    neutral values."""
    return _without_neutral(to_dict(cfg), LAB_NEUTRAL)


def _without_neutral(data: dict, keys) -> dict:
    """``data`` (a config's dict) without the HASH_NEUTRAL ``keys`` that hold their neutral value."""
    for section, key in keys:
        if data.get(section, {}).get(key, HASH_NEUTRAL[(section, key)]) == HASH_NEUTRAL[(section, key)]:
            data.get(section, {}).pop(key, None)
    return data


def data_seed(cfg: Config) -> int:
    """The seed of ``cfg``'s data order: ``train.data_seed``, or ``train.seed`` where it is -1."""
    return cfg.train.seed if cfg.train.data_seed == -1 else cfg.train.data_seed


def auto_dtype(backend: str | None) -> str:
    """``compute_dtype: auto`` on a backend (None = this process's JAX backend): bfloat16 on GPU and
    TPU, float32 on CPU."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    return "float32" if backend == "cpu" else "bfloat16"


def resolve_dtype(cfg: Config, backend: str | None = None) -> Config:
    """``cfg`` with ``compute_dtype: auto`` replaced by what runs on ``backend`` (None = here): a run
    records, hashes and checkpoints the dtype it computed in."""
    if cfg.model.compute_dtype != "auto":
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=auto_dtype(backend)))


def config_hash(cfg: Config) -> str:
    data = _without_neutral(to_dict(cfg), HASH_NEUTRAL)
    for section, key in NEVER_HASHED:
        data.get(section, {}).pop(key, None)
    blob = json.dumps(data, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError([f"--set {item}: expected section.key=value, for example model.d_model=256"])
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(
            [f"--set {key}: expected section.key, for example model.top_k (or deeper: data.text_field.web)"]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        (section, *keys), value = parse_override(item)
        if section not in SECTIONS:
            raise ConfigError([f"{section}.{keys[0]}: unknown section {section!r} (known: {', '.join(SECTIONS)})"])
        node = data.setdefault(section, {})
        for depth, key in enumerate(keys[:-1]):  # a field that is a mapping, set one key deep (or deeper)
            inner = node.setdefault(key, {})
            if not isinstance(inner, dict):
                where = ".".join([section, *keys[: depth + 1]])
                raise ConfigError([f"--set {item.split('=', 1)[0]}: {where} is not a mapping; set it whole"])
            node = inner
        node[keys[-1]] = value
    return data


def load_config(spec: str | Path | dict | Config, overrides: Sequence[str] = ()) -> Config:
    """A preset name, a YAML or JSON file, a dict or a Config, then ``section.key=value`` overrides.

    A file may be what `moelab config` prints (its ``hash`` is checked against the fields) or a run's
    own config.json (``{"hash", "config"}``), and a YAML file may start from a preset or another file
    (``base: tiny``), its sections laid over the base's field by field, at any depth."""
    if isinstance(spec, Config):
        data, source = to_dict(spec), "config"
    elif isinstance(spec, dict):
        data, source = spec, "config"
    else:
        data, source = _read_spec(str(spec), ())
    data, expect = _unwrap(data)
    if expect is not None:  # the hash printed with the config: the fields must still be the ones it hashed
        got = config_hash(config_from_dict(data, source=source))
        if got != expect:
            raise ConfigError([f"{source}: hash {expect} is not its fields' ({got}): the config was edited after it "
                               "was printed; delete the hash line to keep the edit"])  # fmt: skip
    return config_from_dict(apply_overrides(data, overrides), source=source)


def _unwrap(data):
    """(the config's sections, the hash given with them or None): a run's config.json holds
    ``{"hash", "config"}``; `moelab config` prints the hash beside the sections."""
    if not isinstance(data, dict):
        return data, None
    if "config" in data and isinstance(data["config"], dict) and set(data) <= {"hash", "config"}:
        return data["config"], data.get("hash")
    if "hash" in data:
        rest = {k: v for k, v in data.items() if k != "hash"}
        return rest, data["hash"]
    return data, None


def _read_spec(spec: str, seen: tuple) -> tuple[dict, str]:
    """The plain data of a preset or a config file, its ``base`` (a preset or another file, relative
    to this one) resolved; ``seen``: the files above it, so a chain that loops is refused."""
    from moelab.presets import PRESETS, preset_dict

    if spec in PRESETS:
        return preset_dict(spec), f"preset {spec}"
    if not (spec.endswith((".yaml", ".yml", ".json")) or Path(spec).exists()):
        raise ConfigError([f"{spec}: not a preset ({', '.join(PRESETS)}) and not a YAML file"])
    path = Path(spec)
    if path.is_dir():
        raise ConfigError([f"{spec}: is a directory; give a config file (YAML) or a preset"])
    if not path.is_file():
        raise ConfigError([f"{spec}: no such config file (or preset: {', '.join(PRESETS)})"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{spec}: not UTF-8 text (byte {exc.start}); save the config as UTF-8"]) from None
    except OSError as exc:
        raise ConfigError([f"{spec}: cannot read ({exc.strerror or exc})"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{spec}:{where} is not valid YAML; fix the syntax"]) from None
    if not isinstance(data, dict) or "base" not in data:
        return data, spec
    base = data["base"]
    if not isinstance(base, str) or not base.strip():
        raise ConfigError([f"{spec}: base: a preset name or a config file to start from, got {_describe(base)}"])
    here = str(path.resolve())
    if here in seen:
        raise ConfigError([f"{spec}: base: the chain of bases comes back to {path.name}; break the loop"])
    if base not in PRESETS and not Path(base).is_absolute():
        base = str(path.parent / base)
    below, _ = _read_spec(base, (*seen, here))
    below, _ = _unwrap(below)
    return _lay_over(below, {k: v for k, v in data.items() if k != "base"}), spec


def _lay_over(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merged key by key at every depth, anything else replaced."""
    out = json.loads(json.dumps(base))
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _lay_over(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- validation


def validate(cfg: Config) -> Config:
    errors = cfg.model.check() + cfg.train.check() + cfg.data.check() + cfg.check_mesh() + cfg.check_context()
    if errors:
        raise ConfigError(errors)
    return cfg


def phase_seq_lens(cfg: Config) -> tuple[int, ...]:
    """The sequence length of each phase of the run (data.phase_seq_lens, one per data.phase_starts)."""
    lens = tuple(cfg.data.phase_seq_lens) or (cfg.model.seq_len,)
    return lens * len(cfg.data.phase_starts) if len(lens) == 1 else lens


def phase_config(cfg: Config, phase: int) -> Config:
    """The config a phase's steps run: model.seq_len the phase's length, RoPE scaled from the first
    phase's length when longer (model.rope_original_len), and train.batch_size (and micro_batch) the
    sequences that hold the batch's tokens (train.batch_size x model.seq_len) at that length."""
    lens = phase_seq_lens(cfg)
    length, first = lens[phase], lens[0]
    if length == cfg.model.seq_len and first == length:
        return cfg
    per = cfg.model.seq_len // length
    t = dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size * per, micro_batch=cfg.train.micro_batch * per)
    m = dataclasses.replace(cfg.model, seq_len=length, rope_original_len=first if length > first else 0)
    # a config of its own (it validates): one length throughout, RoPE's original length set
    return dataclasses.replace(cfg, model=m, train=t, data=dataclasses.replace(cfg.data, phase_seq_lens=()))


def final_model(cfg: Config) -> ModelConfig:
    """The model as trained at the end of the run (the last phase's context and RoPE): what sampling,
    task evaluations and the export use."""
    return phase_config(cfg, len(phase_seq_lens(cfg)) - 1).model


def rope_scaling_of(m: ModelConfig) -> tuple[str, float, int]:
    """(kind, factor, original length) of the model's RoPE (moelab.model.layers.rope_frequencies)."""
    if 0 < m.rope_original_len < m.seq_len:
        return m.rope_scaling, m.seq_len / m.rope_original_len, m.rope_original_len
    return "none", 1.0, m.seq_len


def replace(cfg: Config, **sections: dict) -> Config:
    """A validated copy with some fields changed: ``replace(cfg, model={"top_k": 4})``."""
    data = to_dict(cfg)
    for name, changes in sections.items():
        if name == "name":
            data["name"] = changes
        else:
            data[name].update(changes)
    return config_from_dict(data)
