"""Long-context retrieval before and after a context-extension phase (issue 28, item 5).

The runs of benchmarks/rope_scaling.py (tiny model, 240 steps at 128 tokens a sequence, then 60 at
512; run that first): the checkpoint at step 240 (before the extension) and the `ntk` arm's at step
300 (after it; ntk is model.rope_scaling's default) are scored on the retrieval task
(moelab.eval.builtin: a key planted at a depth of held-out code, asked for at the end, chance 25%)
at 128, 256 and 512 tokens and depths 0.1, 0.5 and 0.9, both as the run ends (512 tokens, RoPE ntk
x4). The prediction was committed before the first run: results/retrieval_extension_prediction.md.
Writes benchmarks/results/retrieval_extension.json.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LENGTHS, DEPTHS, N = (128, 256, 512), (0.1, 0.5, 0.9), 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="/tmp/moelab_rope_scaling", help="benchmarks/rope_scaling.py's --out")
    args = ap.parse_args()
    from moelab.train.run_tasks import evaluate_retrieval

    runs = Path(args.runs)
    res = {"date": date.today().isoformat(), "lengths": LENGTHS, "depths": DEPTHS, "n": N, "chance": 0.25}
    for name, run, step in (("before (step 240)", runs / "none", 240), ("after (ntk, step 300)", runs / "ntk", 300)):
        got = evaluate_retrieval(run, LENGTHS, DEPTHS, N, step=step)
        res[name] = got["acc"]
    print(f"\nretrieval accuracy ({N} examples a cell, chance 0.25), length@depth:")
    cells = list(res["before (step 240)"])
    print(f"  {'':<24}" + "".join(f"{c:>10}" for c in cells))
    for name in ("before (step 240)", "after (ntk, step 300)"):
        print(f"  {name:<24}" + "".join(f"{res[name][c]:>10.3f}" for c in cells))
    for name in ("before (step 240)", "after (ntk, step 300)"):
        per = {n: sum(res[name][f"{n}@{d:g}"] for d in DEPTHS) / len(DEPTHS) for n in LENGTHS}
        res[f"{name} by length"] = per
        print(f"  {name} by length: " + ", ".join(f"{n}: {v:.3f}" for n, v in per.items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "retrieval_extension.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
