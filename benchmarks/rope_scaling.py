"""Which RoPE scaling for the long-context phase: none, position interpolation, NTK or YaRN, measured
(issue 28, item 3).

A parent run of the `tiny` model trains 240 steps at 128 tokens a sequence and 60 more at 512
(data.phase_seq_lens, RoPE unscaled: the `none` arm); three branches from its checkpoint at the
context change train the same 60 steps with `pi`, `ntk` and `yarn`. Every arm is measured on the
held-out windows of 512 tokens, its loss per target position in buckets, zero-shot (the step-240
checkpoint, never trained at 512) and extended (step 300). The recipe and the prediction, with the
rule that picks model.rope_scaling's default, were committed before the first run:
results/rope_scaling_prediction.md. Writes benchmarks/results/rope_scaling.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
KINDS = ("none", "pi", "ntk", "yarn")
BUCKETS = ((0, 128), (128, 256), (256, 512))
PARENT = ["model.seq_len=512", "data.phase_seq_lens=[128,512]", "data.phase_starts=[0.0,0.8]", "train.batch_size=4",
          "train.steps=300", "model.rope_scaling=none", "train.keep_steps=[240]", "train.eval_tokens=16384",
          "train.seed=0"]  # fmt: skip
AT = 240


def position_losses(run: Path, step: int, kind: str, max_tokens: int) -> list[float]:
    """Mean held-out loss in each bucket of target positions, the run's checkpoint at ``step`` run at
    the final context with RoPE scaling ``kind`` (dropless; every domain's windows together)."""
    import jax
    import jax.numpy as jnp

    from moelab.model.transformer import ce_terms, forward
    from moelab.train.evaluate import eval_windows, restored

    _, cfg, store, state, _ = restored(run, step, progress=False)  # the last phase's config: 512, scaled
    m = dataclasses.replace(cfg.model, rope_scaling=kind)

    @jax.jit
    def per_token(params, ms, inputs, targets):
        hidden, _, _ = forward(params, ms, inputs, m, "dropless")
        lse, tgt = ce_terms(params, hidden, targets)
        return lse - tgt

    sums, count = np.zeros(m.seq_len), 0
    for domain in store.domains:
        rows, mask = eval_windows(store, domain, m.seq_len, max_tokens)
        for i in range(0, len(rows), 8):
            r = rows[i : i + 8]
            loss = np.asarray(
                per_token(state["params"], state["model_state"], jnp.asarray(r[:, :-1]), jnp.asarray(r[:, 1:]))
            )
            sums += (loss * mask[i : i + 8]).sum(0)
            count += len(r)
    per_pos = sums / count
    return [float(per_pos[a:b].mean()) for a, b in BUCKETS] + [float(per_pos.mean())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/moelab_rope_scaling", help="where the runs go (kept for a rerun)")
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens per domain for the buckets")
    args = ap.parse_args()

    from moelab.config import load_config
    from moelab.progress import say
    from moelab.train.branch import branch_config, start_branch
    from moelab.train.loop import train

    t0 = time.time()
    out = Path(args.out)
    runs = {"none": out / "none"}
    parent_cfg = load_config("tiny", PARENT)
    say("training the parent (none): 240 steps at 128 tokens, 60 at 512", True)
    train(parent_cfg, runs["none"], resume=runs["none"].exists(), progress=True)
    for kind in KINDS[1:]:
        runs[kind] = out / kind
        if not (runs[kind] / "events.jsonl").exists():
            cfg = branch_config(parent_cfg, AT, parent_cfg.train.steps, [f"model.rope_scaling={kind}"], name=kind)
            start_branch(runs["none"], AT, runs[kind], cfg)
        say(f"training the {kind} branch from step {AT}", True)
        train(None, runs[kind], resume=True, progress=True)

    res = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, CPU", "recipe": PARENT,
           "buckets": [list(b) for b in BUCKETS], "arms": {}}  # fmt: skip
    for kind in KINDS:
        say(f"measuring {kind}: zero-shot (step {AT}) and extended", True)
        final = json.loads((runs[kind] / "summary.json").read_text())["final_eval"]["loss"]["macro"]
        steps = json.loads((runs[kind] / "config.json").read_text())["config"]["train"]["steps"]
        res["arms"][kind] = {
            "zero_shot": position_losses(runs["none"], AT, kind, args.eval_tokens),
            "extended": position_losses(runs[kind], steps, kind, args.eval_tokens),
            "final_macro": final,
        }
    best = min(res["arms"].values(), key=lambda a: a["extended"][-1])["extended"][-1]
    near = [k for k, a in res["arms"].items() if a["extended"][-1] <= best + 0.005]
    res["chosen"] = min(near, key=lambda k: res["arms"][k]["zero_shot"][2])
    res["seconds"] = time.time() - t0
    print(f"\n{'arm':<6} {'zero-shot [0,128) [128,256) [256,512) all':>44}   {'extended':>36}   final macro")
    for kind, a in res["arms"].items():
        z, e = a["zero_shot"], a["extended"]
        print(
            f"{kind:<6} {'  '.join(f'{x:8.4f}' for x in z)}   {'  '.join(f'{x:8.4f}' for x in e)}   {a['final_macro']:.4f}"
        )
    print(f"chosen by the registered rule: {res['chosen']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rope_scaling.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
