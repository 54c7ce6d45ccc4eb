"""Checkpoints saved in the background: the train step's time with a save in flight and without, side
by side in one process (issue 27, item 5).

The real train step of a ~70M-parameter `tiny` variant (a 0.8 GB train state) on random tokens;
each step's loss is fetched, so a step's time is the whole step. After warm-up: a window of steps
without a save, then a background save (moelab's `Checkpoints`, as the trainer uses it: local disk,
files synced) and the steps taken while it is in flight; three times for each writer
(train.checkpoint_writer: Orbax's thread in this process, or moelab's writer process at idle
priority), alternating. Then one synchronous save of the same state. The predictions, each written
before its writer's first run: results/checkpoint_async_prediction.md (thread) and
checkpoint_async_prediction_42.md (process). Writes benchmarks/results/checkpoint_async.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from datetime import date
from pathlib import Path

import jax
import numpy as np

from moelab import accounting
from moelab.config import load_config
from moelab.progress import say
from moelab.train import optim
from moelab.train.checkpoint import Checkpoints
from moelab.train.step import init_train_state, make_train_step

RESULTS = Path(__file__).parent / "results"
# the step's time with a save in flight over without: issue 27's thread writer (results/checkpoint_async_prediction.md),
# issue 42's process writer (results/checkpoint_async_prediction_42.md); each written before its first run
PREDICTED = {"thread": 1.35, "process": "1.05 (1.0-1.15)"}
SETS = ["model.d_model=512", "model.n_layers=4", "model.n_routed=64", "model.expert_dim=512", "train.batch_size=8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="background saves, each after a window without one")
    ap.add_argument("--window", type=int, default=12, help="steps timed without a save before each save")
    ap.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary folder)")
    ap.add_argument("--writers", default="thread,process", help="train.checkpoint_writer values, alternated")
    args = ap.parse_args()

    cfg = load_config("tiny", SETS)
    h = optim.hyper(cfg)
    opt = optim.make_optimizer(cfg, h)
    say("building the train state and compiling the step")
    state = init_train_state(cfg, opt)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    step_fn = make_train_step(cfg, opt, h)
    rng = np.random.default_rng(0)
    b, s, v = cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size

    def one(i: int) -> float:
        nonlocal state
        batch = rng.integers(0, v, (b, s + 1), dtype=np.int32)
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch, np.int32(i))
        float(metrics["loss"])
        return time.perf_counter() - t0

    i = 0
    for _ in range(3):  # warm-up (the first compiles)
        one(i)
        i += 1
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_async_"))
    writers = args.writers.split(",")
    cks = {w: Checkpoints(root / w, keep_last=1, background=True, writer=w) for w in writers}
    without, within, rounds = {w: [] for w in writers}, {w: [] for w in writers}, {w: [] for w in writers}
    for r in range(args.rounds):
        for w in writers:  # alternating: both writers see the same machine
            say(f"round {r + 1}/{args.rounds}, {w} writer: {args.window} steps without a save, then steps with one "
                "in flight")  # fmt: skip
            for _ in range(args.window):
                without[w].append(one(i))
                i += 1
            ck = cks[w]
            t0 = time.perf_counter()
            ck.save(i, state, {"step": i})
            blocked = time.perf_counter() - t0
            inflight = []
            while ck.in_flight():
                inflight.append(one(i))
                i += 1
            done = time.perf_counter() - t0
            ck.wait()
            within[w] += inflight
            rounds[w].append({"save_blocked_s": blocked, "save_complete_s": done, "steps_in_flight": len(inflight),
                              "step_in_flight_mean_s": float(np.mean(inflight)) if inflight else None})  # fmt: skip
    for ck in cks.values():
        ck.close()
    say("one synchronous save of the same state, for reference")
    sync = Checkpoints(root / "sync", keep_last=1, background=False)
    t0 = time.perf_counter()
    sync.save(i, state, {"step": i})
    sync_s = time.perf_counter() - t0
    sync.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    def figures(w: str) -> dict:
        m_without = float(np.mean(without[w]))
        m_within = float(np.mean(within[w])) if within[w] else float("nan")
        return {
            "step_s_without_save_mean": m_without,
            "step_s_with_save_in_flight_mean": m_within,
            "ratio": m_within / m_without,
            "steps_without": len(without[w]),
            "steps_in_flight": len(within[w]),
            "step_s_without_save_median": float(np.median(without[w])),
            "step_s_with_save_in_flight_median": float(np.median(within[w])) if within[w] else float("nan"),
            "rounds": rounds[w],
        }

    res = {
        "date": date.today().isoformat(),
        "command": f"python benchmarks/checkpoint_async.py --writers {args.writers}",
        "machine": {"cpus": os.cpu_count(), "backend": jax.default_backend(), "load_1min_before": LOAD},
        "config": {"preset": "tiny", "set": SETS, "params": accounting.count(cfg).total_params},
        "state_bytes": int(state_bytes),
        "writers": {w: figures(w) for w in writers},
        "sync_save_s": sync_s,
        "target_ratio": 1.15,
        "predicted_ratio": PREDICTED,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_async.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"state {state_bytes / 1e9:.2f} GB ({res['config']['params'] / 1e6:.0f}M parameters), {os.cpu_count()} cores")
    print(f"{'':36}{'mean step':>12}{'median':>10}{'steps':>8}")
    for w, f in res["writers"].items():
        for what, key in (("without a save", "without_save"), ("with a save in flight", "with_save_in_flight")):
            n = f["steps_without"] if key == "without_save" else f["steps_in_flight"]
            print(f"{w + ' writer, ' + what:36}{1000 * f[f'step_s_{key}_mean']:>10.1f}ms"
                  f"{1000 * f[f'step_s_{key}_median']:>8.1f}ms{n:>8}")  # fmt: skip
        blocked = np.mean([r["save_blocked_s"] for r in f["rounds"]])
        complete = np.mean([r["save_complete_s"] for r in f["rounds"]])
        print(f"{w} writer: ratio {f['ratio']:.2f} (target 1.15; predicted {PREDICTED.get(w)}); the save blocks the "
              f"loop {blocked:.2f} s, complete after {complete:.2f} s")  # fmt: skip
    print(f"a synchronous save: {sync_s:.2f} s")


LOAD = os.getloadavg()[0]

if __name__ == "__main__":
    main()
