"""The token-drop study: dropped fraction against sequence length, per transport and capacity factor.

A small MoE is trained on the standard library (or a run is given with --run). Batches of a fixed
number of tokens per device (4,096 by default, 8 simulated devices) are cut into sequences of
128 to 4,096 tokens (windows of the training streams at seeded random starts); the model routes them once (dropless), and every
layer's routing is replayed through each expert-parallel transport (fixed, spill, pooled_wave) at
capacity factors 1.0, 1.15 and 1.25. It prints a table, writes
benchmarks/results/drops_vs_context.{json,svg}, and reports each transport's bytes sent per device
per step, its buffer sizes and its step time on the simulated devices (simulated: it says nothing
of a real interconnect).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()  # before JAX loads

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from datetime import date  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TRANSPORTS = ("fixed", "spill", "pooled_wave")
FACTORS = (1.0, 1.15, 1.25)
SEQS = (128, 256, 512, 1024, 2048, 4096)


def trained_run(args) -> Path:
    from moelab.config import load_config
    from moelab.train.loop import train

    if args.run:
        return Path(args.run)
    out = Path(args.out) / "model"
    if (out / "summary.json").exists():
        return out
    cfg = load_config("tiny", [f"train.steps={args.train_steps}", "model.n_routed=16", "model.top_k=2",
                               "data.max_bytes_per_domain=2000000", "train.eval_tokens=4096"])  # fmt: skip
    train(cfg, out, resume=out.exists())
    return out


def buffer_rows(transport: str, cf: float, t: int, k: int, n_exp: int, n_dev: int, waves: int) -> dict:
    """Rows of d_model each way per device: what the send and receive buffers hold."""
    from moelab.parallel.ep import pool_size, slots_per_expert

    local = n_exp // n_dev
    if transport == "pooled_wave":
        pool = pool_size(cf, t, k, n_dev, local)
        per_wave = -(-pool // waves)
        sent = n_dev * per_wave * waves
        recv_buffer = local * n_dev * slots_per_expert(cf, t, k, n_exp)
        return {"send_rows": sent, "recv_rows": sent, "expert_buffer_rows": recv_buffer, "exchanges": 2 * waves}
    c = slots_per_expert(cf, t, k, n_exp)
    return {"send_rows": n_exp * c, "recv_rows": n_exp * c, "expert_buffer_rows": local * n_dev * c, "exchanges": 2}


def restore(run: Path, step: int | None = None):
    """(config, train state, token store) of a run's checkpoint (the newest by default)."""
    from moelab.data.store import build_store
    from moelab.runs import load_run_config
    from moelab.train import checkpoint, optim
    from moelab.train.step import init_train_state

    cfg = load_run_config(run)
    state = init_train_state(cfg, optim.make_optimizer(cfg, optim.hyper(cfg)))
    step = checkpoint.steps(run / "ckpt")[-1] if step is None else step
    state, _ = checkpoint.restore(run / "ckpt", step, state)
    return cfg, state, build_store(cfg.data, cfg.model.vocab_size, progress=False)


