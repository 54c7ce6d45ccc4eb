"""Per-device memory of a train step on a ``data`` x ``expert`` mesh, planned from the config; checked
against the compiler by ``moelab.plan.memory_check``.

Rows, in bytes per device (``plan``):

- ``parameters``: fp32 master weights under the rules table (``parallel/mesh.py``), with the
  router-bias state; ``optimizer``: the optimiser's state (AdamW's two moments; Muon's momentum
  with AdamW's moments for the rest) under the same rules; ``gradients``: fp32, as the parameters.
  These three come from the state's abstract shapes (``jax.eval_shape``): exact.
- ``gathered weights``: what the step holds of weights beyond their shards: the compute-dtype copy
  of the parameters (when that is not fp32), each layer's weights whole over ``data`` under FSDP
  (every layer's without ``remat``, whose matmuls keep them for the backward pass; one
  rematerialised block's with it), and the largest of them, or of the embedding and head, as an
  fp32 gradient before its reduce-scatter.
- ``activations``: what the backward pass keeps, traced from the model itself: JAX's residuals of
  each layer at this micro-batch (the arguments excluded), abstract shapes only. With
  ``model.remat: layer`` the saved block inputs plus one recomputed block's residuals.
- ``all-to-all buffers`` (expert parallel): send and receive buffers of one MoE layer's dispatch
  and return, ``E * C`` rows each (``C`` the per-sender slots of ``parallel/ep.py``).
- ``logits and loss``: the head's residuals and its [tokens or ``ce_chunk``, vocab] fp32
  logits and their gradient.
- ``workspace margin``: ``MARGIN`` of the rest, for XLA's scratch space and fragmentation. The
  compiler check compares the plan without it.

Token-major rows are per device: the micro-batch is ``--micro-batch`` sequences on each device
(default ``train.batch_size / devices``). moelab has no gradient accumulation yet, so a
micro-batch below that is a smaller global batch.
"""

from __future__ import annotations

import math
import sys

from moelab import devices
from moelab.cache import remember, remembered
from moelab.config import Config, load_config, phase_config, phase_seq_lens, resolve_dtype, to_dict
from moelab.errors import RunRefused, UsageError
from moelab.model.transformer import (
    CUDNN_DTYPES,
    FLASH_MIN_SEQ,
    FP32_PARAMS,
    attention_impl,
    param_shapes,
    scan_blocks,
)
from moelab.parallel import mesh as pmesh
from moelab.parallel.ep import round_rows, slots_per_expert
from moelab.plan.residuals import (  # noqa: F401 - importable from here
    global_dispatch,
    head_residuals,
    itemsize,
    layer_inputs,
    layer_residuals,
    moe_residuals,
    on_host,
    residual_bytes,
    residuals,
    traced_model,
)
from moelab.progress import phase
from moelab.train import optim
from moelab.train.step import init_train_state

MARGIN = 0.10  # XLA's workspace and fragmentation, reserved on top of what the plan counts
FIXED_ROWS = ("parameters", "optimizer", "gradients", "gradient_accumulator", "router_statistics",
              "optimizer_in_flight", "gathered_weights")  # fmt: skip
HOST_INPUTS = "saved_inputs"  # the per-micro-batch row that lives in host memory under train.offload
GB = 1e9
ROWS = FIXED_ROWS + ("activations", "all_to_all", "logits_and_loss", "inputs")  # device rows


def abstract_state(cfg: Config):
    """(optimiser, the train state's abstract shapes): nothing is allocated."""
    import jax

    opt = optim.make_optimizer(cfg, optim.hyper(cfg))
    return opt, jax.eval_shape(lambda: init_train_state(cfg, opt))


def tree_bytes(tree, sizes: dict[str, int], fsdp: bool) -> int:
    """Bytes one device holds of a tree placed by the rules table (``parallel.mesh.axes_for``)."""
    import jax

    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "shape"):
            continue
        axes = pmesh.axes_for(pmesh._leaf_name(path), tuple(leaf.shape), sizes, fsdp)
        total += math.prod(leaf.shape) * itemsize(leaf.dtype) // pmesh.shards_of(axes, sizes)
    return total


