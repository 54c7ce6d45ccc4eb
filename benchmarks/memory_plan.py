"""The memory plan against the compiler at Marin's hero width, and the plans for Marin's mesh.

1. Compiler check: the hero's width (d 6144, 384 experts, top 8, vocab 128,256, seq 4096) with 1
   and 2 layers, compiled ahead of time for 64 simulated CPU devices (data 2 x expert 32, FSDP on,
   2 sequences per device) on abstract inputs; XLA's per-device totals extended to the hero's 48
   layers beside the plan's (both in fp32: see plan/memory.py). The prediction, committed
   before the first run: benchmarks/results/memory_plan_prediction.md.
2. Plans (no compile): the hero on Marin's mesh (11 racks x EP64 = 704 GB200s, 16 sequences per
   GPU) with today's rules and with FSDP, with and without remat; a ladder rung on one 8-GPU node.

Writes benchmarks/results/memory_plan.json. Run: python benchmarks/memory_plan.py [--data D --expert X
--micro-batch B --out NAME]; `make bench` also runs it on Marin's own mesh (11 x 64 = 704 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
HERO_WIDTH = ["model.n_layers=48"]  # the preset's depth; the check compiles 1- and 2-layer copies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=int, default=2)
    ap.add_argument("--expert", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--out", default="memory_plan.json", help="the file in benchmarks/results/")
    args = ap.parse_args()
    n = args.data * args.expert
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    from moelab.config import load_config
    from moelab.plan import memory, memory_check

    out = {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "cpus": os.cpu_count()}
    hero = load_config("marin-535b-a23b", HERO_WIDTH)
    t0 = time.perf_counter()
    # the whole batch of the check is micro-batch x devices (gradient accumulation is checked on tiny shapes)
    small_batch = load_config(hero, [f"train.batch_size={args.micro_batch * n}"])
    check = memory_check.compiler_check(
        small_batch, args.data, args.expert, micro_batch=args.micro_batch, progress=True
    )
    check["seconds"] = time.perf_counter() - t0
    check["mesh"] = {"data": args.data, "expert": args.expert, "micro_batch": args.micro_batch}
    out["check"] = check
    print(
        f"hero width, {args.data} x {args.expert} devices, {args.micro_batch} sequences each: plan "
        f"{check['plan_total'] / 1e9:.2f} GB, XLA {check['compiler_total'] / 1e9:.2f} GB (layers "
        f"{check['layers_compiled']} scaled to 48), ratio {check['ratio']:.3f} in {check['seconds']:.0f} s",
        flush=True,
    )
    plans = {}
    before = ["train.offload=none", "model.remat=layer"]  # as moelab planned it before issue 27
    rung = load_config("marin-ladder-d768")
    for name, cfg, mesh, kw in [
        ("hero, Marin's mesh, FSDP, remat layer, ce_chunk 8192 (before issue 27)", load_config(hero, before),
         (11, 64), {}),
        ("hero, Marin's mesh, Marin's strategy without offload", load_config(hero, ["train.offload=none"]), (11, 64), {}),
        ("hero, Marin's mesh, Marin's strategy (the preset)", hero, (11, 64), {}),
        ("ladder d768, one 8 x H100 node, the whole batch at once", rung, (8, 1), {}),
        ("ladder d768, one 8 x H100 node, 2 micro-batches", load_config(rung, ["train.micro_batch=512"]), (8, 1), {}),
    ]:  # fmt: skip
        device = "H100" if "node" in name else "GB200"
        p = memory.plan(cfg, *mesh, device=device, **kw)
        plans[name] = p
        acc = p.get("accumulation")
        print(
            f"{name}: device {p['total'] / 1e9:.1f} GB of {p['device_memory'] / 1e9:g} ({device}), host "
            f"{p['host_total'] / 1e9:.1f} GB of {p['host_memory'] / 1e9:g}: {'fits' if p['fits'] else 'does not fit'}; "
            f"largest micro-batch {p['max_micro_batch']}"
            + (f"; fits through train.micro_batch={acc['train.micro_batch']}" if acc else "")
            + f"; activations {p['rows']['activations'] / 1e9:.1f} GB",
            flush=True,
        )
    out["plans"] = plans
    (HERE / "results" / args.out).write_text(json.dumps(out, indent=1))
    plot(plans, HERE / "results" / Path(args.out).with_suffix(".svg").name)
    return 0


def plot(plans: dict, path: Path) -> None:
    """Per-device memory of each plan, row by row, against its device's memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    rows = ["parameters", "optimizer", "gradients", "gradient_accumulator", "router_statistics", "gathered_weights",
            "activations", "all_to_all", "logits_and_loss"]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = list(plans)
    left = [0.0] * len(names)
    for i, row in enumerate(rows):
        vals = [plans[n]["rows"][row] / 1e9 for n in names]
        ax.barh(range(len(names)), vals, left=left, color=f"C{i}", label=row.replace("_", " "))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    cap = 700.0  # GB: longer bars are cut here, their totals written beside them
    for j, n in enumerate(names):
        mem = plans[n]["device_memory"] / 1e9
        ax.plot([mem, mem], [j - 0.45, j + 0.45], color="black", lw=2)
        total = plans[n]["counted"] / 1e9
        host = plans[n].get("host_total", 0) / 1e9
        ax.text(min(total, cap) + 5, j, f"{total:,.0f} GB" + (" (cut)" if total > cap else "")
                + (f"; host {host:,.0f} GB" if host else ""), va="center", fontsize=6)  # fmt: skip
    ax.set_xlim(0, cap + 120)
    ax.set_yticks(range(len(names)), [n.replace(", ", ",\n", 1) for n in names], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("GB per device, without the 10% margin; black bar: the device's memory")
    ax.set_title("What one device holds of a train step (moelab plan memory)", fontsize=10)
    ax.legend(fontsize=6, ncol=7, loc="upper center", bbox_to_anchor=(0.45, -0.16))
    ax.grid(alpha=0.3, axis="x")
    fig.savefig(path, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
