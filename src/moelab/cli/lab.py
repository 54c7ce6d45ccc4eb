"""`moelab` commands: the open lab: experiments, their record, the site, the demo."""

from __future__ import annotations

import argparse
from pathlib import Path

from moelab.errors import UsageError

DEFAULT_PREFIX = "runs/lab"  # where `moelab run` keeps step outputs and journals unless told otherwise


def cmd_run(args: argparse.Namespace) -> int:
    from moelab.lab.commands import dry_run, load_experiment
    from moelab.lab.executor import Runner

    exp = load_experiment(args.experiment)
    _check_run_args(args, [s.name for s in exp.all_steps()])
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
    from moelab.lab.journal import verdict_text

    first, this = result["verdict"], result["this_attempt"]
    if first:  # the first attempt's verdict counts; this run's, when it is a later attempt, is shown beside it
        print(f"verdict: {result['headline']} ({first['why']}; predicted {first['predicted']:g}, prediction "
              f"v{first['prediction_version']}, attempt {first.get('attempt', 1)})")  # fmt: skip
    if this and this is not first and this.get("attempt", 1) != first.get("attempt", 1):
        print(f"this run, attempt {this['attempt']}: {verdict_text(this, first)} ({this['why']})")
    late = result["post_hoc_verdict"]
    if late:
        print(f"verdict: {late['verdict']} ({late['why']}; predicted {late['predicted']:g}, prediction "
              f"v{late['prediction_version']})")  # fmt: skip
    if result["lost"]:
        print(f"this runner lost {', '.join(result['lost'])} to another runner while it stalled and stopped; the "
              "other runner carries the experiment on (`moelab status` shows where it stands)")  # fmt: skip
        return 1
    failed = [k for k, x in result["steps"].items() if x != "SUCCESS"]
    if failed:
        print(f"not finished: {', '.join(failed)}; the journal has the tracebacks; run again to resume")
        return 1
    return 0


def _check_run_args(args: argparse.Namespace, names: list[str]) -> None:
    """--max-concurrent at least 1; --only and --force regular expressions, --only matching a step."""
    import re

    if args.max_concurrent < 1:
        raise UsageError(f"--max-concurrent {args.max_concurrent}: steps run at once; give 1 or more")
    for flag, value in (("--only", args.only), ("--force", args.force)):
        if value is None:
            continue
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise UsageError(
                f"{flag} {value!r}: not a regular expression ({exc}); escape it, or give a step's name"
            ) from None
        if flag == "--only" and not any(pattern.search(n) for n in names):
            raise UsageError(f"--only {value!r}: matches none of the experiment's steps ({', '.join(names[:6])}"
                             f"{', ...' if len(names) > 6 else ''})")  # fmt: skip


def cmd_status(args: argparse.Namespace) -> int:
    from moelab.lab.journal import status_rows

    if not Path(args.prefix).is_dir():
        if args.prefix == DEFAULT_PREFIX and not Path(args.prefix).exists():  # a fresh checkout: nothing yet
            print(f"nothing has run here yet: {args.prefix} does not exist (`moelab run EXPERIMENT` or `make demo` "
                  "writes it)")  # fmt: skip
            return 0
        raise UsageError(f"--prefix: no such directory {args.prefix}; give the prefix `moelab run` wrote to")
    from moelab.report.site import find_records, run_info

    prefix = Path(args.prefix)
    journals, runs = find_records(prefix)
    labs = sorted({j.parents[2] for j in journals} | {prefix})  # a lab prefix below counts (runs/lab)
    rows = [(lab, r) for lab in labs for r in status_rows(lab)]
    if not rows and not runs:
        print(f"no experiments or runs under {args.prefix}")
    for lab, r in rows:
        late = "".join(f"; {v}" for v in r["post_hoc_verdicts"])
        print(f"{r['experiment']} (v{r['version']}): {r['title']}  verdict: {r['verdict'] or '-'}{late}")
        for s in r["steps"]:  # the current graph's steps
            print(f"  {s['status']:<8} {s['name']:<22} {lab / s['dir']}")
        if len(r["attempts"]) > 1:
            for a in r["attempts"]:
                print(f"  attempt {a['number']} ({a['when']}, {a['why']}): {a['verdict'] or 'no verdict'}")
    if runs:
        print(f"runs ({len(runs)}):")
    for run in runs:
        i = run_info(prefix, run)
        loss = "" if i["final_loss"] is None else f", train loss {i['final_loss']:.4g}"
        held = "" if i["final_eval"] is None else f", held-out {i['final_eval']:.4g}"
        print(f"  {i['status']:<10} {str(run):<28} step {i['steps']} of {i['planned']}{loss}{held}")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    from moelab.lab.commands import issue_markdown, load_experiment

    print(issue_markdown(load_experiment(args.experiment), Path(args.prefix)), end="")
    return 0