def remat_blocks(m) -> tuple[int, int, int]:
    """How ``model.remat: layer`` runs (model/transformer.py): (layers per scanned block, scanned
    layers, layers rematerialised one by one)."""

    period, n_full = scan_blocks(m)
    return period, n_full, m.n_layers - n_full


def _kinds(m) -> dict[tuple, list[int]]:
    """Layers grouped by what changes their activations: (global?, kv heads)."""
    out: dict[tuple, list[int]] = {}
    for i in range(m.n_layers):
        out.setdefault((m.is_global(i), m.layer_kv_heads(i)), []).append(i)
    return out


def _layer_weight_bytes(cfg: Config, sizes: dict[str, int]) -> tuple[int, int]:
    """(one layer's weights whole over ``data`` in the compute dtype, as fp32) on one device."""
    import jax.numpy as jnp

    m = cfg.model
    compute = fp32 = 0
    for name, shape in param_shapes(m)["layers"].items():  # placed for compute: experts over `expert` only
        n = math.prod(shape[1:]) // pmesh.shards_of(pmesh.axes_for(name, shape[1:], sizes, False), sizes)
        compute += n * (4 if name in FP32_PARAMS else jnp.dtype(m.dtype).itemsize)
        fp32 += n * 4
    return compute, fp32


def _per_micro_batch(cfg: Config, sizes: dict[str, int], fsdp: bool, b: int) -> dict[str, int]:
    """The rows that grow with the micro-batch ``b`` (sequences per device)."""
    import jax.numpy as jnp

    m = cfg.model
    dt = jnp.dtype(m.dtype).itemsize
    tokens = b * m.seq_len
    res = {kind: layer_residuals(cfg, sizes["expert"], b, layers[0]) for kind, layers in _kinds(m).items()}
    n_dev = sizes["data"] * sizes["expert"]
    if global_dispatch(cfg, n_dev, sizes["expert"], b):  # the MoE block's buffers for the whole batch
        extra = moe_residuals(cfg, b * n_dev) - moe_residuals(cfg, b)
        res = {kind: r + extra for kind, r in res.items()}
    per_layer = [res[(m.is_global(i), m.layer_kv_heads(i))] for i in range(m.n_layers)]
    saved = 0
    if m.remat == "layer":
        period, n_full, single = remat_blocks(m)
        saved = (n_full // period + single) * tokens * m.d_model * dt  # each block's input
        block = max(sum(per_layer[j : j + period]) for j in range(0, max(n_full, 1), period)) if n_full else 0
        recomputed = max(block, max(per_layer))
    elif m.remat == "each_layer":
        # each period's input kept, as with layer; its recomputation keeps its layers' inputs and
        # recomputes them one at a time
        period, n_full, single = remat_blocks(m)
        saved = (n_full // period + single) * tokens * m.d_model * dt
        saved += (period if n_full else 1) * tokens * m.d_model * dt
        recomputed = max(per_layer)
    else:
        recomputed = sum(per_layer)
    host = cfg.train.offload in ("layer_inputs", "all") and m.remat != "none"
    activations = recomputed + (0 if host else saved)
    a2a = 0
    if sizes["expert"] > 1:
        if m.dispatch == "dropless":  # one round's buffers: D * B <= t*k rows
            rows = sizes["expert"] * round_rows(tokens, m.top_k, sizes["expert"])
        else:
            rows = m.n_routed * slots_per_expert(m.capacity_factor, tokens, m.top_k, m.n_routed)
        a2a = 4 * rows * m.expert_in_dim * dt  # dispatch send + receive, return send + receive
    chunk = m.ce_chunk if 0 < m.ce_chunk < tokens else tokens
    logits = head_residuals(cfg, b) + (2 if chunk < tokens else 1) * chunk * m.vocab_size * 4
    return {
        "activations": activations,
        "all_to_all": a2a,
        "logits_and_loss": logits,
        "inputs": b * (m.seq_len + 1) * 4,
        HOST_INPUTS: saved if host else 0,
    }


def for_target(cfg: Config, dev) -> tuple[Config, str]:
    """``cfg`` as the target device runs it, and how its attention is counted: ``compute_dtype: auto``
    resolved for the device (bf16 on a GPU or TPU, else this machine's), and on a GPU the fused cuDNN
    kernel that ``attention_impl: auto`` picks in bf16 traced as moelab's flash path, its stand-in here
    (cuDNN cannot be traced on a CPU): both keep q, k, v, the output and the softmax statistics for
    the backward pass, no [s, s] probabilities."""

    backend = None if dev is None else ("tpu" if dev.name.startswith("TPU") else "gpu")
    cfg = resolve_dtype(cfg, backend)
    m = cfg.model
    fused = m.attention_impl == "cudnn" or (backend == "gpu" and m.attention_impl == "auto" and m.dtype in CUDNN_DTYPES)
    if fused:
        return load_config(cfg, ["model.attention_impl=flash"]), "fused (cuDNN), counted as moelab's flash path"
    if backend is None:
        return cfg, attention_impl(m, m.seq_len)
    return cfg, m.attention_impl if m.attention_impl != "auto" else (
        "flash" if m.seq_len >= FLASH_MIN_SEQ else "blocked"
    )


def _fixed(cfg: Config, state, sizes: dict[str, int], fsdp: bool, whole: int, n_micro: int) -> tuple[dict, dict]:
    """The rows that do not grow with the micro-batch: (device rows, host rows)."""
    m, t = cfg.model, cfg.train
    off_opt = t.offload in ("optimizer", "all")
    opt = tree_bytes(state["opt_state"], sizes, fsdp)
    grads = tree_bytes(state["params"], sizes, fsdp)
    device = {
        "parameters": tree_bytes({"params": state["params"], "model_state": state["model_state"]}, sizes, fsdp),
        "optimizer": 0 if off_opt else opt,
        "gradients": grads,
        # the micro-steps' running sum beside each micro-step's own gradients
        "gradient_accumulator": grads if n_micro > 1 else 0,
        # the quantile bias update reads every micro-batch's margins [tokens, experts] of every layer
        "router_statistics": (
            whole * m.seq_len * m.n_routed * 4 * m.n_layers
            if n_micro > 1 and m.bias_update == "quantile" and m.n_routed
            else 0
        ),  # fmt: skip
        # offloaded: moved in and out for the update leaf by leaf (XLA streams the copies), so about the
        # largest leaf's state twice (in and updated) is on the device at once
        "optimizer_in_flight": 2 * max(tree_bytes(leaf, sizes, fsdp) for leaf in _named_leaves(state["opt_state"]))
        if off_opt
        else 0,
        "gathered_weights": _gathered(cfg, state, sizes, fsdp),
    }
    host = {"optimizer": opt if off_opt else 0}
    return device, host


def _named_leaves(tree) -> list[dict]:
    """Each array leaf of ``tree`` as a one-leaf tree keeping its path (so the rules place it)."""
    import jax

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape"):
            out.append({pmesh._leaf_name(path): leaf})
    return out or [{}]


UPDATE_ONLY = "optimizer_in_flight"  # alive only during the update, after the backward pass's buffers are freed
STEP_ONLY = ("gathered_weights", "activations", "all_to_all", "logits_and_loss", "router_statistics")


def counted_bytes(rows: dict) -> int:
    """The device's peak from its rows: what lives through the whole step, plus the larger of the
    forward/backward pass's buffers and the update's offloaded optimizer state moved in."""
    rows = {k: v for k, v in rows.items() if k != HOST_INPUTS}
    step = sum(rows.get(k, 0) for k in STEP_ONLY)
    always = sum(v for k, v in rows.items() if k not in STEP_ONLY and k != UPDATE_ONLY)
    return always + max(step, rows.get(UPDATE_ONLY, 0))


def plan(
    cfg: Config,
    data: int,
    expert: int,
    *,
    micro_batch: int | None = None,
    device: str | None = None,
    device_memory_gb: float | None = None,
    host_memory_gb: float | None = None,
    fsdp: bool | None = None,
    max_micro_batch: bool = True,
) -> dict:
    """The per-device memory plan of ``cfg``'s train step on a ``data`` x ``expert`` mesh, as the
    target device runs it (``for_target``): device and host memory apart, with gradient
    accumulation (``train.micro_batch``, or ``micro_batch`` sequences per device) and host offload
    (``train.offload``) counted. A run with a long-context phase (data.phase_seq_lens) is planned
    phase by phase (each its length, its sequences; ``micro_batch`` counts sequences of
    model.seq_len): the plan of the phase that needs the most device memory, and ``phases``."""
    # long (123 lines): the plan's terms, one after another, each named where it is added; split, they would share two dozen values
    lens = phase_seq_lens(cfg)
    if len(set(lens)) > 1:
        kw = dict(device=device, device_memory_gb=device_memory_gb, host_memory_gb=host_memory_gb, fsdp=fsdp,
                  max_micro_batch=max_micro_batch)  # fmt: skip
        plans = []
        for p, length in enumerate(lens):
            if length in lens[:p]:
                continue
            per = cfg.model.seq_len // length
            plans.append(plan(phase_config(cfg, p), data, expert, micro_batch=micro_batch and micro_batch * per, **kw))
        out = dict(max(plans, key=lambda x: x["total"]))
        out["phases"] = [{k: x[k] for k in ("seq_len", "micro_batch", "total", "host_total", "fits")} for x in plans]
        return out
    m = cfg.model
    if data < 1 or expert < 1:
        raise UsageError(f"--mesh: data and expert must be >= 1, got data={data}, expert={expert}")
    if m.n_routed % expert:
        raise UsageError(f"--mesh: expert={expert} does not divide model.n_routed={m.n_routed}")
    n_dev = data * expert
    if cfg.train.batch_size % n_dev:
        if micro_batch is None:
            raise UsageError(
                f"--mesh: train.batch_size={cfg.train.batch_size} does not split over {n_dev} devices; "
                f"give --micro-batch (sequences per device)"
            )
        whole = micro_batch
    else:
        whole = cfg.train.batch_size // n_dev
    if micro_batch is None:
        mb = cfg.train.micro_batch
        micro_batch = mb // n_dev if mb and mb % n_dev == 0 else whole
    if micro_batch < 1:
        raise UsageError(f"--micro-batch: must be >= 1, got {micro_batch}")
    whole = max(whole, micro_batch)
    n_micro = max(1, whole // micro_batch)
    fsdp = cfg.mesh.fsdp if fsdp is None else fsdp
    dev = None
    if device is not None:
        dev = devices.lookup(device)
        if dev is None:
            raise UsageError(
                f"--device: unknown {device!r}; one of {', '.join(devices.DEVICES)}, or --device-memory GB"
            )
    cfg, attention = for_target(cfg, dev)
    m = cfg.model
    memory = device_memory_gb if device_memory_gb is not None else (dev.memory_gb if dev else None)
    host_memory = host_memory_gb if host_memory_gb is not None else (dev.host_gb if dev else None)
    sizes = {"data": data, "expert": expert}
    _, state = abstract_state(cfg)
    fixed, host = _fixed(cfg, state, sizes, fsdp, whole, n_micro)
    per = _per_micro_batch(cfg, sizes, fsdp, micro_batch)
    host["saved_inputs"] = per.pop(HOST_INPUTS)
    rows = {**fixed, **per}
    counted = counted_bytes(rows)
    margin = int(MARGIN * counted)
    total = counted + margin
    host_total = sum(host.values())
    fits_device = None if memory is None else total <= memory * GB
    fits_host = None if host_memory is None or not host_total else host_total <= host_memory * GB
    out = {
        "config": cfg.name,
        "mesh": {"data": data, "expert": expert, "devices": n_dev, "fsdp": fsdp},
        "compute_dtype": m.dtype,
        "attention": attention,
        "micro_batch": micro_batch,
        "micro_batches": n_micro,
        "tokens_per_device": micro_batch * m.seq_len,
        "seq_len": m.seq_len,
        "remat": m.remat,
        "offload": cfg.train.offload,
        "rows": rows,
        "workspace_margin": margin,
        "counted": counted,
        "total": total,
        "host_rows": host,
        "host_total": host_total,
        "device": dev.name if dev else None,
        "device_memory": None if memory is None else int(memory * GB),
        "host_memory": None if host_memory is None else int(host_memory * GB),
        "host_note": (
            devices.HOST_NOTES.get(dev.name)
            if dev and host_memory_gb is None
            else None
            if host_memory is None
            else "given (--host-memory)"
        ),  # fmt: skip
        "fits_device": fits_device,
        "fits_host": fits_host,
        "fits": None if memory is None else bool(fits_device and fits_host is not False),
    }
    acts = {}
    for remat in ("none", "layer", "each_layer"):
        over = [f"model.remat={remat}"]
        if remat == "none" and cfg.train.offload in ("layer_inputs", "all"):
            over.append("train.offload=" + ("optimizer" if cfg.train.offload == "all" else "none"))
        acts[remat] = rows["activations"] if remat == m.remat else (
            _per_micro_batch(load_config(cfg, over), sizes, fsdp, micro_batch)["activations"])  # fmt: skip
    out["activations_by_remat"] = acts
    out["whole_over_data"] = whole_over(state["params"], sizes, fsdp, "data")
    if memory is not None:
        out["accumulation"] = None if fits_device else _accumulation(cfg, state, sizes, fsdp, whole, memory * GB)
    if memory is not None and max_micro_batch:
        out["max_micro_batch"] = largest_micro_batch(cfg, sizes, fsdp, fixed, memory * GB)
    return out


def _accumulation(cfg: Config, state, sizes: dict[str, int], fsdp: bool, whole: int, memory: float) -> dict | None:
    """The fewest micro-batches (a divisor of a device's ``whole`` sequences) whose step fits:
    ``{micro_batches, micro_batch (per device), train.micro_batch (over all devices)}``, or None."""
    n_dev = sizes["data"] * sizes["expert"]
    for n in range(2, whole + 1):
        if whole % n:
            continue
        fixed, _ = _fixed(cfg, state, sizes, fsdp, whole, n)
        b = whole // n
        if counted_bytes({**fixed, **_per_micro_batch(cfg, sizes, fsdp, b)}) * (1 + MARGIN) <= memory:
            return {"micro_batches": n, "micro_batch": b, "train.micro_batch": b * n_dev}
    return None


def whole_over(params, sizes: dict[str, int], fsdp: bool, axis: str) -> list[str]:
    """Parameters FSDP would shard over ``axis`` that stay whole there, because the axis divides
    none of their dimensions (JAX shardings leave no remainder)."""
    import jax

    if not fsdp or sizes.get(axis, 1) <= 1:
        return []
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = pmesh._leaf_name(path)
        names = pmesh.LOGICAL.get(name, ())
        wants = any(axis in axes for n in names for axes in pmesh.RULES.get(n, ()) if n != "experts")
        axes = pmesh.axes_for(name, tuple(leaf.shape), sizes, fsdp)
        flat = {a for x in axes if x is not None for a in ((x,) if isinstance(x, str) else x)}
        if wants and axis not in flat:
            out.append(name)
    return out


def _gathered(cfg: Config, state, sizes: dict[str, int], fsdp: bool) -> int:
    import jax.numpy as jnp

    m = cfg.model
    dt = jnp.dtype(m.dtype).itemsize
    params = state["params"]
    copy = 0
    if dt != 4:  # the compute-dtype copy of the (sharded) parameters, made once per step
        copy = tree_bytes(params, sizes, fsdp) * dt // 4
    if not (fsdp and sizes["data"] * sizes["expert"] > 1):
        return copy
    compute, fp32 = _layer_weight_bytes(cfg, sizes)
    if m.remat == "layer":
        period, n_full, _ = remat_blocks(m)
        live = (period if n_full else 1) * compute
    elif m.remat == "each_layer":
        live = compute
    else:
        live = m.n_layers * compute
    embed = tree_bytes({"embed": params["embed"]}, sizes, False)  # its fp32 gradient, whole
    return copy + live + max(fp32, embed)


def largest_micro_batch(cfg: Config, sizes: dict[str, int], fsdp: bool, fixed: dict[str, int], memory: float) -> int:
    """The most sequences per device whose plan (with its margin) fits in ``memory`` bytes; 0 if none."""

    def total(b: int) -> float:
        return counted_bytes({**fixed, **_per_micro_batch(cfg, sizes, fsdp, b)}) * (1 + MARGIN)

    if total(1) > memory:
        return 0
    slope = max(total(2) - total(1), 1.0)
    b = max(1, int((memory - total(1)) // slope) + 1)
    while b > 1 and total(b) > memory:  # capacity rounding can make the line a little optimistic
        b -= 1
    while total(b + 1) <= memory:
        b += 1
    return b


def fit_check(cfg: Config) -> None:
    """Refuse, in one line, a run whose plan cannot fit the devices it will run on (before anything
    is written): on an accelerator each device's memory (the table in moelab.devices, else what JAX
    reports); on CPU the machine's memory, shared by every simulated device. The line gives the
    plan's figure and the largest micro-batch that fits. ``MOELAB_NO_FIT_CHECK=1`` skips it."""
    import os

    import jax  # noqa: F401 - (loaded already by a run; an import is start-up, not the check)

    if os.environ.get("MOELAB_NO_FIT_CHECK"):
        return
    phase("fit check")
    try:
        _fit_check(cfg)
    finally:
        phase("start-up")  # (MOELAB_TIMING=1: the imports of the training modules that follow count as start-up)


def _fit_check(cfg: Config) -> None:
    import jax

    data, expert = cfg.mesh.data, cfg.mesh.expert
    n_dev = data * expert
    if n_dev > jax.device_count() or cfg.model.n_routed % expert or cfg.train.batch_size % n_dev:
        return  # the mesh check that follows names these
    dev = jax.devices()[0]
    if jax.default_backend() == "cpu":
        import psutil

        memory = psutil.virtual_memory().total / n_dev  # the simulated devices share this machine's memory
        total_gb = psutil.virtual_memory().total / GB
        where = (f"this machine holds {total_gb:,.1f} GB" if n_dev == 1
                 else f"this machine's {total_gb:,.1f} GB shared by {n_dev} simulated devices is {memory / GB:,.1f} GB each")  # fmt: skip
    else:
        known = devices.of_kind(dev.device_kind)
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        limit = (stats or {}).get("bytes_limit")
        memory = limit if limit else (known.memory_gb * GB if known else None)
        if memory is None:
            return
        where = f"a {dev.device_kind} holds {memory / GB:,.1f} GB"
    # a plan that fits is remembered (for this config, memory, code and machine): the command run again
    # does not trace the model for it again (a second of a short run's start on 2 cores)
    key = {"config": to_dict(cfg), "memory": memory}
    if remembered("fit_check", key):
        return
    try:
        p = plan(cfg, data, expert, device_memory_gb=memory / GB, max_micro_batch=False)
    except Exception as exc:  # a config the plan cannot trace here (cudnn on CPU): the run's own checks name it
        print(f"memory plan: not checked ({type(exc).__name__}: {str(exc)[:160]}); the run goes on", file=sys.stderr)
        return
    if p["fits"]:
        remember("fit_check", key, True)
        return
    sizes = {"data": data, "expert": expert}
    fixed = {k: p["rows"][k] for k in FIXED_ROWS}
    best = largest_micro_batch(cfg, sizes, p["mesh"]["fsdp"], fixed, memory)
    what = (
        f"at most {best} sequences per device fit: train.batch_size {best * n_dev} or less"
        if best
        else "not even one sequence per device fits: the parameters, gradients and optimizer state alone need "
        f"{sum(fixed.values()) / GB:,.1f} GB; shrink the model or spread it over more devices (mesh.expert, mesh.fsdp)"
    )
    raise RunRefused(
        f"memory: the plan needs {p['total'] / GB:,.1f} GB per device ({p['micro_batch']} sequences of "
        f"{cfg.model.seq_len} tokens) and {where}; {what} "
        "(moelab plan memory; MOELAB_NO_FIT_CHECK=1 to try anyway)"
    )
