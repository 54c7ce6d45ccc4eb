"""Do the health checks catch injected faults, and stay quiet on clean runs?

Trains the tiny model clean for three seeds and once per fault (injected at 50% of the run),
then reports for each fault the steps from injection to the first ALERT, and for the clean runs
the number of ALERTs. Target: every fault caught within 5% of the run's steps, no ALERT on the
clean runs. Writes benchmarks/results/fault_detection.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from datetime import date
from pathlib import Path

from moelab.config import load_config
from moelab.train.loop import train
from moelab.train.record import read_jsonl

RESULTS = Path(__file__).parent / "results"
FAULTS = ["lr_spike@{s}:20", "data_corruption@{s}", "router_collapse@{s}", "zloss_off@{s}:10"]


def alerts(run: Path) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "health" and e["level"] == "ALERT"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/fault_detection")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    base = [
        "train.batch_size=8",
        "train.log_every=2",
        "train.eval_every=0",
        "train.checkpoint_every=1000",
        "data.max_bytes_per_domain=2000000",
        f"train.steps={args.steps}",
        *args.overrides,
    ]
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    at = args.steps // 2
    rows = []
    for seed in range(3):
        run = root / f"clean-{seed}"
        t0 = time.time()
        train(load_config("tiny", [*base, f"train.seed={seed}"]), run, progress=False)
        found = alerts(run)
        rows.append(
            {
                "run": f"clean seed {seed}",
                "alerts": len(found),
                "checks": sorted({a["check"] for a in found}),
                "seconds": time.time() - t0,
            }
        )
        print(f"clean seed {seed}: {len(found)} ALERTs {rows[-1]['checks']}", flush=True)
    for spec in FAULTS:
        fault = spec.format(s=at)
        run = root / fault.split("@")[0]
        t0 = time.time()
        train(load_config("tiny", [*base, "train.seed=0", f"train.inject=[{fault}]"]), run, progress=False)
        after = [a for a in alerts(run) if a["step"] > at]
        delay = after[0]["step"] - at if after else None
        rows.append(
            {
                "run": fault,
                "delay_steps": delay,
                "delay_frac": None if delay is None else delay / args.steps,
                "first_check": after[0]["check"] if after else None,
                "seconds": time.time() - t0,
            }
        )
        caught = f"caught after {delay} steps by {after[0]['check']}" if after else "NOT caught"
        print(f"{fault}: {caught}", flush=True)
    print(f"\n{'run':<28} {'result':<40}")
    for r in rows:
        if "alerts" in r:
            result = f"{r['alerts']} ALERTs" + (f" ({', '.join(r['checks'])})" if r["checks"] else "")
        elif r["delay_steps"] is None:
            result = "not caught"
        else:
            result = f"caught after {r['delay_steps']} steps ({r['delay_frac']:.1%} of the run), {r['first_check']}"
        print(f"{r['run']:<28} {result:<40}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_detection.json").write_text(
        json.dumps(
            {
                "date": date.today().isoformat(),
                "machine": f"{platform.machine()} cpu",
                "steps": args.steps,
                "injected_at": at,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
