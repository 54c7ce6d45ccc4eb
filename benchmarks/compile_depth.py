"""Compile time of the train step against depth: layers as a lax.scan over local/global periods
against unrolled layers (issue 17, item 6).

The `tiny` preset's train step at 4 and 48 layers, lowered and compiled on abstract inputs with
the persistent compilation cache off; the median of 2 compiles each, for model.scan_layers auto
(the default), scan and unrolled. Prediction: benchmarks/results/compile_depth_prediction.md.
Writes benchmarks/results/compile_depth.json.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def compile_seconds(layers: int, scan: str) -> float:
    import jax
    import numpy as np

    from moelab.config import load_config
    from moelab.train import optim
    from moelab.train.step import init_train_state, make_train_step

    cfg = load_config("tiny", [f"model.n_layers={layers}", f"model.scan_layers={scan}"])
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    state = jax.eval_shape(lambda: init_train_state(cfg, opt))
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32)
    times = []
    for _ in range(2):
        step = make_train_step(cfg, opt, h)  # a new function each time: nothing cached in memory
        t0 = time.perf_counter()
        step.lower(state, batch, np.int32(0)).compile()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "seconds": {}}
    for scan in ("auto", "scan", "unrolled"):
        row = {}
        for layers in (4, 48):
            print(f"compiling the tiny train step with {layers} layers, scan_layers={scan}", flush=True)
            row[layers] = compile_seconds(layers, scan)
        out["seconds"][scan] = row
        print(f"  {scan}: 4 layers {row[4]:.1f} s, 48 layers {row[48]:.1f} s, ratio {row[48] / row[4]:.2f}", flush=True)
    out["ratio_48_to_4"] = {k: v[48] / v[4] for k, v in out["seconds"].items()}
    (RESULTS / "compile_depth.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'compile_depth.json'}")


if __name__ == "__main__":
    main()
