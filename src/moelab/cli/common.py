"""What the command modules share: the config arguments, number checks and the printing of a run's
summary and a ladder's plan; what a refused command created, removed."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

OUTPUT_ARGS = ("out", "prefix", "site")  # the arguments that name where a command writes
CLOCK_SLACK_NS = 2_000_000_000  # a file's time stamp lags the clock by up to a tick; a copy can round it down


def add_config_args(p: argparse.ArgumentParser, optional: str = "") -> None:
    if optional:
        p.add_argument("config", nargs="?", help=f"a preset name (see `moelab presets`) or a YAML file{optional}")
    else:
        p.add_argument("config", help="a preset name (see `moelab presets`) or a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field, for example --set model.top_k=4 (repeatable)",
    )


def new_outputs(args: argparse.Namespace) -> list[tuple[Path, Path]]:
    """What this command may create that does not exist yet: for each output argument (--out,
    --prefix, --site) naming a missing path, (the path, the outermost missing folder on the way to it:
    what ``mkdir(parents=True)`` makes first). A path that exists already is never listed."""
    found = []
    for name in OUTPUT_ARGS:
        value = getattr(args, name, None)
        if not isinstance(value, str) or not value:
            continue
        leaf = top = Path(os.path.abspath(value))
        if os.path.lexists(leaf):
            continue
        while not os.path.lexists(top.parent):
            top = top.parent
        if (leaf, top) not in found:
            found.append((leaf, top))
    return found


# what says a command got past its checks and did work worth keeping (a refusal after it, say a
# forecast that cannot be refit mid-run, leaves the run to resume): a measurement, a committed
# checkpoint, a lab step's status
WORK_DONE = ("metrics.jsonl", "commit_success.txt", ".status")


def _removable(path: Path, since_ns: int) -> bool:
    """Whether everything at ``path`` (links not followed) was written since ``since_ns`` and none of
    it records work done."""
    if os.lstat(path).st_mtime_ns < since_ns or path.name.endswith(WORK_DONE):
        return False
    if not path.is_dir() or path.is_symlink():
        return True
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            if name.endswith(WORK_DONE) or os.lstat(os.path.join(root, name)).st_mtime_ns < since_ns:
                return False
    return True


def remove_new_outputs(paths: list[tuple[Path, Path]], started_ns: int) -> None:
    """After a refusal: remove what the command created (``new_outputs``, taken before it ran), so
    that nothing half-written stays: the path itself with what is in it, then each parent folder it
    made, while empty (a parent shared with another command running beside it stays with its work). A
    path holding anything older than the command (not written by it), or a record of work done
    (WORK_DONE), is left as it is."""
    for leaf, top in paths:
        try:
            if os.path.lexists(leaf):
                if not _removable(leaf, started_ns - CLOCK_SLACK_NS):
                    continue
                if leaf.is_dir() and not leaf.is_symlink():
                    shutil.rmtree(leaf)
                else:
                    leaf.unlink()
            for parent in leaf.parents:
                if parent == top.parent:
                    break
                if os.path.lexists(parent):
                    parent.rmdir()  # only while empty: OSError otherwise, and what is above stays too
        except OSError:  # cleaning up is a courtesy: the refusal's own line is what the user reads
            continue


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def print_summary(summary: dict) -> None:
    print(f"\nrun: {summary['run']}  (config.json, metrics.jsonl, events.jsonl, summary.json, ckpt/)")
    if "final_eval" in summary:
        first, final = summary["first_eval"], summary["final_eval"]
        print(f"  {'held-out domain':<16} {'loss at 0':>10} {'final loss':>11} {'dropless':>9} {'bits/byte':>10}")
        for d in final["loss"]:
            print(
                f"  {d:<16} {first['loss'][d]:>10.4f} {final['loss'][d]:>11.4f} {final['loss_dropless'][d]:>9.4f}"
                f" {final['bpb'][d]:>10.4f}"
            )
    if summary.get("final_tasks"):
        first = summary.get("first_tasks", {})
        print(f"  {'task':<16} {'acc at 0':>10} {'final acc':>11} {'acc_norm':>9} {'chance':>8} {'bits/byte':>10}")
        for name, t in summary["final_tasks"].items():
            if "acc" in t:
                at0 = first.get(name, {}).get("acc", float("nan"))
                print(
                    f"  {name:<16} {at0:>10.3f} {t['acc']:>11.3f} {t['acc_norm']:>9.3f} {t['chance']:>8.3f} {t['bpb']:>10.4f}"
                )
            else:
                print(f"  {name:<16} {'':>10} {'':>11} {'':>9} {'':>8} {t['bpb']:>10.4f}")
    if "final_loss" in summary:
        n_dev = summary.get("devices", 1)
        per = f" ({summary['tokens_per_s_per_device']:,.0f} per device)" if n_dev > 1 else ""
        source = summary.get("peak_source", "the measured matmul peak")
        speed = (
            f"{summary['tokens_per_s']:,.0f} tokens/s{per}; MFU {summary['mfu']:.1%} of {source}"
            if "tokens_per_s" in summary
            else "speed not measured (every step compiled; run more steps to time them)"
        )
        print(
            f"  final train loss {summary['final_loss']:.4f}; dropped {summary['dropped_frac']:.4f} and spilled "
            f"{summary['spilled_frac']:.4f} of assignments; {speed}"
        )


def print_plan(ladder, flops_per_s: float | None = None, as_json: bool = False) -> None:
    """The rungs (and target) of a ladder: shapes, parameters, tokens, steps, FLOPs, time here."""
    from moelab import accounting
    from moelab.cache import matmul_peak
    from moelab.ladder.plan import plan

    assumed_mfu = 0.2  # what the tiny demo reaches on 2 CPU cores
    rate = flops_per_s or assumed_mfu * matmul_peak()
    rows = plan(ladder, rate)
    if as_json:
        print(json.dumps({"ladder": ladder.name, "flops_per_s": rate, "rungs": rows}, indent=1))
        return
    h = accounting.human
    print(
        f"{ladder.name}: recipe {ladder.recipe}, head_dim {ladder.head_dim}; time at {rate:.3g} FLOP/s"
        + ("" if flops_per_s else f" ({assumed_mfu:.0%} of this machine's measured matmul peak)")
    )
    print(
        f"  {'rung':<13} {'layers':>6} {'heads':>5} {'kv l/g':>7} {'batch':>6} {'total':>8} {'active':>8} {'tokens':>9}"
        f" {'tok/act':>7} {'steps':>7} {'FLOPs':>9} {'time':>9}"
    )
    for r in rows:
        t = r["seconds"]
        when = (
            f"{t / 86400 / 365:.3g} y"
            if t > 86400 * 365
            else f"{t / 86400:.1f} d"
            if t > 172800
            else f"{t / 3600:.1f} h"
            if t > 3600
            else f"{t / 60:.1f} min"
            if t > 60
            else f"{t:.0f} s"
        )
        print(
            f"  {r['rung']:<13} {r['n_layers']:>6} {r['n_heads']:>5} {r['kv_heads_local']:>3}/{r['kv_heads_global']:<3}"
            f" {r['batch_size']:>6} {h(r['total_params']):>8} {h(r['active_params']):>8} {r['tokens']:>9.3g}"
            f" {r['tokens_per_active_param']:>7.0f} {r['steps']:>7} {r['train_flops']:>9.3g} {when:>9}"
        )
    if getattr(ladder, "seeds", 1) > 1:
        top_k = getattr(ladder, "top_seeds", 0)
        top = f", the widest {top_k} times" if top_k > ladder.seeds else ""
        print(f"  each rung runs {ladder.seeds} times (seeds 0-{ladder.seeds - 1}){top}; the target once")
