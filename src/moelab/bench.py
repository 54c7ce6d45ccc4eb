"""`moelab bench train-step`: the train step's throughput, compile time, memory and MFU for a shape.

The shape is given by flags (d_model, layers, heads, experts, ...) on top of the ``tiny-softmax``
recipe (softmax top-k router with an aux loss, dropless, full attention, no latent path: the
closest to Hugging Face's Qwen2-MoE). The step is the training step itself (forward, backward,
AdamW update, donated state). MFU is against the best fp32 square matmul measured in the same
process, so both figures share the machine's state.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from moelab import accounting, devices
from moelab._alloc import hugepages_on
from moelab.accounting import human
from moelab.cache import matmul_peak
from moelab.config import load_config
from moelab.presets import DEFAULT_PRESET, SHAPE_FLAGS  # noqa: F401 - importable from here
from moelab.train import optim
from moelab.train.step import init_train_state, make_train_step


def shape_config(preset: str | None = None, **shape):
    """A model to time: the tiny-softmax recipe at SHAPE_FLAGS' defaults (reference shape A), changed
    by the given flags; or another preset as it is, changed only by the flags given."""

    preset = preset or DEFAULT_PRESET
    given = {k: v for k, v in shape.items() if v is not None}
    if preset == DEFAULT_PRESET:
        values = {k: given.get(k, d) for k, (_, _, d) in SHAPE_FLAGS.items()}
        values["kv_heads"] = values["kv_heads"] or values["heads"]
        extra = ["model.n_kv_heads_local=0", "model.sliding_window=0", "model.eval_dispatch=dropless",
                 "train.lr=1e-3", "train.steps=1000"]  # fmt: skip
    else:
        values, extra = given, []
    overrides = [f"{SHAPE_FLAGS[k][0]}={v}" for k, v in values.items() if k != "kv_heads"]
    if values.get("kv_heads"):
        overrides.append(f"model.n_kv_heads={values['kv_heads']}")
    return load_config(preset, overrides + extra)


def current_rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> bool:
    """Start Linux's peak-RSS count (VmHWM) afresh, so compiling is not counted with stepping."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_train_step(cfg, steps: int = 10, warmup: int = 2, seed: int = 0) -> dict:
    """Time ``steps`` train steps after ``warmup``; the figures of the issue, as one dict."""
    # long (85 lines): one measurement in order (build, warm up, time, read memory and MFU): split, its steps would pass a dozen values between them
    import jax

    m = cfg.model
    b, s = cfg.train.batch_size, m.seq_len
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    step_fn = make_train_step(cfg, opt, h)
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, m.vocab_size, (b, s + 1), dtype=np.int32) for _ in range(4)]
    rss_base = current_rss_bytes()  # JAX and the state, before compiling
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    args = (np.int32(0),)

    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batches[0], *args).compile()
    compile_s = time.perf_counter() - t0
    peak_compile = peak_rss_bytes()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    rss_before_steps = current_rss_bytes()
    separate = reset_peak_rss()
    state, metrics = compiled(state, batches[0], *args)
    for i in range(warmup):
        state, metrics = compiled(state, batches[(i + 1) % 4], np.int32(i + 1))
    jax.block_until_ready(metrics["loss"])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i % 4], np.int32(warmup + 1 + i))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    times = np.array(times)
    steps_peak = peak_rss_since_reset() if separate else peak_rss_bytes()
    med = float(np.median(times))

    kind = jax.devices()[0].device_kind
    published = None if jax.default_backend() == "cpu" else devices.peak_flops(kind, cfg.model.dtype)
    peak = published or matmul_peak(dtype=cfg.model.dtype)  # an accelerator's published peak, else measured
    count = accounting.count(cfg)
    flops_per_token = 3 * count.forward_flops_per_token
    tps = b * s / med
    params = count.total_params
    return {
        "shape": {k: v for k, v in _shape_of(cfg).items()},
        "tokens_per_step": b * s,
        "steps_timed": steps,
        "tokens_per_s": tps,
        "step_time_median_s": med,
        "step_time_p10_s": float(np.percentile(times, 10)),
        "step_time_p90_s": float(np.percentile(times, 90)),
        "step_time_spread": float((np.percentile(times, 90) - np.percentile(times, 10)) / med),
        "compile_s": compile_s,
        # memory: the estimate is the state (parameters, optimiser, router biases; exact) plus XLA's
        # temporary buffer for the compiled step (the activations kept for the backward pass, gradients,
        # scratch). Against it: the state plus what the steps added to resident memory above the
        # compiled process. What compiling leaves resident (the program, the compiler's freed heap) is
        # reported apart.
        "state_bytes": state_bytes,
        "xla_temp_bytes": temp_bytes,
        "memory_estimate_bytes": state_bytes + temp_bytes,
        "rss_before_compile_bytes": rss_base,
        "rss_before_steps_bytes": rss_before_steps,
        "compile_resident_bytes": rss_before_steps - rss_base,
        "peak_rss_compile_bytes": peak_compile,
        "peak_rss_steps_bytes": steps_peak,
        "peak_rss_bytes": peak_rss_bytes(),
        "steps_memory_bytes": steps_peak - rss_before_steps + state_bytes,
        "memory_ratio": (steps_peak - rss_before_steps + state_bytes) / (state_bytes + temp_bytes),
        "params": params,
        "active_params": count.active_params,
        "model_flops_per_token": flops_per_token,
        "achieved_flops_per_s": tps * flops_per_token,
        "matmul_peak_flops_per_s": peak,
        "peak_source": "published" if published else "measured",
        "device_kind": kind,
        "compute_dtype": cfg.model.dtype,
        "mfu": tps * flops_per_token / peak,
        "final_loss": float(metrics["loss"]),
        "backend": jax.default_backend(),
        "hugepages": hugepages_on(),
        "devices": jax.device_count(),
    }


