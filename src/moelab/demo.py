"""`make demo`: Marin's hero and ladder as moelab counts them, then the tiny MoE on stdlib text.

The tiny part runs one forward and backward pass with its per-layer MoE metrics, then a few
AdamW steps on byte-level batches of the standard library's source, so the router biases move.
"""

from __future__ import annotations

import json
import sysconfig
import time
from importlib import resources
from pathlib import Path

import numpy as np

from moelab import accounting
from moelab.config import load_config
from moelab.presets import MARIN_LADDER


def marin_reference() -> dict:
    return json.loads(resources.files("moelab").joinpath("reference/marin_hero.json").read_text())


def accounting_rows() -> list[dict]:
    """moelab's counts for the hero and each rung beside Marin's published figures."""
    ref = marin_reference()
    hero = ref["hero"]["expected"]
    published = {
        "marin-535b-a23b": (
            hero["total_params"],
            hero["active_params"],
            hero["train_flops_with_lm_head"],
            hero["train_flops_without_lm_head"],
        ),
    }
    for rung in ref["ladder"]:
        published[f"marin-ladder-{rung['name']}"] = (
            rung["expected_total"],
            rung["expected_active"],
            rung["expected_train_flops_with_lm_head"],
            rung["expected_train_flops_without_lm_head"],
        )
    rows = []
    for name in ("marin-535b-a23b",) + MARIN_LADDER:
        cfg = load_config(name)
        out = accounting.count(cfg).train(accounting.run_tokens(cfg))
        ours = (out["total_params"], out["active_params"], out["train_flops"], out["train_flops_without_lm_head"])
        rows.append({"name": name, "tokens": out["tokens"], "ours": ours, "marin": published[name]})
    return rows


def print_accounting() -> None:
    print("Marin's 535B-A23B and its ladder, counted by moelab (Marin's published figure in brackets)\n")
    head = f"{'config':<20} {'tokens':>9} {'total params':>20} {'active params':>20} {'train FLOPs':>22} {'w/o LM head':>22}"
    print(head)
    print("-" * len(head))
    h = accounting.human
    rows = accounting_rows()
    for r in rows:
        o, m = r["ours"], r["marin"]
        print(
            f"{r['name']:<20} {r['tokens']:>9.3g} {h(o[0]) + ' [' + h(m[0]) + ']':>20} {h(o[1]) + ' [' + h(m[1]) + ']':>20}"
            f" {f'{o[2]:.3g} [{m[2]:.3g}]':>22} {f'{o[3]:.3g} [{m[3]:.3g}]':>22}"
        )
    worst = max(abs(o / m - 1) for r in rows for o, m in zip(r["ours"], r["marin"], strict=True))
    print(f"\nlargest relative difference from Marin's figures: {worst:.3%}\n")


def stdlib_bytes(n_bytes: int) -> np.ndarray:
    """The first n_bytes of the standard library's .py files, in sorted path order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:n_bytes], dtype=np.uint8)


def print_layer_table(layers: dict) -> None:
    cols = ("dropped_frac", "spilled_frac", "max_mean_load", "router_entropy", "router_z", "bias_mean", "bias_std")
    print(f"  {'layer':<6}" + "".join(f"{c:>15}" for c in cols))
    for i in range(len(layers["dropped_frac"])):
        print(f"  {i:<6}" + "".join(f"{float(layers[c][i]):>15.4f}" for c in cols))


def run_demo(steps: int = 40) -> int:
    import jax
    import jax.numpy as jnp
    import optax

    from moelab.model import count_params, init_params, init_state, loss_fn

    print_accounting()

    cfg = load_config("tiny")
    m = cfg.model
    a = accounting.count(cfg)
    params = init_params(m, jax.random.PRNGKey(cfg.train.seed))
    state = init_state(m)
    print(
        f"tiny preset: {count_params(params):,} parameters ({a.active_params:,} active, Marin's definition), "
        f"{m.n_routed} routed experts top-{m.top_k}, {m.n_shared} shared, latent {m.latent_dim}, "
        f"window {m.sliding_window} with every {m.global_every}nd layer global, {m.router} router, "
        f"{m.bias_update} bias, dispatch {m.dispatch} (CF {m.capacity_factor})"
    )
    b, s = cfg.train.batch_size, m.seq_len
    data = jnp.asarray(stdlib_bytes(b * (s + 1) * (steps + 1)).astype(np.int32))
    batches = data.reshape(steps + 1, b, s + 1)

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.0))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, state, opt_state, batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (metrics, new_state)), grads = grad_fn(params, state, batch[:, :-1], batch[:, 1:], m)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, metrics, optax.global_norm(grads)

    t0 = time.perf_counter()
    _, new_state, _, metrics, gnorm = step(params, state, opt_state, batches[0])
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    print(
        f"\nforward + backward on {b}x{s} stdlib bytes: loss {float(metrics['loss']):.4f} "
        f"(cross-entropy {float(metrics['ce']):.4f}, ln(vocab) = {np.log(m.vocab_size):.4f}), "
        f"gradient norm {float(gnorm):.3f}, compiled and ran in {compile_s:.1f}s"
    )
    print_layer_table(metrics["layers"])

    print(f"\n{steps} AdamW steps (router biases updated from each batch):")
    t0 = time.perf_counter()
    for i in range(steps):
        params, state, opt_state, metrics, gnorm = step(params, state, opt_state, batches[i + 1])
        if i % 10 == 0 or i == steps - 1:
            layers = metrics["layers"]
            print(
                f"  step {i:>3}  loss {float(metrics['loss']):.4f}  grad norm {float(gnorm):6.3f}  "
                f"dropped {float(jnp.mean(layers['dropped_frac'])):.4f}  "
                f"max/mean load {float(jnp.mean(layers['max_mean_load'])):.3f}"
            )
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - t0
    print(f"  {steps * b * s / elapsed:,.0f} tokens/s on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    print("\nper-layer MoE metrics after training:")
    print_layer_table(metrics["layers"])
    return 0
