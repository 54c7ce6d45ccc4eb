"""`moelab plan memory`: what one device holds of a train step on a mesh, and whether it fits."""

from __future__ import annotations

import argparse
import json
import sys

from moelab.cli.common import add_config_args, positive_int
from moelab.config import load_config
from moelab.errors import UsageError

ROW_NAMES = {
    "parameters": "parameters (fp32) + router state",
    "optimizer": "optimizer state",
    "gradients": "gradients (fp32)",
    "gradient_accumulator": "gradient accumulator (fp32)",
    "router_statistics": "router margins (whole-batch bias)",
    "optimizer_in_flight": "optimizer state moved in (per leaf)",
    "saved_inputs": "saved layer/block inputs",
    "gathered_weights": "gathered weights (compute copy, FSDP)",
    "activations": "activations",
    "all_to_all": "all-to-all send + receive buffers",
    "logits_and_loss": "logits and loss buffers",
    "inputs": "input tokens",
}


def parse_mesh(text: str) -> tuple[int, int]:
    """``data=D,expert=X`` (either may be left out: 1)."""
    sizes = {"data": 1, "expert": 1}
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise UsageError(f"--mesh: empty; give data=D,expert=X (devices = D x X), e.g. data=8,expert=4, got {text!r}")
    given = set()
    for item in filter(None, items):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in sizes:
            raise UsageError(f"--mesh: expected data=D,expert=X, got {text!r}")
        if key.strip() in given:
            raise UsageError(f"--mesh: {key.strip()} given twice in {text!r}; give each axis once")
        given.add(key.strip())
        try:
            sizes[key.strip()] = int(value)
        except ValueError:
            raise UsageError(f"--mesh: {key.strip()} must be a whole number, got {value!r}") from None
        if sizes[key.strip()] < 1:
            raise UsageError(f"--mesh: {key.strip()} must be >= 1, got {value}")
    return sizes["data"], sizes["expert"]


