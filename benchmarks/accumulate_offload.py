"""Gradient accumulation, host offload and remat on CPU: the train step's time side by side in one
process (issue 27, items 1-3).

One config (the `tiny` recipe at d 256, 8 layers, 32 experts, batch 32 of 256 tokens) trained by the
real train step on random tokens, each variant from the same warmed state: the whole batch at once;
2 and 4 micro-batches; the optimizer state offloaded; remat layer and each_layer, with and without
everything offloaded. The variants' timed steps are interleaved in rounds (A B C ... A B C ...), so a
drift of the machine touches every variant alike; each step's loss is fetched, so a step's time is
the whole step. Ratios are to the whole batch's median step. XLA:CPU has one memory, so the offload's
moves compile to nothing here: this measures what the program costs on CPU, not a GPU's transfers.
The prediction written before the first run: results/accumulate_offload_prediction.md.
Writes benchmarks/results/accumulate_offload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import date
from pathlib import Path

import jax
import numpy as np

from moelab.config import load_config
from moelab.progress import say
from moelab.train import optim
from moelab.train.step import init_train_state, make_train_step, offload_state

RESULTS = Path(__file__).parent / "results"
BASE = ["model.d_model=256", "model.n_layers=8", "model.n_routed=32", "model.expert_dim=128", "model.latent_dim=128",
        "model.shared_dim=128", "model.seq_len=256", "model.sliding_window=128", "train.batch_size=32"]  # fmt: skip
VARIANTS = {
    "whole batch": [],
    "2 micro-batches": ["train.micro_batch=16"],
    "4 micro-batches": ["train.micro_batch=8"],
    "optimizer offloaded": ["train.offload=optimizer"],
    "remat layer": ["model.remat=layer"],
    "remat layer, all offloaded": ["model.remat=layer", "train.offload=all"],
    "remat each_layer": ["model.remat=each_layer"],
    "remat each_layer, all offloaded, 2 micro-batches": [
        "model.remat=each_layer",
        "train.offload=all",
        "train.micro_batch=16",
    ],  # fmt: skip
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed steps of each variant, interleaved")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = load_config("tiny", BASE)
    batches = [rng.integers(0, base.model.vocab_size, (base.train.batch_size, base.model.seq_len + 1)).astype(np.int32)
               for _ in range(args.rounds + 2)]  # fmt: skip
    h = optim.hyper(base)
    opt = optim.make_optimizer(base, h)
    warm = init_train_state(base, opt)
    warm_step = make_train_step(base, opt, h)
    for s in range(2):
        warm, _ = warm_step(warm, batches[s], np.int32(s))
    warm = jax.device_get(warm)
    runs = {}
    for name, sets in VARIANTS.items():
        say(f"compiling: {name}", True)
        cfg = load_config(base, sets)
        step = make_train_step(cfg, opt, h)
        state = offload_state(jax.tree.map(jax.numpy.asarray, warm), cfg)
        state, m = step(state, batches[0], np.int32(2))  # compile and warm up
        float(m["loss"])
        runs[name] = {"step": step, "state": state, "times": [], "losses": []}
    for r in range(args.rounds):
        say(f"round {r + 1} of {args.rounds}: a step of each variant", True)
        for run in runs.values():
            t0 = time.perf_counter()
            run["state"], m = run["step"](run["state"], batches[r + 1], np.int32(3 + r))
            run["losses"].append(float(m["loss"]))
            run["times"].append(time.perf_counter() - t0)
    ref = float(np.median(runs["whole batch"]["times"]))
    out = {"date": str(date.today()), "command": "python benchmarks/accumulate_offload.py",
           "machine": {"cpus": os.cpu_count(), "backend": jax.default_backend(), "load_1min_before": os.getloadavg()[0]},
           "config": {"preset": "tiny", "set": BASE}, "variants": {}}  # fmt: skip
    print(f"{'variant':<52} {'median step':>12} {'ratio':>7} {'loss, last':>11}")
    for name, run in runs.items():
        med = float(np.median(run["times"]))
        out["variants"][name] = {"set": VARIANTS[name], "median_s": med, "ratio": med / ref, "times": run["times"],
                                 "losses": run["losses"]}  # fmt: skip
        print(f"{name:<52} {med * 1e3:10.0f}ms {med / ref:7.2f} {run['losses'][-1]:11.5f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "accumulate_offload.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'accumulate_offload.json'}")


if __name__ == "__main__":
    main()
