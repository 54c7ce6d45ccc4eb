"""Drops against context across a context-extension phase (issue 28, item 4), as the seed tells it:
at a fixed batch of tokens, the share of dropped assignments per layer as sequences grow.

A real run of the `tiny` model (16 experts top-2, capacity factor 1.0, one device) trains 240 steps
at 128 tokens a sequence and 60 at 2048 with the batch's 4,096 tokens held (data.phase_seq_lens);
every step's dropped share per layer is logged. Its checkpoints before and after the extension
(steps 240 and 300) are then replayed as benchmarks/drops_vs_context.py does: batches of 4,096
tokens per device on 8 simulated devices cut into sequences of 128 to 2048 tokens, every layer's
routing through capacity (`fixed`) and `pooled_wave` at CF 1.0 and 1.25. The recipe and the
prediction were committed before the first run: results/drops_extension_prediction.md. Writes
benchmarks/results/drops_extension.{json,svg}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np

from drops_vs_context import replay, restore  # sets XLA_FLAGS (8 simulated devices) before JAX loads

RESULTS = Path(__file__).parent / "results"
RUN = ["model.n_routed=16", "model.top_k=2", "model.capacity_factor=1.0", "model.seq_len=2048",
       "data.phase_seq_lens=[128,2048]", "data.phase_starts=[0.0,0.8]", "train.batch_size=2", "train.steps=300",
       "train.log_every=1", "train.keep_steps=[240]", "train.eval_tokens=8192", "train.seed=0"]  # fmt: skip
SEQS = (128, 256, 512, 1024, 2048)
TRANSPORTS = ("fixed", "pooled_wave")
FACTORS = (1.0, 1.25)
AT = 240


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/moelab_drops_extension", help="where the run goes (kept for a rerun)")
    args = ap.parse_args()

    from moelab.config import load_config
    from moelab.progress import say
    from moelab.runs import read_jsonl
    from moelab.train.loop import train

    t0 = time.time()
    run = Path(args.out) / "run"
    say("training the run: 240 steps at 128 tokens a sequence, 60 at 2048 (4,096 tokens a step)", True)
    train(load_config("tiny", RUN), run, resume=run.exists(), progress=True)
    recs = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    per_step = np.array([r["dropped_frac_per_layer"] for r in recs])  # [steps, layers]
    steps = np.array([r["step"] for r in recs])
    windows = {"last 30 at 128": (AT - 30, AT), "first 10 at 2048": (AT, AT + 10), "last 30 at 2048": (270, 300)}
    real = {k: per_step[(steps > a) & (steps <= b)].mean(0).tolist() for k, (a, b) in windows.items()}

    replays = {}
    for step in (AT, 300):
        say(f"replaying the checkpoint at step {step} through the transports", True)
        cfg, state, store = restore(run, step)
        rows = replay(cfg, state, store, SEQS, 4096, TRANSPORTS, FACTORS, None, t0)
        replays[step] = {
            f"{t}@{cf}": {
                "per_layer": [
                    [
                        next(
                            r["dropped_frac"]
                            for r in rows
                            if (r["seq_len"], r["layer"], r["transport"], r["capacity_factor"]) == (s, layer, t, cf)
                        )
                        for layer in range(cfg.model.n_layers)
                    ]
                    for s in SEQS
                ],  # fmt: skip
            }
            for t in TRANSPORTS
            for cf in FACTORS
        }
        for v in replays[step].values():
            v["mean"] = [float(np.mean(x)) for x in v["per_layer"]]

    print("\nthe real run, dropped share of assignments per layer (capacity, CF 1.0, 4,096 tokens a step):")
    for k, v in real.items():
        print(f"  {k:<18} " + "  ".join(f"{x:7.2%}" for x in v) + f"   mean {np.mean(v):7.2%}")
    for step, table in replays.items():
        print(f"\nreplay of step {step}, mean over layers (8 simulated devices, 4,096 tokens each):")
        print(f"  {'transport @ CF':<18}" + "".join(f"{s:>9}" for s in SEQS) + "   2048/128")
        for name, v in table.items():
            print(
                f"  {name:<18}"
                + "".join(f"{x:>9.2%}" for x in v["mean"])
                + f"   {v['mean'][-1] / max(v['mean'][0], 1e-9):6.2f}x"
            )

    res = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, CPU (simulated devices)",
           "recipe": RUN, "seq_lens": list(SEQS), "real_run": real,
           "real_run_per_step_mean": per_step.mean(1).tolist(), "replay": {str(k): v for k, v in replays.items()},
           "seed_reference": {"capacity_4k": 0.07, "capacity_65k": 0.40, "pooled_wave_4k": 0.03},
           "seconds": time.time() - t0}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "drops_extension.json").write_text(json.dumps(res, indent=1))
    plot(res)
    print(f"\nwrote {RESULTS / 'drops_extension.json'} and .svg in {time.time() - t0:.0f} s")


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    seqs = res["seq_lens"]
    for step, ls in (("240", "--"), ("300", "-")):
        for name, v in res["replay"][step].items():
            t, cf = name.split("@")
            a.plot(seqs, [100 * x for x in v["mean"]], ls, marker="o" if t == "fixed" else "s", ms=3,
                   color={"fixed": "C3", "pooled_wave": "C0"}[t], alpha=1.0 if cf == "1.0" else 0.5,
                   label=f"{t}, CF {cf}, step {step}")  # fmt: skip
    a.set_xscale("log", base=2)
    a.set_xlabel("sequence length (4,096 tokens per device)")
    a.set_ylabel("dropped assignments (%)")
    a.set_title("Replay: before (240) and after (300) the extension", fontsize=10)
    a.grid(alpha=0.3)
    a.legend(fontsize=6, ncol=2)
    y = 100 * np.asarray(res["real_run_per_step_mean"])
    k = 5
    smooth = np.convolve(y, np.ones(k) / k, mode="valid")
    b.plot(np.arange(1, len(y) + 1), y, color="C3", alpha=0.25, lw=0.8)
    b.plot(np.arange(k, len(y) + 1), smooth, color="C3", label="capacity, CF 1.0 (5-step mean)")
    b.axvline(AT + 0.5, color="k", ls=":", lw=1)
    b.text(AT + 3, b.get_ylim()[1] * 0.9, "128 -> 2048 tokens", fontsize=8)
    b.set_xlabel("step")
    b.set_ylabel("dropped assignments (%), mean of layers")
    b.set_title("The real run across its context extension", fontsize=10)
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "drops_extension.svg", bbox_inches="tight")


if __name__ == "__main__":
    main()
