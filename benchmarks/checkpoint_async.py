"""Checkpoints saved in the background: the train step's time with a save in flight and without, side
by side in one process (issue 27, item 5).

The real train step of a ~70M-parameter `tiny` variant (a 0.8 GB train state) on random tokens;
each step's loss is fetched, so a step's time is the whole step. After warm-up: a window of steps
without a save, then a background save (moelab's `Checkpoints`, as the trainer uses it: local disk,
files synced) and the steps taken while it is in flight; three times. Then one synchronous save of
the same state. The prediction written before the first run: results/checkpoint_async_prediction.md.
Writes benchmarks/results/checkpoint_async.json.
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
SETS = ["model.d_model=512", "model.n_layers=4", "model.n_routed=64", "model.expert_dim=512", "train.batch_size=8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="background saves, each after a window without one")
    ap.add_argument("--window", type=int, default=12, help="steps timed without a save before each save")
    ap.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary folder)")
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
    without, within, rounds = [], [], []
    ck = Checkpoints(root / "bg", keep_last=1, background=True)
    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}: {args.window} steps without a save, then steps with one in flight")
        for _ in range(args.window):
            without.append(one(i))
            i += 1
        t0 = time.perf_counter()
        ck.save(i, state, {"step": i})
        blocked = time.perf_counter() - t0
        inflight = []
        while ck.manager.is_saving_in_progress():
            inflight.append(one(i))
            i += 1
        done = time.perf_counter() - t0
        ck.wait()
        within += inflight
        rounds.append({"save_blocked_s": blocked, "save_complete_s": done, "steps_in_flight": len(inflight),
                       "step_in_flight_mean_s": float(np.mean(inflight)) if inflight else None})  # fmt: skip
    ck.close()
    say("one synchronous save of the same state, for reference")
    sync = Checkpoints(root / "sync", keep_last=1, background=False)
    t0 = time.perf_counter()
    sync.save(i, state, {"step": i})
    sync_s = time.perf_counter() - t0
    sync.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    m_without, m_within = float(np.mean(without)), float(np.mean(within)) if within else float("nan")
    res = {
        "date": date.today().isoformat(),
        "command": "python benchmarks/checkpoint_async.py",
        "machine": {"cpus": os.cpu_count(), "backend": jax.default_backend(), "load_1min_before": None},
        "config": {"preset": "tiny", "set": SETS, "params": accounting.count(cfg).total_params},
        "state_bytes": int(state_bytes),
        "step_s_without_save_mean": m_without,
        "step_s_with_save_in_flight_mean": m_within,
        "ratio": m_within / m_without,
        "steps_without": len(without),
        "steps_in_flight": len(within),
        "step_s_without_save_median": float(np.median(without)),
        "step_s_with_save_in_flight_median": float(np.median(within)) if within else float("nan"),
        "rounds": rounds,
        "sync_save_s": sync_s,
        "predicted_ratio": 1.35,
    }
    res["machine"]["load_1min_before"] = LOAD
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_async.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"state {state_bytes / 1e9:.2f} GB ({res['config']['params'] / 1e6:.0f}M parameters), {os.cpu_count()} cores")
    print(f"{'':28}{'mean step':>12}{'median':>10}{'steps':>8}")
    print(
        f"{'without a save':28}{1000 * m_without:>10.1f}ms{1000 * res['step_s_without_save_median']:>8.1f}ms{len(without):>8}"
    )
    print(
        f"{'with a save in flight':28}{1000 * m_within:>10.1f}ms{1000 * res['step_s_with_save_in_flight_median']:>8.1f}ms{len(within):>8}"
    )
    print(f"ratio {res['ratio']:.2f} (predicted 1.35); save blocks the loop {np.mean([r['save_blocked_s'] for r in rounds]):.2f} s, "
          f"complete after {np.mean([r['save_complete_s'] for r in rounds]):.2f} s; a synchronous save {sync_s:.2f} s")  # fmt: skip


LOAD = os.getloadavg()[0]

if __name__ == "__main__":
    main()
