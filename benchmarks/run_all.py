"""`make bench`: every benchmark script in this folder, one after another, each printing its figures.

Each writes benchmarks/results/<name>.json; the elapsed time of each is printed at the end.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = [
    ["moe_dispatch.py"],
    ["vs_transformers.py"],
    # issue 42: two more shapes, narrow with many experts and wide with few
    ["vs_transformers.py", "--shapes", "C,D", "--out", str(HERE / "results" / "vs_transformers_cd.json")],
    # issue 42: shape B part by part against transformers, and each whole step profiled by op
    ["vs_transformers_parts.py"],
    ["fault_detection.py"],
    ["drops_vs_context.py"],
    ["forecast_backtest.py"],
    # the clean ladders forecast_backtest.py trained, under the calibrated health thresholds
    ["health_calibration.py", "runs/bench/ladder/stdlib", "runs/bench/ladder/cheaders"],
    # issue 24, item 5: a 5% fault caught through the forecast band, and the clean runs of those ladders
    ["health_band.py"],
    # issue 24: the noise floor (issue 13's recipe, seeds of d48 and d104) and the learning-rate sweep
    ["noise_floor.py"],
    ["lr_rule.py"],
    ["store_memory.py"],
    # issue 26: the token store against the tokenizer's own encode_batch, 1 core and all; 5M documents
    ["data_pipeline.py"],
    ["first_minute.py"],
    ["cold_start.py"],
    ["memory_plan.py"],
    ["compile_depth.py"],
    ["attention_memory.py"],
    ["sample_speed.py"],
    ["memory_plan.py", "--data", "11", "--expert", "64", "--micro-batch", "1", "--out", "memory_plan_704.json"],
    # issue 27, item 5: the train step's time with a background checkpoint save in flight and without
    ["checkpoint_async.py"],
    # issue 27: accumulation, offload and remat, the step time side by side
    ["accumulate_offload.py"],
    # issue 28: RoPE scaling for a long-context phase (picks model.rope_scaling's default by the registered
    # rule), retrieval before and after the extension (on rope_scaling's runs), drops across an extension
    ["rope_scaling.py"],
    ["retrieval_extension.py"],
    ["drops_extension.py"],
]

if __name__ == "__main__":
    failed, took = [], {}
    for script, *args in SCRIPTS:
        print(f"== {script} {' '.join(args)}", flush=True)
        t0 = time.perf_counter()
        if subprocess.run([sys.executable, str(HERE / script), *args]).returncode != 0:
            failed.append(script)
        took[script] = time.perf_counter() - t0
    # the manual's results pages, from what the benchmarks just wrote
    subprocess.run([sys.executable, str(HERE / "results_pages.py")])
    print(
        "== elapsed: "
        + ", ".join(f"{s} {t / 60:.1f} min" for s, t in took.items())
        + f"; {sum(took.values()) / 60:.1f} min in all"
    )
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