def cmd_plan_memory(args: argparse.Namespace) -> int:
    # long (112 lines): a command's flags checked one after another, then the plan, the compiler check and the table, each a few lines
    data, expert = parse_mesh(args.mesh)
    if args.device is not None and args.device_memory is not None:
        raise UsageError("--device-memory: give either --device or --device-memory, not both")
    if args.device_memory is not None and not args.device_memory > 0:
        raise UsageError(f"--device-memory: must be > 0 GB, got {args.device_memory:g}")
    if args.check:  # simulated CPU devices for the compile, before JAX starts
        n = data * expert
        if "jax" in sys.modules:
            import jax

            if jax.device_count() < n:
                raise UsageError(f"--check: the mesh needs {n} devices and JAX already runs with {jax.device_count()}")
        else:
            from moelab.parallel.mesh import request_devices

            request_devices(n)
    from moelab.plan import memory, memory_check

    cfg = load_config(args.config, args.overrides)
    from moelab.errors import ConfigError
    from moelab.model.transformer import backend_problems

    if problems := backend_problems(cfg.model):  # the plan traces the model on this machine
        raise ConfigError(problems)
    if args.host_memory is not None and not args.host_memory > 0:
        raise UsageError(f"--host-memory: must be > 0 GB, got {args.host_memory:g}")
    whole = cfg.train.batch_size // (data * expert)  # a device's sequences, where the batch splits
    if args.micro_batch and cfg.train.batch_size % (data * expert) == 0 and whole % args.micro_batch:
        raise UsageError(  # train refuses a train.micro_batch that does not divide train.batch_size
            f"--micro-batch: {args.micro_batch} sequences per device does not divide the {whole} each device takes "
            f"of train.batch_size={cfg.train.batch_size}, and train would refuse it; give a divisor of {whole}"
        )
    out = memory.plan(
        cfg, data, expert, micro_batch=args.micro_batch, device=args.device, device_memory_gb=args.device_memory,
        host_memory_gb=args.host_memory,
    )  # fmt: skip
    if args.check:
        out["check"] = memory_check.compiler_check(cfg, data, expert, micro_batch=out["micro_batch"], progress=not args.json,
                                             device=args.device)  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    mesh = out["mesh"]
    accumulate = f" x {out['micro_batches']} micro-batches" if out["micro_batches"] > 1 else ""
    print(
        f"{out['config'] or args.config} on data={data} x expert={expert} ({mesh['devices']} devices, "
        f"FSDP {'on' if mesh['fsdp'] else 'off'}), {out['micro_batch']} sequences "
        f"({out['tokens_per_device']:,} tokens) per device{accumulate}, {out['compute_dtype']}, remat {out['remat']}, "
        f"offload {out['offload']}; attention {out['attention']}"
    )
    unit, div = ("GB", 1e9) if out["total"] >= 1e9 else ("MB", 1e6)
    print(f"  {'device memory, per device':<40} {unit:>10}")
    for key, value in out["rows"].items():
        if value or key in memory.ROWS[:3]:
            print(f"  {ROW_NAMES[key]:<40} {value / div:10.2f}")
    print(f"  {'workspace margin (' + str(int(memory.MARGIN * 100)) + '%)':<40} {out['workspace_margin'] / div:10.2f}")
    print(f"  {'total':<40} {out['total'] / div:10.2f}")
    if out["host_total"]:
        print(f"  {'host memory, per device':<40} {unit:>10}")
        for key, value in out["host_rows"].items():
            if value:
                print(f"  {ROW_NAMES[key]:<40} {value / div:10.2f}")
        print(f"  {'total':<40} {out['host_total'] / div:10.2f}")
    if out["whole_over_data"]:
        print(
            f"  note: data={data} divides no dimension of {', '.join(out['whole_over_data'])}: each of the "
            f"{data} data groups keeps its own copy of those (JAX shardings leave no remainder)"
        )
    if out.get("phases"):  # a long-context phase: each phase's plan, this one the largest
        each = "; ".join(f"{x['seq_len']:,} tokens x {x['micro_batch']} sequences {x['total'] / div:.2f} {unit}"
                         for x in out["phases"])  # fmt: skip
        print(f"  phases (data.phase_seq_lens, per device): {each}; shown: the {out['seq_len']:,}-token phase")
    acts = out["activations_by_remat"]
    print("  activations by remat: " + ", ".join(f"{k} {v / div:.2f} {unit}" for k, v in acts.items()))
    if out["device_memory"] is not None:
        name = out["device"] or "the device"
        verdict = "fits" if out["fits_device"] else "does NOT fit"
        top = max(out["rows"], key=out["rows"].get)
        share = out["rows"][top] / out["total"]
        print(
            f"  device: {verdict} in {name} ({out['device_memory'] / 1e9:g} GB); the largest row: {ROW_NAMES[top]}, "
            f"{share:.0%}"
        )
        if out["host_total"]:
            if out["host_memory"] is None:
                print("  host: no host memory known for this device; give --host-memory GB")
            else:
                verdict = "fits" if out["fits_host"] else "does NOT fit"
                print(f"  host: {verdict} in {out['host_memory'] / 1e9:g} GB per device ({out['host_note']})")
        mb = out.get("max_micro_batch")
        print(
            f"  largest micro-batch that fits: {mb} sequences per device"
            if mb
            else "  no micro-batch fits: not even one sequence per device"
        )
        acc = out.get("accumulation")
        if acc:
            print(
                f"  the whole batch fits through gradient accumulation: --set train.micro_batch={acc['train.micro_batch']} "
                f"({acc['micro_batches']} micro-batches of {acc['micro_batch']} sequences per device)"
            )
        if out["fits"] is not None:
            print(f"  verdict: {'fits' if out['fits'] else 'does NOT fit'}")
    if "check" in out:
        c = out["check"]
        print(
            f"  compiler check ({c['compute_dtype']}; layers {c['layers_compiled']} compiled, scaled to "
            f"{cfg.model.n_layers}): plan {c['plan_total'] / 1e9:.3f} GB, XLA {c['compiler_total'] / 1e9:.3f} GB, "
            f"ratio {c['ratio']:.3f} ({'within' if c['within_15pct'] else 'OUTSIDE'} 15%)"
        )
        for line in c["unconfirmed"]:
            print(f"  not confirmable on CPU: {line}")
        if c["global_dispatch"]:
            print("  note: each device dispatches the whole batch here (dropless or capacity_group 0 without EP);")
            print("  the plan counts that whole, an upper bound")
    return 0


def register(sub) -> None:
    plan = sub.add_parser("plan", help="plans before booking machines: memory per device")
    plans = plan.add_subparsers(dest="plan_command", required=True)
    p = plans.add_parser(
        "memory",
        help="per-device memory of a train step on a mesh: parameters, optimizer, gradients, activations, buffers",
    )
    add_config_args(p)
    p.add_argument("--mesh", required=True, help="the mesh, data=D,expert=X (devices = D x X)")
    p.add_argument("--device", help="H100, H200, GB200, TPU-v5p or TPU-v6e: its memory is the budget")
    p.add_argument("--device-memory", type=float, help="the budget in GB (1e9 bytes), for a device not in the table")
    p.add_argument(
        "--host-memory",
        type=float,
        help="host memory per device in GB, for offloaded state "
        "(default: the device table's, e.g. GB200: a Grace CPU's 480 GB shared by 2 GPUs)",
    )
    p.add_argument(
        "--micro-batch",
        type=positive_int,
        help="sequences per device per micro-step (default train.micro_batch, else the whole batch)",
    )
    p.add_argument("--check", action="store_true", help="compile the step on simulated CPU devices and compare")
    p.add_argument("--json", action="store_true", help="one JSON object (with a boolean `fits`)")
    p.set_defaults(func=cmd_plan_memory)
