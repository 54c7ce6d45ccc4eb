"""Where the train step's time goes: the JAX profiler's per-op times, summed by model region.

    python benchmarks/profile_step.py [--d-model 256 --layers 4 ... any `moelab bench train-step` shape flag]

The step is traced for a few steps after warm-up; each XLA op is named by the scope it came from
(``attention``, ``moe``, ``head`` in the model; the rest is the optimiser, norms and
embeddings), forward and backward apart. Op times are summed over both cores' work, so the
total can exceed the wall time when ops overlap. Prints a table by region and the costliest ops.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

REGIONS = ("attention", "moe", "head")


def region_of(op_name: str) -> str:
    """'attention fwd', 'moe bwd', 'optimiser/other' ... from an op's metadata name."""
    scopes = re.split(r"[/()]", op_name)  # e.g. 'jit(step)/transpose(jvp(moe))/nbd,ndf->nbf/dot_general'
    where = next((r for r in REGIONS if r in scopes), None)
    if where is None:
        return "optimiser, norms, embed"
    return f"{where} {'bwd' if 'transpose(' in op_name else 'fwd'}"


def op_names(hlo_text: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (result shape, op_name metadata)."""
    out = {}
    for line in hlo_text.splitlines():
        mm = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name="([^"]*)"', line)
        if mm:
            out[mm.group(1)] = (mm.group(2), mm.group(3))
    return out


def profile(cfg, steps: int = 3, top: int = 15) -> dict:
    import jax

    from moelab.train import optim
    from moelab.train.step import init_train_state, make_train_step

    m = cfg.model
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = init_train_state(cfg, opt)
    step = make_train_step(cfg, opt, h)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, m.vocab_size, (cfg.train.batch_size, m.seq_len + 1), dtype=np.int32)
    args = (np.int32(0),)
    names = op_names(step.lower(state, batch, *args).compile().as_text())
    for _ in range(2):
        state, metrics = step(state, batch, *args)
    jax.block_until_ready(metrics["loss"])
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        import time

        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch, *args)
        jax.block_until_ready(metrics["loss"])
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        trace = sorted(Path(tmp).rglob("*.trace.json.gz"))[-1]
        events = json.load(gzip.open(trace))["traceEvents"]
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in names:
            per_op[e["name"]] += e["dur"] / 1e3 / steps  # ms per step
    regions = collections.Counter()
    for name, ms in per_op.items():
        regions[region_of(names[name][1])] += ms
    ops = [
        {"op": n, "ms": ms, "shape": names[n][0], "from": names[n][1].split("/", 1)[-1]}
        for n, ms in per_op.most_common(top)
    ]
    return {"wall_ms": 1e3 * wall, "op_ms": sum(per_op.values()), "regions": dict(regions), "top_ops": ops}


def main(argv=None) -> int:
    from moelab.bench import SHAPE_FLAGS, shape_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, (_, typ, default) in SHAPE_FLAGS.items():
        ap.add_argument("--" + flag.replace("_", "-"), type=typ, default=default)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    cfg = shape_config(**{k: getattr(a, k) for k in SHAPE_FLAGS})
    r = profile(cfg, a.steps, a.top)
    print(f"step {r['wall_ms']:.0f} ms wall; {r['op_ms']:.0f} ms of op time (both cores' ops summed)")
    print(f"{'region':28s} {'ms/step':>9s} {'share':>7s}")
    for name, ms in sorted(r["regions"].items(), key=lambda kv: -kv[1]):
        print(f"{name:28s} {ms:9.1f} {ms / r['op_ms']:7.1%}")
    print(f"\ncostliest ops\n{'ms/step':>8s}  {'result':30s} from")
    for o in r["top_ops"]:
        print(f"{o['ms']:8.1f}  {o['shape'][:30]:30s} {o['from'][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
