"""`moelab ...`: the command line. Every command that takes a config takes ``--set`` overrides.

A config or input the user can fix is refused with one line per problem and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from moelab.config import ConfigError, load_config, to_dict
from moelab.errors import UsageError
from moelab.ladder import DEFAULT_LAW, LAW_CHOICES


def _add_config_args(p: argparse.ArgumentParser, optional: str = "") -> None:
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


def cmd_flops(args: argparse.Namespace) -> int:
    from moelab import accounting

    cfg = load_config(args.config, args.overrides)
    if args.tokens is not None and (args.steps is not None or args.batch_tokens is not None):
        raise UsageError("--tokens: give either --tokens or --steps with --batch-tokens, not both")
    if args.tokens is not None:
        tokens = args.tokens
    elif args.steps is not None or args.batch_tokens is not None:
        steps = args.steps if args.steps is not None else cfg.train.steps
        batch_tokens = args.batch_tokens if args.batch_tokens is not None else cfg.train.batch_size * cfg.model.seq_len
        tokens = steps * batch_tokens
    else:
        tokens = accounting.run_tokens(cfg)
    if tokens <= 0:
        raise UsageError(f"--tokens: must be > 0, got {tokens:g}")
    out = accounting.count(cfg).train(tokens)
    out["config"] = cfg.name or args.config
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    h = accounting.human
    rows = [
        ("total parameters", h(out["total_params"])),
        ("  without embeddings and head", h(out["total_params_nonembedding"])),
        ("active parameters (Marin)", h(out["active_params"])),
        ("  with embeddings and head", h(out["active_params_with_embeddings"])),
        ("norm parameters (not counted)", h(out["norm_params"])),
        ("forward FLOPs / token", f"{out['forward_flops_per_token']:.4g}"),
        ("  without LM head", f"{out['forward_flops_per_token_without_lm_head']:.4g}"),
        ("tokens", f"{out['tokens']:.4g}"),
        ("training FLOPs (3 x forward)", f"{out['train_flops']:.4g}"),
        ("  without LM head", f"{out['train_flops_without_lm_head']:.4g}"),
        ("6 N D", f"{out['six_n_d']:.4g}"),
    ]
    print(f"{out['config']}")
    for name, value in rows:
        print(f"  {name:<32} {value:>12}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from moelab.config import config_hash

    cfg = load_config(args.config, args.overrides)
    print(json.dumps({"hash": config_hash(cfg), **to_dict(cfg)}, indent=1))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from moelab import accounting
    from moelab.presets import PRESETS

    for name in PRESETS:
        a = accounting.count(load_config(name))
        print(f"{name:<22} total {accounting.human(a.total_params):>8}  active {accounting.human(a.active_params):>8}")
    return 0


def _train_config(args: argparse.Namespace):
    from moelab.config import replace

    if args.config is None:  # `moelab train --resume --out DIR`: the run's own (perhaps re-planned) config
        from moelab.train.loop import load_run_config

        if not args.resume:
            raise UsageError("config: give a preset or a YAML file (only --resume may leave it out)")
        given = [n for n in ("steps", "seed", "data", "inject") if getattr(args, n)] + (
            ["set"] if args.overrides else []
        )
        if given:
            raise UsageError(
                f"--{given[0]}: resuming without a config takes the run's own; give the config to change it"
            )
        return load_run_config(args.out)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.inject:
        overrides.append("train.inject=[" + ", ".join(args.inject) + "]")
    cfg = load_config(args.config, overrides)
    if args.data:
        cfg = replace(cfg, data={"sources": tuple(args.data)})
    return cfg


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ([args.config] if args.config else []) + ["--out", args.out]
    if args.steps is not None:
        out += ["--steps", str(args.steps)]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    for d in args.data or []:
        out += ["--data", d]
    for o in args.overrides:
        out += ["--set", o]
    for t in args.tracker or []:
        out += ["--tracker", t]
    for spec in args.inject or []:
        out += ["--inject", spec]
    if args.resume:
        out.append("--resume")
    if args.devices:
        out += ["--devices", str(args.devices)]
    if args.quiet:
        out.append("--quiet")
    return out


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
    if "final_loss" in summary:
        print(
            f"  final train loss {summary['final_loss']:.4f}; dropped {summary['dropped_frac']:.4f} and spilled "
            f"{summary['spilled_frac']:.4f} of assignments; {summary['tokens_per_s']:,.0f} tokens/s; "
            f"MFU {summary['mfu']:.1%} of the measured matmul peak"
        )


def _join_job(args: argparse.Namespace) -> None:
    """Join a multi-process job through ``jax.distributed`` (flags, or MOELAB_COORDINATOR,
    MOELAB_NUM_PROCESSES and MOELAB_PROCESS_ID)."""
    import os

    coordinator = args.coordinator or os.environ.get("MOELAB_COORDINATOR")
    if not coordinator:
        return
    try:
        n = int(args.num_processes or os.environ.get("MOELAB_NUM_PROCESSES", ""))
        pid = int(args.process_id if args.process_id is not None else os.environ.get("MOELAB_PROCESS_ID", ""))
    except ValueError:
        raise UsageError("--num-processes and --process-id: give both (or MOELAB_NUM_PROCESSES and MOELAB_PROCESS_ID) "
                         "with --coordinator") from None  # fmt: skip
    if not 0 <= pid < n:
        raise UsageError(f"--process-id: {pid} is not in [0, {n})")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices talk over gloo; GPUs ignore it
    jax.distributed.initialize(coordinator, n, pid)


def cmd_train(args: argparse.Namespace) -> int:
    if args.devices:
        from moelab.parallel.mesh import MeshError, request_devices

        if args.devices < 1:
            raise UsageError(f"--devices: must be >= 1, got {args.devices}")
        try:
            request_devices(args.devices)  # before JAX loads
        except MeshError as exc:
            raise UsageError(str(exc)) from None
    cfg = _train_config(args)  # refuse a bad config before anything starts
    _join_job(args)
    if args.max_restarts:
        from moelab.train.supervise import supervise

        return supervise(_child_args(args), args.out, args.max_restarts)
    from moelab.train.loop import train
    from moelab.train.trackers import make_trackers

    summary = train(
        cfg,
        args.out,
        resume=args.resume,
        progress=not args.quiet,
        trackers=make_trackers(args.tracker or [], cfg, args.out),
    )
    print_summary(summary)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json as _json

    from moelab.train.evaluate import eval_noise, evaluate_run

    if args.noise:
        if not args.json:
            print(
                f"evaluating {args.run_dir} on up to {args.noise} disjoint sets of held-out windows ...",
                file=sys.stderr,
            )
        res = eval_noise(args.run_dir, args.checkpoint, sets=args.noise, progress=not args.json, against=args.against)
        if args.json:
            print(_json.dumps(res, indent=1))
            return 0
        print(
            f"{args.run_dir} at step {res['step']}: held-out loss (dropless, macro) on {res['sets']} disjoint window "
            f"sets of {res['eval_tokens_per_domain']} tokens per domain: {' '.join(f'{x:.4f}' for x in res['macro'])}"
        )
        print(f"  the noise of one evaluation: {res['relative_sd']:.3%} of the loss (standard deviation across sets)")
        if "paired_relative_sd" in res:
            print(
                f"  relative to {res['paired_with']} on the same windows: {res['paired_relative_sd']:.3%} (what does not cancel)"
            )
        for d, v in res["per_domain_relative_sd"].items():
            print(f"  {d:<16} {v:.3%}")
        for d in res["read_whole"]:
            print(f"  {d:<16} one set: the evaluation reads its whole held-out stream")
        return 0
    res = evaluate_run(args.run_dir, args.checkpoint, progress=not args.json)
    if args.json:
        print(_json.dumps(res, indent=1))
        return 0
    print(f"{args.run_dir} at step {res['step']}")
    print(f"  {'domain':<16} {'loss':>8} {'bits/byte':>10} {'dropless':>9} {'bits/byte':>10}")
    for d in res["loss"]:
        print(
            f"  {d:<16} {res['loss'][d]:>8.4f} {res['bpb'][d]:>10.4f} {res['loss_dropless'][d]:>9.4f}"
            f" {res['bpb_dropless'][d]:>10.4f}"
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from moelab.lab.commands import dry_run, load_experiment
    from moelab.lab.executor import Runner

    exp = load_experiment(args.experiment)
    if args.ray_address:
        import os

        os.environ["MOELAB_RAY_ADDRESS"] = args.ray_address
    runner = Runner(
        exp, args.prefix, only=args.only, force=args.force, max_concurrent=args.max_concurrent, backend=args.backend
    )
    if args.dry_run:
        print(f"{exp.name}: {exp.title}  (nothing runs with --dry-run)")
        print(f"  {'step':<22} {'status':<8} {'FLOPs':>10} {'est. time':>10}  output")
        for r in dry_run(runner):
            flops = f"{r['flops']:.3g}" if r["flops"] else "-"
            secs = f"{r['seconds']:.0f}s" if r["seconds"] else "-"
            print(f"  {r['step']:<22} {r['status']:<8} {flops:>10} {secs:>10}  {r['output']}")
        return 0
    print(f"{exp.name}: {exp.title}")
    result = runner.run()
    for v in (result["verdict"], result["post_hoc_verdict"]):
        if v:
            print(
                f"verdict: {v['verdict']} ({v['why']}; predicted {v['predicted']:g}, prediction v{v['prediction_version']})"
            )
    failed = [k for k, x in result["steps"].items() if x != "SUCCESS"]
    if failed:
        print(f"not finished: {', '.join(failed)}; the journal has the tracebacks; run again to resume")
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from moelab.lab.commands import status_rows

    rows = status_rows(Path(args.prefix))
    if not rows:
        print(f"no experiments under {args.prefix}")
    for r in rows:
        late = "".join(f"; {v}" for v in r["post_hoc_verdicts"])
        print(f"{r['experiment']} (v{r['version']}): {r['title']}  verdict: {r['verdict'] or '-'}{late}")
        for s in r["steps"]:
            print(f"  {s['status']:<8} {s['name']:<22} {args.prefix}/{s['dir']}")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    from moelab.lab.commands import issue_markdown, load_experiment

    print(issue_markdown(load_experiment(args.experiment), Path(args.prefix)), end="")
    return 0


def cmd_change(args: argparse.Namespace) -> int:
    from moelab.lab.commands import load_experiment
    from moelab.lab.journal import Journal

    exp = load_experiment(args.experiment)
    journal = Journal(Path(args.prefix) / "experiments" / exp.name / "journal.jsonl")
    rec = journal.change(args.what, args.why, args.step)
    print(f"recorded in {journal.path}: {rec['what']} (why: {rec['why']})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from moelab.report.site import build_site

    index = build_site(Path(args.prefix), Path(args.out))
    print(f"site: {index}")
    return 0


def cmd_ladder_fit_nd(args: argparse.Namespace) -> int:
    import csv

    import numpy as np

    from moelab.ladder.fits import fit_chinchilla

    path = Path(args.csv)
    if not path.is_file():
        raise UsageError(f"{path}: no such CSV file")
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for flag, col in (("--n-col", args.n_col), ("--flops-col", args.flops_col), ("--loss-col", args.loss_col)):
        if not rows or col not in rows[0]:
            raise UsageError(f"{path}: no column {col!r} ({flag}); columns: {', '.join(rows[0]) if rows else 'none'}")
    try:
        n = np.array([float(r[args.n_col]) for r in rows])
        c = np.array([float(r[args.flops_col]) for r in rows])
        loss = np.array([float(r[args.loss_col]) for r in rows])
    except ValueError as exc:
        raise UsageError(f"{path}: a value is not a number ({exc})") from None
    if args.exclude_top:
        keep = np.argsort(loss, kind="stable")[: len(loss) - args.exclude_top]
        n, c, loss = n[keep], c[keep], loss[keep]
    fit = fit_chinchilla(n, c / (6 * n), loss, delta=args.delta, method=args.method)
    out = {
        "E": fit.E,
        "A": fit.A,
        "B": fit.B,
        "alpha": fit.alpha,
        "beta": fit.beta,
        "objective": fit.objective,
        "points": int(len(loss)),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"L(N, D) = {fit.E:.4f} + {fit.A:.1f} / N^{fit.alpha:.4f} + {fit.B:.1f} / D^{fit.beta:.4f}"
            f"   (D = C / 6N; {len(loss)} points; summed Huber objective {fit.objective:.7f})"
        )
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from moelab.ladder.health import check_run, ladder_trajectories
    from moelab.train.loop import load_run_config

    run = Path(args.run_dir)
    load_run_config(run)  # refuses a directory that is not a run
    if args.forecast:  # the user's choice of forecast, not a record of the run's
        forecast_path = Path(args.forecast)
        if not forecast_path.is_file():
            raise UsageError(f"{forecast_path}: no such forecast file")
        forecast = json.loads(forecast_path.read_text())
    else:  # the run's newest registered forecast, refused if it changed after it was registered
        from moelab.train.record import RunDir

        forecast = RunDir(run).verified_forecast()
    ladder = None
    if args.ladder:
        try:
            ladder = ladder_trajectories(args.ladder)
        except ValueError as exc:
            raise UsageError(f"--ladder: {exc}") from None
    _, checks = check_run(run, forecast, ladder)
    rows = [{"check": name, **{k: c[k] for k in ("level", "evidence", "first_alert")}} for name, c in checks.items()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{run}: health")
    for r in rows:
        alert = f" (first ALERT at step {r['first_alert']})" if r["first_alert"] is not None else ""
        print(f"  {r['level']:<6} {r['check']:<20} {r['evidence']}{alert}")
    return 0


def print_plan(ladder, flops_per_s: float | None = None, as_json: bool = False) -> None:
    """The rungs (and target) of a ladder: shapes, parameters, tokens, steps, FLOPs, time here."""
    from moelab import accounting
    from moelab.ladder.plan import plan
    from moelab.train.record import matmul_peak

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


def cmd_ladder_plan(args: argparse.Namespace) -> int:
    from moelab.ladder.plan import load_ladder

    print_plan(load_ladder(args.ladder), args.flops_per_s, args.json)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def cmd_ladder_forecast(args: argparse.Namespace) -> int:
    from moelab.ladder.forecast import forecast

    cfg = load_config(args.target, args.overrides)
    fc = forecast(args.ladder, cfg, law=args.law, e=args.e, n_boot=args.n_boot, target_name=cfg.name or args.target,
                  log=lambda text: print(text, file=sys.stderr))  # fmt: skip
    tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
    try:
        tmp.write_text(json.dumps(fc, indent=1))
        tmp.replace(args.out)
    except OSError as exc:
        raise UsageError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
    print(
        f"forecast for {fc['target']} by {fc['law']} ({fc['target_flops']:.3g} FLOPs without the LM head, "
        f"{fc['target_steps']} steps) from {len(args.ladder)} rungs -> {args.out}"
    )
    if "fit" in fc:
        print("  " + ", ".join(f"{k} {v:.4g}" for k, v in fc["fit"]["params"].items()))
    for f, s, loss, lo, hi in zip(fc["fractions"], fc["steps"], fc["loss"], fc["low"], fc["high"], strict=True):
        print(f"  {f:>5.0%}  step {s:>8}  loss {loss:.4f}  [{lo:.4f}, {hi:.4f}]")
    return 0


def print_backtest(res: dict) -> None:
    print(f"{res['law']}: fit on the rungs only, predict {res['target']}:")
    print(f"  {'fraction':>8} {'step':>7} {'predicted':>10} {'band':>19} {'actual':>8} {'error':>7}")
    for r in res["curve"]:
        band = f"[{r['low']:.3f}, {r['high']:.3f}]"
        print(
            f"  {r['fraction']:>8.0%} {r['step']:>7} {r['predicted']:>10.4f} {band:>19} {r['actual']:>8.4f}"
            f" {r['error']:>+7.2%}{'' if r['inside'] else '  outside'}"
        )
    print(
        f"  past 20%: mean |error| {res['mean_abs_error_past_20']:.2%}, largest {res['max_abs_error_past_20']:.2%}; "
        f"final {res['final_error']:+.2%}; inside the band at {res['coverage']:.0%} of the points"
    )


def cmd_ladder_backtest(args: argparse.Namespace) -> int:
    from moelab.ladder.forecast import backtest, ends, rung_curve, rung_run
    from moelab.ladder.law import LawError

    runs = [rung_run(d) for d in args.ladder]
    if args.target:
        rungs, target = runs, rung_run(args.target)
    else:  # the largest rung is the target: fit on the others
        if len(runs) < 3:
            raise UsageError(
                "--ladder: give three or more rungs (the largest is predicted from the others), or --target"
            )
        *rungs, target = sorted(runs, key=lambda r: r.flops_per_token * r.tokens_per_step * r.total_steps)
    laws = LAW_CHOICES if args.law == "all" else (args.law,)
    out = []
    for law in laws:
        try:
            out.append(backtest(rungs, target, law, n_boot=args.n_boot))
        except LawError as exc:
            raise UsageError(f"--ladder: {exc}") from None
    marin_ends = ends([rung_curve(d) for d in args.ladder], e=args.e)
    if args.json:
        for res in out:
            res.pop("forecast")
        print(json.dumps({"backtests": out, "ends": marin_ends}, indent=1))
        return 0
    for res in out:
        print_backtest(res)
    print("each run's end from its own 60-80% window (Marin's check):")
    for r in marin_ends:
        print(f"  {r['rung']:<24} predicted {r['predicted_end']:.4f}  actual {r['actual_end']:.4f}  {r['error']:+.2%}")
    return 0


def cmd_replan(args: argparse.Namespace) -> int:
    from moelab.ladder.replan import replan

    if args.tokens <= 0:
        raise UsageError(f"--tokens: must be > 0, got {args.tokens:g}")
    ch = replan(args.run_dir, args.tokens, args.reason, ladder=args.ladder)
    reg = ch["forecast"].get("registration")
    if reg:  # the new forecast version goes into the journal of every experiment the run is a step of
        from moelab.lab.journal import journals_of

        for journal, step in journals_of(Path(args.run_dir).resolve()):
            journal.write("forecast_registered", step=step, dir=Path(args.run_dir).resolve().name, **reg)
            print(f"  registered as forecast version {reg['version']} in {journal.path}")
    if ch["warning"]:
        print(f"moelab: warning: {ch['warning']}", file=sys.stderr)
    if args.json:
        print(json.dumps(ch, indent=1))
        return 0
    lr = ch["lr_at_change"]
    print(
        f"{args.run_dir}: re-planned at step {ch['at_step']}: {ch['old_steps']} -> {ch['new_steps']} steps "
        f"({ch['old_tokens']:.4g} -> {ch['new_tokens']:.4g} tokens); reason: {ch['reason']}"
    )
    print(
        f"  learning rate at step {ch['at_step']}: {lr['before']:.4g} before, {lr['after']:.4g} after; "
        f"{ch['lr_at_new_end']:.4g} at the new last step {ch['new_steps'] - 1}"
    )
    ph = ch["phase_starts"]
    if ph["before"] != ph["after"]:
        print(f"  mixture phases start at steps {ph['before']} -> {ph['after']}")
    fc = ch["forecast"]
    print(
        f"  forecast: {fc['status']}"
        + (f" ({fc['points']} points, {fc['path']})" if "path" in fc else f": {fc['note']}")
    )
    print(f"  resume with: moelab train --resume --out {args.run_dir}")
    return 0


def cmd_bench_train_step(args: argparse.Namespace) -> int:
    from moelab.bench import SHAPE_FLAGS, bench_train_step, print_result, shape_config

    for name in ("steps", "warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            raise UsageError(f"--{name}: must be >= {1 if name == 'steps' else 0}, got {getattr(args, name)}")
    cfg = shape_config(args.preset, **{k: getattr(args, k) for k in SHAPE_FLAGS})
    result = bench_train_step(cfg, steps=args.steps, warmup=args.warmup)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moelab.demo import run_demo

    return run_demo(experiment=args.experiment, prefix=args.prefix, site=args.site)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moelab", description="An open laboratory for MoE training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="parameters and FLOPs of a config, by Marin's definitions")
    _add_config_args(p)
    p.add_argument("--steps", type=int, help="training steps (default: the config's train.steps)")
    p.add_argument("--batch-tokens", type=int, help="tokens per step (default: batch_size x seq_len)")
    p.add_argument("--tokens", type=float, help="total training tokens, instead of --steps/--batch-tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser("config", help="print a validated config as JSON, with its hash")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("presets", help="list the named configs")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("train", help="train a model; writes config, metrics, events and checkpoints to --out")
    _add_config_args(p, optional="; with --resume it may be left out: the run's own config (as re-planned)")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument(
        "--data",
        action="append",
        metavar="SOURCE",
        help="a directory, .jsonl(.gz) or .parquet file, or stdlib; replaces data.sources (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="join a multi-process job: its coordinator address")
    p.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    p.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1 (0 writes the records)")
    p.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="simulate N CPU devices (for mesh.data x mesh.expert = N); set before JAX loads",
    )
    p.add_argument(
        "--tracker",
        action="append",
        choices=["wandb", "tensorboard"],
        help="also mirror metrics to this tracker (repeatable)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart a training process that dies, from its newest checkpoint, up to N times",
    )
    p.add_argument(
        "--inject",
        action="append",
        metavar="KIND@STEP[:ARG]",
        help="inject a fault: lr_spike, data_corruption, router_collapse or zloss_off (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out loss and bits per byte of a run's checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="default: the newest")
    p.add_argument(
        "--noise",
        type=_positive_int,
        nargs="?",
        const=8,
        metavar="SETS",
        help="the evaluation's own noise: the checkpoint on up to SETS (8) disjoint sets of held-out windows",
    )
    p.add_argument("--against", metavar="RUN_DIR", help="with --noise: also the noise of the ratio to this run's loss")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", help="run an experiment's steps, reusing finished ones; record it in the journal")
    p.add_argument("experiment", help="experiments/exp<issue>_<slug>.py")
    p.add_argument("--prefix", default="runs/lab", help="where step outputs and journals live (default runs/lab)")
    p.add_argument("--dry-run", action="store_true", help="print the graph, FLOPs and time; run nothing")
    p.add_argument("--only", metavar="REGEX", help="only steps whose name matches (and what they need)")
    p.add_argument("--force", metavar="REGEX", help="run matching steps again even if they succeeded")
    p.add_argument("--max-concurrent", type=int, default=1, metavar="N")
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="ray: steps run as Ray tasks with their resource requests (pip install 'moelab[ray]')",
    )
    p.add_argument("--ray-address", help="a Ray cluster to join (default: start a local instance)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="experiments under a prefix and their steps")
    p.add_argument("--prefix", default="runs/lab")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("issue", help="GitHub-issue markdown for an experiment")
    p.add_argument("experiment")
    p.add_argument("--prefix", default="runs/lab")
    p.set_defaults(func=cmd_issue)

    p = sub.add_parser("change", help="record a mid-run change in an experiment's journal: what, why, at which step")
    p.add_argument("experiment")
    p.add_argument("--what", required=True)
    p.add_argument("--why", required=True)
    p.add_argument("--step", type=int, help="the training step it takes effect at")
    p.add_argument("--prefix", default="runs/lab")
    p.set_defaults(func=cmd_change)

    p = sub.add_parser("report", help="write the static site of every experiment under a prefix")
    p.add_argument("--prefix", default="runs/lab")
    p.add_argument("--out", required=True, help="the site's folder")
    p.set_defaults(func=cmd_report)

    ladder = sub.add_parser("ladder", help="scaling-ladder tools").add_subparsers(dest="ladder_command", required=True)
    p = ladder.add_parser("fit-nd", help="fit Chinchilla's L(N, D) = E + A/N^alpha + B/D^beta to a CSV of runs")
    p.add_argument("csv")
    p.add_argument("--n-col", required=True, help="column of parameter counts N")
    p.add_argument("--flops-col", required=True, help="column of training FLOPs C (D = C / 6N)")
    p.add_argument("--loss-col", required=True)
    p.add_argument("--exclude-top", type=int, default=0, metavar="K", help="leave out the K highest losses")
    p.add_argument("--delta", type=float, default=1e-3, help="Huber delta on log-loss (1e-3)")
    p.add_argument(
        "--method",
        choices=["projection", "grid"],
        default="projection",
        help="starting points: variable projection (seconds) or Hoffmann et al.'s grid (a minute)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ladder_fit_nd)

    p = ladder.add_parser("plan", help="the rungs of a ladder: shapes, parameters, tokens, steps, FLOPs, time")
    p.add_argument("ladder", help="a ladder YAML (see ladders/)")
    p.add_argument("--flops-per-s", type=float, help="achieved FLOP/s for the time estimate (default: measured)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ladder_plan)

    p = ladder.add_parser(
        "forecast", help="the target's whole held-out loss curve, with a band, from the ladder's rungs"
    )
    p.add_argument("--ladder", nargs="+", required=True, metavar="DIR", help="the rungs' run directories")
    p.add_argument("--target", required=True, help="the target's preset or config YAML (its own schedule is forecast)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--law", default=DEFAULT_LAW, choices=LAW_CHOICES, help=f"default {DEFAULT_LAW}")
    p.add_argument("--e", type=float, help="per-fraction only: fix the irreducible loss E (Marin: 1.5)")
    p.add_argument("--n-boot", type=_positive_int, default=200, help="bootstrap draws for the band (default 200)")
    p.add_argument("--out", required=True, help="forecast.json")
    p.set_defaults(func=cmd_ladder_forecast)

    p = ladder.add_parser(
        "backtest", help="fit on the rungs, predict a run they never saw; each run's end from 60-80%%"
    )
    p.add_argument("--ladder", nargs="+", required=True, metavar="DIR", help="the rungs' run directories")
    p.add_argument(
        "--target", metavar="DIR", help="the run to predict (default: the largest of --ladder, from the others)"
    )
    p.add_argument("--law", default=DEFAULT_LAW, choices=(*LAW_CHOICES, "all"), help=f"default {DEFAULT_LAW}")
    p.add_argument("--e", type=float, help="per-fraction only: fix E; default: fit it")
    p.add_argument("--n-boot", type=_positive_int, default=100, help="bootstrap draws for the band (default 100)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ladder_backtest)

    p = sub.add_parser("health", help="health checks over a run's metrics: OK, WATCH or ALERT with evidence")
    p.add_argument("run_dir")
    p.add_argument("--forecast", help="a forecast.json to hold the eval loss against (default: RUN_DIR/forecast.json)")
    p.add_argument(
        "--ladder",
        nargs="+",
        metavar="DIR",
        help="rung runs to hold the gradient norm and drops against (default: the forecast's rungs)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("replan", help="change a run's horizon: re-time the decay, move phases, re-forecast")
    p.add_argument("run_dir")
    p.add_argument("--tokens", type=float, required=True, help="the run's new total of training tokens")
    p.add_argument("--reason", required=True, help="why: it goes into the run's events")
    p.add_argument("--ladder", nargs="+", metavar="DIR", help="rung runs to re-forecast from (default: the forecast's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_replan)

    bench = sub.add_parser("bench", help="measure: the train step's throughput, compile time, memory, MFU")
    bench = bench.add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("train-step", help="time the train step of a model shape (tiny-softmax recipe)")
    from moelab.bench import DEFAULT_PRESET, SHAPE_FLAGS

    p.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        help=f"start from this preset (default {DEFAULT_PRESET} at reference shape A; another preset keeps its own "
        "shape except the flags given)",
    )
    for name, (field, kind, default) in SHAPE_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{field} (default {default})")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compiling one (default 2)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    p.set_defaults(func=cmd_bench_train_step)

    p = sub.add_parser("demo", help="Marin's accounting, then the example experiment run, judged and published")
    p.add_argument("--experiment", help="an experiment file (default: experiments/exp4_tiny_stdlib.py)")
    p.add_argument("--prefix", default="runs/lab", help="where the experiment's steps and journal go")
    p.add_argument("--site", default="runs/site", help="where the site is written")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the command itself (not a call from Python): restart with huge pages (moelab/_alloc.py)
        from moelab._alloc import restart_with_hugepages

        restart_with_hugepages(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"moelab: {line}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"moelab: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from moelab.data.sources import DataError
        from moelab.lab.commands import ExperimentError
        from moelab.ladder.forecast import ForecastError
        from moelab.ladder.replan import ReplanError
        from moelab.train.loop import RunError, RunRefused

        if isinstance(exc, (DataError, RunRefused, ExperimentError, ForecastError, ReplanError)):
            print(f"moelab: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, RunError):
            print(f"moelab: {exc}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