def replay(cfg, state, store, seqs, tokens_per_device, transports, factors, timing=None, t0=None, n_dev=8) -> list:
    """Every layer's routing of batches of ``tokens_per_device`` x ``n_dev`` tokens cut into sequences
    of each length (windows of the training streams at seeded random starts, the domains in turn),
    routed once dropless and replayed through each transport and capacity factor on ``n_dev``
    simulated devices: one row per (length, layer, transport, factor). With ``timing``, each compiled
    transport's call is timed into it."""
    import jax
    import jax.numpy as jnp

    from moelab.config import replace
    from moelab.model import router as rt
    from moelab.model.moe import routed_experts
    from moelab.model.transformer import forward
    from moelab.parallel import mesh as pmesh

    t0 = t0 or time.time()
    mesh = pmesh.auto_mesh(1, n_dev)
    total = tokens_per_device * n_dev
    m0 = cfg.model
    w = {n: state["params"]["layers"][n] for n in ("w_gate", "w_up", "w_down")}
    rows_out = []
    fns = {}
    for seq in seqs:
        # windows of the training streams at seeded random starts, the domains in turn
        rng = np.random.default_rng(0)
        n_seq = total // seq
        tokens = np.empty((n_seq, seq), np.int32)
        for i in range(n_seq):
            stream = store.stream(store.domains[i % len(store.domains)], "train")
            start = int(rng.integers(0, len(stream) - seq))
            tokens[i] = stream[start : start + seq]
        # at this length; a run with a long-context phase scales RoPE from its first length, as it trains
        first = min(cfg.data.phase_seq_lens, default=0)
        m = dataclasses.replace(m0, seq_len=max(seq, m0.sliding_window), rope_original_len=first if seq > first else 0)
        _, metrics, _ = jax.jit(lambda p, s, x, m=m: forward(p, s, x, m, "dropless", capture=True))(
            state["params"], state["model_state"], jnp.asarray(tokens)
        )
        for layer in range(m.n_layers):
            h = metrics["moe_input"][layer].reshape(total, -1)
            p = jax.tree.map(lambda a, i=layer: a[i], state["params"]["layers"])
            if m.latent_dim:
                from moelab.model.layers import rms_norm

                xt = h
                h = rms_norm(xt @ p["latent_down"], p["latent_norm"], m.norm_eps)
                logits = xt.astype(jnp.float32) @ p["router"].astype(jnp.float32)
            else:
                logits = h.astype(jnp.float32) @ p["router"].astype(jnp.float32)
            r = rt.route(logits, state["model_state"]["router_bias"][layer], m)
            wl = jax.tree.map(lambda a, i=layer: a[i], w)
            # placed as a training step places them: tokens over the devices, experts over `expert`
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            h = jax.device_put(h, pmesh.batch_sharding(mesh))
            r = jax.device_put(r, pmesh.batch_sharding(mesh))
            wl = jax.device_put(wl, NamedSharding(mesh, P("expert")))
            for transport in transports:
                for cf in factors:
                    # spill over every next choice, as the study was first run (before spill_choices)
                    mt = replace(
                        cfg, model={"ep_transport": transport, "capacity_factor": cf, "spill_choices": 0}
                    ).model
                    key = (transport, cf)
                    if key not in fns:  # as the train step calls it: the transport on the mesh
                        dispatch = "spill" if transport == "spill" else "capacity"
                        on_mesh = pmesh.Runtime(
                            mesh
                        )  # the transports run on the mesh (the forward above on one device)
                        fns[key] = jax.jit(
                            lambda h, r, w, mt=mt, d=dispatch, rt=on_mesh: routed_experts(h, r, w, mt, d, rt)
                        )
                    y, st = fns[key](h, r, wl)
                    jax.block_until_ready(y)
                    if timing is not None and (seq == 4096 or key not in timing):  # time the compiled call
                        t1 = time.perf_counter()
                        jax.block_until_ready(fns[key](h, r, wl)[0])
                        timing[key] = time.perf_counter() - t1
                    rows_out.append({
                        "seq_len": seq, "layer": layer, "transport": transport, "capacity_factor": cf,
                        "dropped_frac": float(st["dropped_frac"]),
                        "sender_dropped_frac": float(st["sender_dropped_frac"]),
                        "receiver_dropped_frac": float(st["receiver_dropped_frac"]),
                        "spilled_frac": float(st["spilled_frac"]),
                    })  # fmt: skip
        print(f"  routed {n_seq} sequences of {seq} tokens ({time.time() - t0:.0f} s)", flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", help="a trained run directory (default: train the study's model)")
    ap.add_argument("--out", default="runs/drops_vs_context")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--tokens-per-device", type=int, default=4096)
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    args = ap.parse_args()

    t0 = time.time()
    run = trained_run(args)
    cfg, state, store = restore(run)
    n_dev = 8
    m0 = cfg.model
    timing = {}
    rows_out = replay(cfg, state, store, [int(s) for s in args.seqs.split(",")], args.tokens_per_device, TRANSPORTS,
                      FACTORS, timing, t0)  # fmt: skip

    seqs = sorted({r["seq_len"] for r in rows_out})
    table = {}
    for transport in TRANSPORTS:
        for cf in FACTORS:
            table[f"{transport}@{cf}"] = [
                float(np.mean([r["dropped_frac"] for r in rows_out
                               if r["seq_len"] == s and r["transport"] == transport and r["capacity_factor"] == cf]))
                for s in seqs
            ]  # fmt: skip
    print(f"\ndropped fraction of assignments (mean over {m0.n_layers} layers), {n_dev} simulated devices, "
          f"{args.tokens_per_device} tokens per device, {m0.n_routed} experts top-{m0.top_k}:")  # fmt: skip
    print(f"  {'transport @ CF':<20}" + "".join(f"{s:>8}" for s in seqs))
    for name, vals in table.items():
        print(f"  {name:<20}" + "".join(f"{v:>8.2%}" for v in vals))

    d = m0.d_model if not m0.latent_dim else m0.latent_dim
    bytes_per_row = d * 4  # fp32 activations
    cost = {}
    print(f"\ncost per device per MoE layer (rows of {d} fp32 values; simulated devices: no real interconnect)")
    print(f"  {'transport @ CF':<20} {'sent MB':>8} {'send buf':>9} {'recv buf':>9} {'exchanges':>9} {'time ms':>8}")
    for (transport, cf), secs in timing.items():
        b = buffer_rows(transport, cf, args.tokens_per_device, m0.top_k, m0.n_routed, n_dev, m0.ep_waves)
        sent = 2 * b["send_rows"] * bytes_per_row  # out and back
        cost[f"{transport}@{cf}"] = {**b, "bytes_sent_per_device": sent, "seconds_simulated": secs}
        print(f"  {transport + ' @ ' + str(cf):<20} {sent / 1e6:>8.2f} {b['send_rows']:>9} {b['recv_rows']:>9}"
              f" {b['exchanges']:>9} {1000 * secs:>8.1f}")  # fmt: skip

    RESULTS.mkdir(exist_ok=True)
    result = {
        "date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU, simulated devices)",
        "run": str(run), "devices": n_dev, "tokens_per_device": args.tokens_per_device, "experts": m0.n_routed,
        "top_k": m0.top_k, "seq_lens": seqs, "dropped_frac": table, "cost": cost, "rows": rows_out,
        "seconds": time.time() - t0,
    }  # fmt: skip
    (RESULTS / "drops_vs_context.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    styles = {"fixed": "-", "spill": "--", "pooled_wave": ":"}
    for name, vals in table.items():
        transport, cf = name.split("@")
        ax.plot(seqs, [100 * v for v in vals], styles[transport], marker="o", ms=3,
                color={"1.0": "C3", "1.15": "C1", "1.25": "C0"}[cf], label=f"{transport}, CF {cf}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens per device fixed)")
    ax.set_ylabel("dropped assignments (%)")
    ax.set_title("Drops against context, by transport and capacity factor", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=3)
    fig.savefig(RESULTS / "drops_vs_context.svg", bbox_inches="tight")
    print(f"\nwrote {RESULTS / 'drops_vs_context.json'} and .svg in {math.ceil(time.time() - t0)} s")


if __name__ == "__main__":
    main()
