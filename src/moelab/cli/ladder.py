"""`moelab` commands: the scaling ladder: plans, fits, forecasts and backtests; health checks; re-planning."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moelab.cli.common import positive_int, print_plan
from moelab.config import load_config
from moelab.errors import UsageError
from moelab.ladder import DEFAULT_LAW, LAW_CHOICES, LAWS

BACKTEST_LAWS = (*LAWS, "per-fraction")

FIT_ND_MIN_POINTS = 6  # five free parameters (E, A, B, alpha, beta) and one more


def cmd_ladder_fit_nd(args: argparse.Namespace) -> int:
    import csv

    import numpy as np

    from moelab.ladder.fits import fit_chinchilla

    path = Path(args.csv)
    if not path.is_file():
        raise UsageError(f"{path}: no such CSV file")
    if args.delta <= 0 or not np.isfinite(args.delta):
        raise UsageError(f"--delta: the Huber delta must be a finite number > 0, got {args.delta}")
    if args.exclude_top < 0:
        raise UsageError(f"--exclude-top: must be >= 0, got {args.exclude_top}")
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; save the CSV as UTF-8") from None
    except (OSError, csv.Error) as exc:
        raise UsageError(f"{path}: cannot read it as CSV ({exc})") from None
    if not rows:
        raise UsageError(f"{path}: no rows of data under the header; one row per run (N, FLOPs, loss)")
    for flag, col in (("--n-col", args.n_col), ("--flops-col", args.flops_col), ("--loss-col", args.loss_col)):
        if col not in rows[0]:
            raise UsageError(f"{path}: no column {col!r} ({flag}); columns: {', '.join(k for k in rows[0] if k)}")
    values = {}
    for col in (args.n_col, args.flops_col, args.loss_col):
        out = []
        for i, r in enumerate(rows, start=2):  # line 1 is the header
            text = r.get(col)
            if text is None or not str(text).strip():
                raise UsageError(f"{path}: line {i} has no value in column {col!r}; every row needs all three")
            try:
                v = float(text)
            except ValueError:
                raise UsageError(f"{path}: line {i}, column {col!r}: {text!r} is not a number") from None
            if not np.isfinite(v) or v <= 0:
                raise UsageError(f"{path}: line {i}, column {col!r}: must be a finite number > 0, got {text.strip()}")
            out.append(v)
        values[col] = np.array(out)
    n, c, loss = values[args.n_col], values[args.flops_col], values[args.loss_col]
    if args.exclude_top:
        if len(loss) - args.exclude_top < FIT_ND_MIN_POINTS:
            raise UsageError(f"--exclude-top: {args.exclude_top} of {len(loss)} points leaves fewer than "
                             f"{FIT_ND_MIN_POINTS} to fit")  # fmt: skip
        keep = np.argsort(loss, kind="stable")[: len(loss) - args.exclude_top]
        n, c, loss = n[keep], c[keep], loss[keep]
    d = c / (6 * n)
    if len(loss) < FIT_ND_MIN_POINTS or len(np.unique(n)) < 3 or len(np.unique(d)) < 3:
        raise UsageError(
            f"{path}: {len(loss)} points at {len(np.unique(n))} model sizes and {len(np.unique(d))} token counts; "
            f"the five-parameter law needs {FIT_ND_MIN_POINTS} or more points, at 3 or more of each"
        )
    fit = fit_chinchilla(n, d, loss, delta=args.delta, method=args.method)
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


def cmd_ladder_plan(args: argparse.Namespace) -> int:
    from moelab.ladder.plan import load_ladder

    print_plan(load_ladder(args.ladder), args.flops_per_s, args.json)
    return 0


def cmd_ladder_forecast(args: argparse.Namespace) -> int:
    from moelab.ladder.forecast import forecast

    cfg = load_config(args.target, args.overrides)
    prior = None
    if args.prior:
        from moelab.ladder.prior import prior_for

        prior = prior_for(args.prior).to_dict()
    fc = forecast(args.ladder, cfg, law=args.law, e=args.e, n_boot=args.n_boot, target_name=cfg.name or args.target,
                  log=lambda text: print(text, file=sys.stderr), agg=args.metric, prior=prior)  # fmt: skip
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
    if fc.get("params"):  # each parameter with its 90% interval from the band's refits
        print(
            "  " + ", ".join(f"{k} {v['value']:.4g} [{v['low']:.3g}, {v['high']:.3g}]" for k, v in fc["params"].items())
        )
    elif "fit" in fc:
        print("  " + ", ".join(f"{k} {v:.4g}" for k, v in fc["fit"]["params"].items()))
    for w in fc.get("warnings", []):
        print(f"  warning: {w}")
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

    runs = [rung_run(d, agg=args.metric) for d in args.ladder]
    if args.target:
        rungs, target = runs, rung_run(args.target, agg=args.metric)
    else:  # the largest size is the target (its first run): fit on the smaller sizes, every seed of them
        top = max(r.n for r in runs)
        rungs = [r for r in runs if r.n < top]
        target = next(r for r in runs if r.n == top)
        if len({r.n for r in rungs}) < 2:
            raise UsageError(
                "--ladder: give rungs of three or more sizes (the largest is predicted from the others), or --target"
            )
    laws = BACKTEST_LAWS if args.law == "all" else (args.law,)
    out = []
    for law in laws:
        try:
            out.append(backtest(rungs, target, law, n_boot=args.n_boot, e=args.e))
        except LawError as exc:
            raise UsageError(f"--ladder: {exc}") from None
    marin_ends = ends([rung_curve(d, agg=args.metric) for d in args.ladder], e=args.e)
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


def cmd_health(args: argparse.Namespace) -> int:
    from moelab.monitor.health import check_run, forecast_problem, ladder_trajectories
    from moelab.runs import load_run_config

    run = Path(args.run_dir)
    load_run_config(run)  # refuses a directory that is not a run
    if args.forecast:  # the user's choice of forecast, not a record of the run's
        forecast_path = Path(args.forecast)
        if not forecast_path.is_file():
            raise UsageError(f"{forecast_path}: no such forecast file")
        try:
            forecast = json.loads(forecast_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise UsageError(
                f"{forecast_path}: not a forecast (not JSON); give a forecast.json that moelab wrote"
            ) from None
        problem = forecast_problem(forecast)
        if problem:
            raise UsageError(f"{forecast_path}: {problem}")
    else:  # the run's newest registered forecast, refused if it changed after it was registered
        from moelab.runs import RunDir

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


def cmd_replan(args: argparse.Namespace) -> int:
    from moelab.train.replan import replan

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


def register(sub) -> None:
    ladder = sub.add_parser("ladder", help="scaling-ladder tools").add_subparsers(dest="ladder_command", required=True)
    p = ladder.add_parser("fit-nd", help="fit Chinchilla's L(N, D) = E + A/N^alpha + B/D^beta to a CSV of runs")
    p.add_argument("csv", help="a CSV file of runs, one row each")
    p.add_argument("--n-col", required=True, help="column of parameter counts N")
    p.add_argument("--flops-col", required=True, help="column of training FLOPs C (D = C / 6N)")
    p.add_argument("--loss-col", required=True, help="column of final losses L")
    p.add_argument("--exclude-top", type=int, default=0, metavar="K", help="leave out the K highest losses")
    p.add_argument("--delta", type=float, default=1e-3, help="Huber delta on log-loss (1e-3)")
    p.add_argument(
        "--method",
        choices=["projection", "grid"],
        default="projection",
        help="starting points: variable projection (seconds) or Hoffmann et al.'s grid (a minute)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_ladder_fit_nd)

    p = ladder.add_parser("plan", help="the rungs of a ladder: shapes, parameters, tokens, steps, FLOPs, time")
    p.add_argument("ladder", help="a ladder YAML (see ladders/)")
    p.add_argument("--flops-per-s", type=float, help="achieved FLOP/s for the time estimate (default: measured)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_ladder_plan)

    p = ladder.add_parser(
        "forecast", help="the target's whole held-out loss curve, with a band, from the ladder's rungs"
    )
    p.add_argument("--ladder", nargs="+", required=True, metavar="DIR", help="the rungs' run directories")
    p.add_argument("--target", required=True, help="the target's preset or config YAML (its own schedule is forecast)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field of the target's config, for example --set train.steps=5000 (repeatable)")  # fmt: skip
    p.add_argument("--law", default=DEFAULT_LAW, choices=LAW_CHOICES, help=f"default {DEFAULT_LAW}")
    p.add_argument("--e", type=float, help="hold the irreducible loss E at this value (Marin holds it at 1.5)")
    p.add_argument(
        "--prior",
        metavar="FILE",
        help="the prior laws' prior: its JSON, or the ladder YAML whose recipe's prior moelab ships",
    )
    p.add_argument("--metric", default="mix", choices=("mix", "macro"),
                   help="the held-out loss: weighted by the training mixture (mix, default) or the domains' mean")  # fmt: skip
    p.add_argument("--n-boot", type=positive_int, default=200, help="bootstrap draws for the band (default 200)")
    p.add_argument("--out", required=True, help="forecast.json")
    p.set_defaults(func=cmd_ladder_forecast)

    p = ladder.add_parser(
        "backtest", help="fit on the rungs, predict a run they never saw; each run's end from 60-80%%"
    )
    p.add_argument("--ladder", nargs="+", required=True, metavar="DIR", help="the rungs' run directories")
    p.add_argument(
        "--target", metavar="DIR", help="the run to predict (default: the largest of --ladder, from the others)"
    )
    p.add_argument("--law", default=DEFAULT_LAW, choices=(*BACKTEST_LAWS, "all"),
                   help=f"default {DEFAULT_LAW} (the prior laws are backtested across corpora by benchmarks/forecast_calibration.py)")  # fmt: skip
    p.add_argument("--e", type=float, help="hold E at this value; default: fit it")
    p.add_argument("--metric", default="mix", choices=("mix", "macro"),
                   help="the held-out loss: weighted by the training mixture (mix, default) or the domains' mean")  # fmt: skip
    p.add_argument("--n-boot", type=positive_int, default=100, help="bootstrap draws for the band (default 100)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_ladder_backtest)

    p = sub.add_parser("health", help="health checks over a run's metrics: OK, WATCH or ALERT with evidence")
    p.add_argument("run_dir", help="a run directory (train --out)")
    p.add_argument("--forecast", help="a forecast.json to hold the eval loss against (default: RUN_DIR/forecast.json)")
    p.add_argument(
        "--ladder",
        nargs="+",
        metavar="DIR",
        help="rung runs to hold the gradient norm and drops against (default: the forecast's rungs)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("replan", help="change a run's horizon: re-time the decay, move phases, re-forecast")
    p.add_argument("run_dir", help="a run directory (train --out)")
    p.add_argument("--tokens", type=float, required=True, help="the run's new total of training tokens")
    p.add_argument("--reason", required=True, help="why: it goes into the run's events")
    p.add_argument("--ladder", nargs="+", metavar="DIR", help="rung runs to re-forecast from (default: the forecast's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_replan)
