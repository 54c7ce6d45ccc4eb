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

SHAPE_FLAGS = {
    # flag: (config field, type, default)
    "d_model": ("model.d_model", int, 256),
    "layers": ("model.n_layers", int, 4),
    "heads": ("model.n_heads", int, 8),
    "kv_heads": ("model.n_kv_heads", int, 0),  # 0 = heads
    "experts": ("model.n_routed", int, 16),
    "top_k": ("model.top_k", int, 4),
    "expert_dim": ("model.expert_dim", int, 128),
    "shared": ("model.n_shared", int, 1),
    "shared_dim": ("model.shared_dim", int, 256),
    "latent_dim": ("model.latent_dim", int, 0),
    "seq": ("model.seq_len", int, 256),
    "batch": ("train.batch_size", int, 8),
    "vocab": ("model.vocab_size", int, 4096),
    "dispatch": ("model.dispatch", str, "dropless"),
    "capacity_factor": ("model.capacity_factor", float, 1.25),
    "dtype": ("model.compute_dtype", str, "float32"),
}


def shape_config(**shape):
    """The tiny-softmax recipe at the given shape (unknown flags keep SHAPE_FLAGS' defaults)."""
    from moelab.config import load_config

    values = {k: shape.get(k) if shape.get(k) is not None else d for k, (_, _, d) in SHAPE_FLAGS.items()}
    kv = values["kv_heads"] or values["heads"]
    overrides = [f"{field}={values[k]}" for k, (field, _, _) in SHAPE_FLAGS.items() if k != "kv_heads"]
    overrides += [f"model.n_kv_heads={kv}", f"model.n_kv_heads_local={kv}", "model.sliding_window=0",
                  "model.eval_dispatch=dropless", "train.lr=1e-3", "train.steps=1000"]  # fmt: skip
    return load_config("tiny-softmax", overrides)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_train_step(cfg, steps: int = 10, warmup: int = 2, seed: int = 0) -> dict:
    """Time ``steps`` train steps after ``warmup``; the figures of the issue, as one dict."""
    import jax

    from moelab import accounting
    from moelab._alloc import hugepages_on
    from moelab.train import optim
    from moelab.train.record import matmul_peak
    from moelab.train.step import init_train_state, make_train_step

    m = cfg.model
    b, s = cfg.train.batch_size, m.seq_len
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    step_fn = make_train_step(cfg, opt, h)
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, m.vocab_size, (b, s + 1), dtype=np.int32) for _ in range(4)]
    rss_before = peak_rss_bytes()

    t0 = time.perf_counter()
    state, metrics = step_fn(state, batches[0], np.int32(0), np.bool_(False))
    jax.block_until_ready(metrics["loss"])
    first = time.perf_counter() - t0
    for i in range(warmup):
        state, metrics = step_fn(state, batches[(i + 1) % 4], np.int32(i + 1), np.bool_(False))
    jax.block_until_ready(metrics["loss"])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batches[i % 4], np.int32(warmup + 1 + i), np.bool_(False))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    times = np.array(times)
    med = float(np.median(times))
    peak = matmul_peak()
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
        "compile_s": max(first - med, 0.0),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_before_step_bytes": rss_before,
        "params": params,
        "active_params": count.active_params,
        "model_flops_per_token": flops_per_token,
        "achieved_flops_per_s": tps * flops_per_token,
        "matmul_peak_flops_per_s": peak,
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
        "dtype": m.compute_dtype,
    }  # fmt: skip


def print_result(r: dict) -> None:
    from moelab.accounting import human

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
        f"  compile {r['compile_s']:.1f} s; peak resident memory {r['peak_rss_bytes'] / 2**20:,.0f} MiB; "
        f"{r['model_flops_per_token']:.3g} FLOPs per token; {r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s achieved"
    )
    print(
        f"  MFU {r['mfu']:.1%} of the measured fp32 matmul peak ({r['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"{r['backend']}, {r['devices']} device(s){', huge pages' if r.get('hugepages') else ''})"
    )
