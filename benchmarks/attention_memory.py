"""Attention memory against sequence length: the flash path (no [s, s] buffer) against the blocked
path, compiled and, at 32K tokens, run on this CPU (issue 17, item 5).

One attention layer (d_model 512, 8 query heads, 2 kv heads, head size 64), batch 1, fp32; the
forward and backward of the sum of squared outputs. For each length it compiles both paths and
reads XLA's temp bytes and the largest value in the program; then it runs the flash step at 32K
tokens, global and with a 4096 window, each in a fresh process, for the wall time and the peak
resident memory. Prediction: benchmarks/results/attention_memory_prediction.md.
Writes benchmarks/results/attention_memory.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
D, HEADS, KV, HD = 512, 8, 2, 64
LENGTHS = (2048, 4096, 8192, 16384, 32768)


def _step(impl: str, seq: int, window: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moelab.model.layers import attention

    rng = np.random.default_rng(0)
    shapes = (("wq", (D, HEADS * HD)), ("wk", (D, KV * HD)), ("wv", (D, KV * HD)), ("wo", (HEADS * HD, D)))
    p = {k: jnp.asarray(rng.normal(size=s) / math.sqrt(s[0]), jnp.float32) for k, s in shapes}
    kw = dict(n_heads=HEADS, n_kv_alloc=KV, n_kv=KV, head_dim=HD, window=window, rope_fraction=0.5,
              rope_theta=1e4, eps=1e-6, impl=impl)  # fmt: skip
    loss = lambda p, x: jnp.sum(attention(p, x, **kw) ** 2)  # noqa: E731
    x = jax.ShapeDtypeStruct((1, seq, D), jnp.float32)
    return jax.value_and_grad(loss, argnums=(0, 1)), p, x


def largest_value(jaxpr) -> int:
    """Elements of the largest value any equation of the program makes, nested programs included."""
    most = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            most = max(most, math.prod(getattr(v.aval, "shape", ())))
        for val in eqn.params.values():
            for sub in val if isinstance(val, (list, tuple)) else [val]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    most = max(most, largest_value(inner))
    return most


def compiled(impl: str, seq: int) -> dict:
    import jax

    fn, p, x = _step(impl, seq, 0)
    t0 = time.perf_counter()
    exe = jax.jit(fn).lower(p, x).compile()
    mem = exe.memory_analysis()
    return {
        "impl": impl,
        "seq": seq,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "largest_value_elements": largest_value(jax.make_jaxpr(fn)(p, x).jaxpr),
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def run_once(seq: int, window: int) -> dict:
    """In this process: run the flash step once (after compiling), report time and peak RSS."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    fn, p, x = _step("flash", seq, window)
    xs = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    step = jax.jit(fn)
    t0 = time.perf_counter()
    exe = step.lower(p, xs).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (value, grads) = exe(p, xs)
    jax.block_until_ready(grads)
    wall = time.perf_counter() - t0
    finite = bool(np.isfinite(float(value))) and all(bool(np.all(np.isfinite(g))) for g in jax.tree.leaves(grads))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seq": seq, "window": window, "compile_s": round(compile_s, 1), "step_s": round(wall, 1),
            "peak_rss_bytes": int(peak), "finite": finite}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-once", nargs=2, type=int, metavar=("SEQ", "WINDOW"), help=argparse.SUPPRESS)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = ap.parse_args()
    if args.run_once:
        print(json.dumps(run_once(*args.run_once)))
        return
    rows = []
    for seq in args.lengths:
        for impl in ("flash", "blocked"):
            print(f"compiling {impl} attention at {seq} tokens ...", file=sys.stderr, flush=True)
            rows.append(compiled(impl, seq))
            r = rows[-1]
            print(f"  {impl:8s} {seq:6d} tokens: temp {r['temp_bytes'] / 2**30:7.3f} GiB, largest value "
                  f"{r['largest_value_elements'] / seq**2:.4f} s*s, compile {r['compile_s']} s", flush=True)  # fmt: skip
    runs = []
    top = max(args.lengths)
    for window in (0, 4096):
        print(
            f"running the flash step at {top} tokens, window {window}, in a fresh process ...",
            file=sys.stderr,
            flush=True,
        )
        out = subprocess.run([sys.executable, __file__, "--run-once", str(top), str(window)], capture_output=True,
                             text=True, check=True)  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"  flash {top} tokens, window {window}: step {r['step_s']} s, peak RSS "
              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, finite {r['finite']}", flush=True)  # fmt: skip
    by = {(r["impl"], r["seq"]): r for r in rows}
    s16, s32 = (16384, 32768) if {16384, 32768} <= set(args.lengths) else (None, None)
    summary = {
        "flash_largest_value_over_s2_at_top": by[("flash", top)]["largest_value_elements"] / top**2,
        "one_head_scores_bytes_at_top": 4 * top**2,
        "flash_temp_bytes_at_top": by[("flash", top)]["temp_bytes"],
        "blocked_temp_bytes_at_top": by[("blocked", top)]["temp_bytes"],
        "flash_temp_growth_16k_to_32k": (by[("flash", s32)]["temp_bytes"] / by[("flash", s16)]["temp_bytes"])
        if s16
        else None,
    }
    print(json.dumps(summary, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_memory.json").write_text(
        json.dumps(
            {
                "date": date.today().isoformat(),
                "machine": platform.processor() or platform.machine(),
                "shape": {"d_model": D, "heads": HEADS, "kv_heads": KV, "head_dim": HD, "batch": 1},
                "compiled": rows,
                "runs": runs,
                "summary": summary,
            },
            indent=1,
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
