"""`moelab` commands: measurements: the train step."""

from __future__ import annotations

import argparse
import json

from moelab.errors import UsageError


def cmd_bench_train_step(args: argparse.Namespace) -> int:
    from moelab.bench import SHAPE_FLAGS, bench_train_step, print_result, shape_config

    for name in ("steps", "warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            raise UsageError(f"--{name}: must be >= {1 if name == 'steps' else 0}, got {getattr(args, name)}")
    cfg = shape_config(args.preset, **{k: getattr(args, k) for k in SHAPE_FLAGS})
    if args.overrides:
        from moelab.config import load_config

        cfg = load_config(cfg, args.overrides)
    result = bench_train_step(cfg, steps=args.steps, warmup=args.warmup)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result)
    return 0


def register(sub) -> None:
    bench = sub.add_parser("bench", help="measure: the train step's throughput, compile time, memory, MFU")
    bench = bench.add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("train-step", help="time the train step of a model shape (tiny-softmax recipe)")
    from moelab.presets import DEFAULT_PRESET, SHAPE_FLAGS

    p.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        help=f"start from this preset (default {DEFAULT_PRESET} at reference shape A; another preset keeps its own "
        "shape except the flags given)",
    )
    for name, (field, kind, default) in SHAPE_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{field} (default {default})")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="any other field, for example --set model.moe_impl=ragged (repeatable)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one (default 2)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    p.set_defaults(func=cmd_bench_train_step)
