"""Where a train step's time goes, moelab against transformers' Qwen2-MoE, part by part (issue 42, item 1).

At a shape of benchmarks/vs_transformers.py (B by default), one layer's attention (its norm, q/k/v,
RoPE, the causal attention and the output projection), one layer's MoE block (its norm, router,
routed and shared experts) and the head with its cross-entropy, each timed forward and forward with
backward on the same [batch, seq, d_model] input; then each framework's whole step profiled by op
(moelab: benchmarks/profile_step.py's regions and costliest XLA ops; PyTorch: torch.profiler's
operators by their own CPU time). Each framework runs in its own worker process and they alternate
round by round, idle while the other runs (see vs_transformers.py for why). Timings are medians.

    python benchmarks/vs_transformers_parts.py [--shape B] [--rounds 3]

Writes benchmarks/results/vs_transformers_parts.json (or --out). Needs the benchmark extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_transformers import RESULTS, SHAPES, torch_stepper  # noqa: E402

PARTS = ("attention", "moe", "head+ce")


def median_s(fn, n: int = 3) -> float:
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def jax_parts(shape: dict) -> dict:
    """part -> (forward, forward and backward) callables, on one layer's weights."""
    import jax
    import jax.numpy as jnp

    from moelab.bench import shape_config
    from moelab.model.moe import moe_block
    from moelab.model.transformer import attention_block, ce_terms, init_params, init_state

    m = shape_config(**shape).model
    params, st = init_params(m, jax.random.PRNGKey(0)), init_state(m)
    p0 = jax.tree.map(lambda a: a[0], params["layers"])
    x = jax.random.normal(jax.random.PRNGKey(1), (shape["batch"], shape["seq"], shape["d_model"]), jnp.float32)
    targets = jax.random.randint(jax.random.PRNGKey(2), x.shape[:2], 0, m.vocab_size)
    from moelab.model.layers import rms_norm

    def attention(p, x):
        return attention_block(x, p, i=0, m=m)

    def moe(p, x):
        return moe_block(p, rms_norm(x, p["mlp_norm"], m.norm_eps), st["router_bias"][0], m, "dropless")[0]

    def head(p, x):
        lse, tgt = ce_terms(p, rms_norm(x, p["final_norm"], m.norm_eps), targets, m.ce_chunk)
        return jnp.mean(lse - tgt)

    out = {}
    for name, f, p in (("attention", attention, p0), ("moe", moe, p0),
                       ("head+ce", head, {"head": params["head"], "final_norm": params["final_norm"]})):  # fmt: skip
        fwd = jax.jit(f)
        both = jax.jit(jax.value_and_grad(lambda p, x, f=f: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
        out[name] = (lambda fwd=fwd, p=p: jax.block_until_ready(fwd(p, x)),
                     lambda both=both, p=p: jax.block_until_ready(both(p, x)))  # fmt: skip
    return out


def torch_parts(shape: dict, threads: int) -> dict:
    import torch

    step, _ = torch_stepper(shape, threads)
    model = step.model
    layer = model.model.layers[0]
    x = torch.randn(shape["batch"], shape["seq"], shape["d_model"], requires_grad=True)
    pos = torch.arange(shape["seq"])[None].expand(shape["batch"], -1)
    rope = model.model.rotary_emb(x, pos)
    targets = torch.randint(0, shape["vocab"], x.shape[:2])

    def attention():
        return layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=rope, attention_mask=None)[0]

    def moe():
        out = layer.mlp(layer.post_attention_layernorm(x))
        return out[0] if isinstance(out, tuple) else out

    def head():
        logits = model.lm_head(model.model.norm(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    out = {}
    for name, f in (("attention", attention), ("moe", moe), ("head+ce", head)):

        def fwd(f=f):
            with torch.no_grad():
                f()

        def both(f=f):
            model.zero_grad(set_to_none=True)
            x.grad = None
            (f() ** 2).sum().backward()

        out[name] = (fwd, both)
    return out


def torch_profile(shape: dict, threads: int, top: int) -> list[dict]:
    import torch

    step, _ = torch_stepper(shape, threads)
    step(0), step(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(2)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in rows]


def worker(framework: str, shape: dict, threads: int, top: int, conn) -> None:
    if framework == "moelab":
        parts = jax_parts(shape)
    else:
        parts = torch_parts(shape, threads)
    for fwd, both in parts.values():  # compile and warm up
        fwd(), both()
    conn.send("ready")
    while conn.recv():
        conn.send({name: {"fwd": median_s(fwd), "fwd+bwd": median_s(both)} for name, (fwd, both) in parts.items()})
    if framework == "moelab":
        from moelab.bench import shape_config
        from profile_step import profile

        conn.send(profile(shape_config(**shape), steps=2, top=top))
    else:
        conn.send(torch_profile(shape, threads, top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="B", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15, help="costliest ops listed per framework")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "vs_transformers_parts.json", help="the results file")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    print(f"shape {args.shape}: starting both workers (each compiles and warms up its parts) ...", file=sys.stderr)
    for fw in ("moelab", "transformers"):
        here, there = ctx.Pipe()
        procs.append(ctx.Process(target=worker, args=(fw, shape, args.threads, args.top, there), daemon=True))
        procs[-1].start()
        pipes[fw] = here
        here.recv()  # one at a time: the other's start-up would share the cores
    rounds = {fw: [] for fw in pipes}
    for r in range(args.rounds):
        for fw, pipe in pipes.items():
            pipe.send(True)
            rounds[fw].append(pipe.recv())
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("  profiling each whole step by op", file=sys.stderr, flush=True)
    profiles = {}
    for fw, pipe in pipes.items():
        pipe.send(False)
        profiles[fw] = pipe.recv()
    for p in procs:
        p.join()
    parts = {}
    for name in PARTS:
        row = {}
        for kind in ("fwd", "fwd+bwd"):
            for fw in pipes:
                row[f"{fw}_{kind}_ms"] = 1e3 * float(np.median([r[name][kind] for r in rounds[fw]]))
            row[f"ratio_{kind}"] = row[f"transformers_{kind}_ms"] / row[f"moelab_{kind}_ms"]
        parts[name] = row
    res = {
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": f"python benchmarks/vs_transformers_parts.py --shape {args.shape}",
        "shape": {"name": args.shape, **shape},
        "rounds": args.rounds,
        "parts": parts,
        "note": "ratio = transformers' time over moelab's (above 1: moelab faster); one layer's part, medians of rounds",
        "moelab_profile": {
            "wall_ms": profiles["moelab"]["wall_ms"],
            "regions_ms": profiles["moelab"]["regions"],
            "top_ops": profiles["moelab"]["top_ops"],
        },  # fmt: skip
        "transformers_profile": {"top_ops": profiles["transformers"]},
    }
    RESULTS.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(
        f"{'part':10s} {'moelab fwd':>11s} {'torch fwd':>10s} {'moelab f+b':>11s} {'torch f+b':>10s} {'ratio f+b':>10s}"
    )
    for name, r in parts.items():
        print(f"{name:10s} {r['moelab_fwd_ms']:9.1f}ms {r['transformers_fwd_ms']:8.1f}ms {r['moelab_fwd+bwd_ms']:9.1f}ms "
              f"{r['transformers_fwd+bwd_ms']:8.1f}ms {r['ratio_fwd+bwd']:9.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