def _shape_of(cfg) -> dict:
    m, t = cfg.model, cfg.train
    return {
        "d_model": m.d_model, "layers": m.n_layers, "heads": m.n_heads, "kv_heads": m.n_kv_heads,
        "experts": m.n_routed, "top_k": m.top_k, "expert_dim": m.expert_dim, "shared": m.n_shared,
        "shared_dim": m.shared_dim, "latent_dim": m.latent_dim, "seq": m.seq_len, "batch": t.batch_size,
        "vocab": m.vocab_size, "dispatch": m.dispatch, "capacity_factor": m.capacity_factor,
        "dtype": m.dtype, "remat": m.remat, "ce_chunk": m.ce_chunk,
    }  # fmt: skip


def print_result(r: dict) -> None:

    sh = r["shape"]
    print(
        f"train step: d_model {sh['d_model']}, {sh['layers']} layers, {sh['heads']} heads, {sh['experts']} experts "
        f"top-{sh['top_k']} of width {sh['expert_dim']}, {sh['shared']} shared of width {sh['shared_dim']}, "
        f"seq {sh['seq']} x batch {sh['batch']}, vocab {sh['vocab']}, {sh['dispatch']}, {sh['dtype']} "
        f"({human(r['params'])} parameters, {human(r['active_params'])} active)"
    )
    print(
        f"  {r['tokens_per_s']:,.0f} tokens/s; step {1000 * r['step_time_median_s']:.1f} ms median "
        f"(p10-p90 {1000 * r['step_time_p10_s']:.1f}-{1000 * r['step_time_p90_s']:.1f} ms over {r['steps_timed']} steps)"
    )
    print(
        f"  compile {r['compile_s']:.1f} s; {r['model_flops_per_token']:.3g} FLOPs per token; "
        f"{r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s achieved"
    )
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(
        f"  memory: estimate {mib(r['memory_estimate_bytes'])} (state {mib(r['state_bytes'])} + XLA step buffer "
        f"{mib(r['xla_temp_bytes'])}); the steps held {mib(r['steps_memory_bytes'])} ({r['memory_ratio']:.2f}x); "
        f"compiling left {mib(r['compile_resident_bytes'])} resident; process peak {mib(r['peak_rss_bytes'])}"
    )
    print(
        f"  MFU {r['mfu']:.1%} of the measured {r.get('compute_dtype', 'float32')} matmul peak ({r['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"{r['backend']}, {r['devices']} device(s){', huge pages' if r.get('hugepages') else ''})"
    )
