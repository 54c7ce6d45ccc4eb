"""Train the runs of issue 37's calibration (benchmarks/forecast_calibration.py reads them).

Per development corpus (benchmarks/dev_corpora.py): the calibration ladder (ladders/calib.yaml: widths
16-56, seeds 0 and 1), a third seed of the two top rungs, and the width-104 target once. Then, on the
stdlib only, the stability runs: parameter seeds 2-5 of every rung (three two-seed ladders in all),
and data orders 1 and 2 (train.data_seed) of seeds 0 and 1 (three data orders in all).
Runs go to runs/bench/calib/CORPUS/NAME and are reused when complete (a killed job resumes from the
run's last checkpoint). On 2 cores: about 9 minutes per corpus, 20 for the stability runs.

    python benchmarks/calib_train.py [--corpora stdlib cheaders ...] [--no-stability] [--extra-target 112]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "ladders" / "calib.yaml"
TOP_SEEDS = 3  # seeds of the two top rungs
PARAM_SEEDS = 6  # stability: three ladders of two parameter seeds
DATA_SEEDS = 3  # stability: three data orders of the seed-0/1 ladder


def jobs(corpus: str, stability: bool, extra_targets: tuple[int, ...] = ()) -> list[tuple[str, object]]:
    import dataclasses

    from dev_corpora import sources_override
    from moelab.config import load_config
    from moelab.ladder.plan import load_ladder, rung_config

    lad = load_ladder(LADDER)
    data = sources_override(corpus)
    out = []
    n = len(lad.widths)
    for i, d in enumerate(lad.widths):
        base = load_config(rung_config(lad, i), data)
        seeds = TOP_SEEDS if i >= n - 2 else lad.seeds
        for k in range(seeds):
            out.append((f"d{d}" + (f"-s{k}" if k else ""), load_config(base, [f"train.seed={k}"])))
    out.append((f"d{lad.target_width}", load_config(rung_config(lad, n), data)))
    for w in extra_targets:  # another target by the same rules (d112: 10.0x the d56 rung's training FLOPs)
        out.append((f"d{w}", load_config(rung_config(dataclasses.replace(lad, target_width=w), n), data)))
    if stability:
        for i, d in enumerate(lad.widths):
            base = load_config(rung_config(lad, i), data)
            for k in range(TOP_SEEDS if i >= n - 2 else lad.seeds, PARAM_SEEDS):
                out.append((f"d{d}-s{k}", load_config(base, [f"train.seed={k}"])))
            for o in range(1, DATA_SEEDS):
                for k in range(lad.seeds):
                    name = f"d{d}" + (f"-s{k}" if k else "") + f"-o{o}"
                    out.append((name, load_config(base, [f"train.seed={k}", f"train.data_seed={1000 + o}"])))
    return out


def main() -> None:
    from dev_corpora import CORPORA, available

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "calib"))
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA))
    ap.add_argument("--no-stability", action="store_true")
    ap.add_argument(
        "--extra-target", type=int, nargs="*", default=[], help="more target widths (e.g. 112), once per corpus"
    )
    args = ap.parse_args()
    todo = []
    for corpus in args.corpora:
        why = available(corpus)
        if why:
            print(f"skipped: {why}", flush=True)
            continue
        todo += [(corpus, name, cfg) for name, cfg in jobs(corpus, False, tuple(args.extra_target))]
    if not args.no_stability and "stdlib" in args.corpora:
        base = {name for _, name, _ in todo}
        todo += [("stdlib", name, cfg) for name, cfg in jobs("stdlib", True) if name not in base]
    run_jobs(todo, Path(args.out))


def run_jobs(todo: list[tuple[str, str, object]], root: Path) -> None:
    """Train (corpus, name, config) jobs in order into root/CORPUS/NAME: a complete run is reused, a killed
    one resumes from its last checkpoint, and a corpus whose run fails is skipped for the rest."""
    from moelab.train.loop import train

    failed = set()
    for i, (corpus, name, cfg) in enumerate(todo):
        out = root / corpus / name
        if (out / "summary.json").exists() or corpus in failed:
            continue
        t0 = time.time()
        print(f"[{i + 1}/{len(todo)}] {corpus}/{name}: {cfg.train.steps} steps", flush=True)
        try:
            train(cfg, out, resume=True, progress=False)
        except Exception as exc:  # one corpus that cannot be read stops that corpus, not the others
            print(
                f"[{i + 1}/{len(todo)}] {corpus}/{name}: FAILED ({type(exc).__name__}: {exc}); the rest of {corpus} skipped",
                flush=True,
            )
            failed.add(corpus)
            continue
        print(f"[{i + 1}/{len(todo)}] {corpus}/{name}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
