"""Forward + backward time of one MoE block under each dispatch, side by side in one process.

Prints a table and writes benchmarks/results/moe_dispatch.json. Ratios are against `capacity`
measured in the same run; absolute times on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp

from moelab.config import load_config
from moelab.model.moe import moe_block
from moelab.model.transformer import init_params

RESULTS = Path(__file__).parent / "results"


def time_fn(fn, *args, repeats: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    cfg = load_config(
        "tiny",
        [
            "model.n_layers=1",
            "model.d_model=256",
            "model.n_routed=16",
            "model.top_k=4",
            "model.expert_dim=128",
            "model.latent_dim=0",
            "model.shared_dim=256",
            "model.capacity_factor=1.25",
        ],
    )
    m = cfg.model
    layer = jax.tree.map(lambda a: a[0], init_params(m, jax.random.PRNGKey(0))["layers"])
    x = jax.random.normal(jax.random.PRNGKey(1), (args.tokens // 256, 256, m.d_model))
    bias = jnp.zeros(m.n_routed)
    rows = {}
    for name in ("capacity", "spill", "dropless", "dropless-ragged"):
        dispatch = name.split("-")[0]
        # the ragged_dot reference path, which the CPU default replaces (model.moe_impl)
        mm = dataclasses.replace(m, dispatch=dispatch, moe_impl="ragged" if name.endswith("ragged") else "auto")

        def loss(p, x, mm=mm, dispatch=dispatch):
            y, metrics, _ = moe_block(p, x, bias, mm, dispatch)
            return jnp.sum(y * y), metrics["dropped_frac"]

        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        median, compile_s = time_fn(fn, layer, x, repeats=args.repeats)
        (_, dropped), _ = fn(layer, x)
        rows[name] = {
            "step_s": median,
            "compile_s": compile_s,
            "dropped_frac": float(dropped),
            "tokens_per_s": args.tokens / median,
        }
    base = rows["capacity"]["step_s"]
    print(
        f"MoE block fwd+bwd, {args.tokens} tokens, d={m.d_model}, {m.n_routed} experts top-{m.top_k}, "
        f"width {m.expert_dim}, CF {m.capacity_factor}, {jax.device_count()} {jax.devices()[0].platform} device"
    )
    print(f"{'dispatch':<16} {'median ms':>10} {'vs capacity':>12} {'tokens/s':>10} {'compile s':>10} {'dropped':>8}")
    for name, r in rows.items():
        print(
            f"{name:<16} {r['step_s'] * 1e3:>10.2f} {r['step_s'] / base:>11.2f}x {r['tokens_per_s']:>10.0f}"
            f" {r['compile_s']:>10.2f} {r['dropped_frac']:>8.4f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {jax.devices()[0].platform}",
        "cpu_count": __import__("os").cpu_count(),
        "tokens": args.tokens,
        "results": rows,
    }
    (RESULTS / "moe_dispatch.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