def cmd_change(args: argparse.Namespace) -> int:
    from moelab.lab.commands import load_experiment, training_horizons
    from moelab.lab.journal import Journal

    what, why = (args.what or "").strip(), (args.why or "").strip()
    if not what or not why:
        raise UsageError(f"--{'what' if not what else 'why'}: say what changed and why; an empty one records nothing")
    exp = load_experiment(args.experiment)
    if args.step is not None:
        horizons = training_horizons(exp, Path(args.prefix))
        longest = max(horizons.values(), default=0)
        if not horizons:
            raise UsageError(f"--step: {exp.name} trains nothing, so a training step names nothing; leave --step out")
        if not 0 <= args.step <= longest:
            runs = ", ".join(f"{k} {v}" for k, v in horizons.items())
            raise UsageError(
                f"--step: {args.step} lies outside every run of {exp.name} (steps: {runs}); give 0..{longest}"
            )
    journal = Journal(Path(args.prefix) / "experiments" / exp.name / "journal.jsonl")
    if not journal.path.is_file():  # a mistyped prefix would start a journal that `moelab status` then lists
        raise UsageError(f"--prefix: {args.prefix} holds no journal of {exp.name} ({journal.path}); give the prefix "
                         "it ran under (`moelab status --prefix ...` lists them), or run it first")  # fmt: skip
    rec = journal.change(what, why, args.step)
    print(f"recorded in {journal.path}: {rec['what']} (why: {rec['why']})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from moelab.report.site import build_site

    prefix, out = Path(args.prefix), Path(args.out)
    if not prefix.is_dir():
        raise UsageError(
            f"--prefix: no such directory {prefix}; give a folder of runs (`moelab train --out`) or the prefix "
            "`moelab run` wrote to"
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; the site is a folder (index.html and a page per experiment and run)")
    from moelab.paths import writable_place

    writable_place(out / "index.html", make=True)  # its folder, under a parent it may write in
    index = build_site(prefix, out)
    print(f"site: {index}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moelab.cli.demo import run_demo

    return run_demo(experiment=args.experiment, prefix=args.prefix, site=args.site)


def register(sub) -> None:
    p = sub.add_parser("run", help="run an experiment's steps, reusing finished ones; record it in the journal")
    p.add_argument("experiment", help="experiments/exp<issue>_<slug>.py")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="where step outputs and journals live (default runs/lab)")
    p.add_argument("--dry-run", action="store_true", help="print the graph, FLOPs and time; run nothing")
    p.add_argument("--only", metavar="REGEX", help="only steps whose name matches (and what they need)")
    p.add_argument("--force", metavar="REGEX", help="run matching steps again even if they succeeded")
    p.add_argument("--max-concurrent", type=int, default=1, metavar="N", help="steps run at once (default 1)")
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="ray: steps run as Ray tasks with their resource requests (pip install 'moelab[ray]')",
    )
    p.add_argument("--ray-address", help="a Ray cluster to join (default: start a local instance)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="experiments under a prefix and their steps, and plain runs (moelab train)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="where step outputs and journals live (default runs/lab)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("issue", help="GitHub-issue markdown for an experiment")
    p.add_argument("experiment", help="experiments/exp<issue>_<slug>.py")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="where step outputs and journals live (default runs/lab)")
    p.set_defaults(func=cmd_issue)

    p = sub.add_parser("change", help="record a mid-run change in an experiment's journal: what, why, at which step")
    p.add_argument("experiment", help="experiments/exp<issue>_<slug>.py")
    p.add_argument("--what", required=True, help="what changed")
    p.add_argument("--why", required=True, help="why it changed")
    p.add_argument("--step", type=int, help="the training step it takes effect at")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="where step outputs and journals live (default runs/lab)")
    p.set_defaults(func=cmd_change)

    p = sub.add_parser(
        "report", help="write the static site of every experiment and every plain run (moelab train) under a folder"
    )
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help="the folder of experiments and runs, at any depth (default runs/lab)"
    )
    p.add_argument("--out", required=True, help="the site's folder")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("demo", help="Marin's accounting, then the example experiment run, judged and published")
    p.add_argument(
        "--experiment",
        help="an experiment file (default: the repository's experiments/exp37_forecast_prior.py, the demo ladder)",
    )
    p.add_argument("--prefix", default="runs/lab", help="where the experiment's steps and journal go")
    p.add_argument("--site", default="runs/site", help="where the site is written")
    p.set_defaults(func=cmd_demo)
