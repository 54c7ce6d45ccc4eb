"""`moelab` commands: training and evaluating a run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moelab.cli.common import add_config_args, positive_int, print_summary
from moelab.config import load_config, resolve_dtype
from moelab.errors import UsageError
from moelab.train.supervise import supervise


def _train_config(args: argparse.Namespace):
    from moelab.config import replace

    if args.config is None:  # `moelab train --resume --out DIR`: the run's own (perhaps re-planned) config
        from moelab.runs import load_run_config

        if not (args.resume or args.restart):
            raise UsageError("config: give a preset or a YAML file (only --resume or --restart may leave it out)")
        given = [n for n in ("steps", "seed", "data", "inject", "init_from") if getattr(args, n)] + (
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
    if args.init_from:
        from moelab.train.init_from import init_overrides

        overrides += init_overrides(args.init_from, load_config(args.config, overrides))
    cfg = load_config(args.config, overrides)
    if args.data:
        cfg = replace(cfg, data={"sources": tuple(args.data)})
    if problems := cfg.check_vocab():
        from moelab.errors import ConfigError

        raise ConfigError(problems)
    return cfg


def _train_parser() -> argparse.ArgumentParser:
    """`moelab train`'s parser as register builds it (to write a parsed command back as arguments)."""
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    return sub.choices["train"]


def _child_args(args: argparse.Namespace) -> list[str]:
    """A supervised process's command: this process's own arguments as parsed (its --coordinator,
    --process-id and the rest) without --max-restarts, each option that differs from its default
    written back as ``--flag=value`` (a value such as ``-1`` is then never read as a flag)."""
    out = []
    for action in _train_parser()._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in ("help", "max_restarts") or value == action.default:
            continue
        if not action.option_strings:  # the config
            out.insert(0, value)
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # --resume, --quiet
            out.append(flag)
        elif isinstance(value, list):  # --set, --data, --tracker, --inject (repeatable)
            out += [f"{flag}={v}" for v in value]
        else:
            out.append(f"{flag}={value}")
    return out


def _job(args: argparse.Namespace) -> tuple[str, int, int] | None:
    """This process's place in a multi-process job, (coordinator, processes, process id), from the flags
    or MOELAB_COORDINATOR, MOELAB_NUM_PROCESSES and MOELAB_PROCESS_ID; None outside one."""
    import os

    coordinator = args.coordinator or os.environ.get("MOELAB_COORDINATOR")
    if not coordinator:
        return None
    try:
        n = int(args.num_processes or os.environ.get("MOELAB_NUM_PROCESSES", ""))
        pid = int(args.process_id if args.process_id is not None else os.environ.get("MOELAB_PROCESS_ID", ""))
    except ValueError:
        raise UsageError("--num-processes and --process-id: give both (or MOELAB_NUM_PROCESSES and MOELAB_PROCESS_ID) "
                         "with --coordinator") from None  # fmt: skip
    if not 0 <= pid < n:
        raise UsageError(f"--process-id: {pid} is not in [0, {n})")
    host, colon, port = coordinator.rpartition(":")
    if not (colon and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"--coordinator {coordinator!r}: expected HOST:PORT (process 0's address, a port in 1..65535)")
    return coordinator, n, pid


def _join_job(job: tuple[str, int, int]) -> None:
    """Join the multi-process job through ``jax.distributed`` (never in a supervisor: its children join)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices talk over gloo; GPUs ignore it
    jax.distributed.initialize(*job)


def _check_out(args: argparse.Namespace) -> None:
    """--out: a directory that holds this run (or nothing yet), and can be written."""
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} is a file, not a directory; choose a directory for the run")
    # a run's own files (a run that died before its config.json was written still has its events,
    # and the supervisor's restarts resume it)
    is_run = (out / "config.json").is_file() or (out / "events.jsonl").is_file()
    again = getattr(args, "resume", False) or getattr(args, "restart", False)
    if again and not is_run:
        flag = "--resume" if getattr(args, "resume", False) else "--restart"
        raise UsageError(f"--out: {out} holds no run to resume (no config.json); leave out {flag} to start one")
    if not again and out.is_dir() and not is_run:
        strangers = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if strangers:
            raise UsageError(
                f"--out: {out} holds files that are not a run ({', '.join(strangers[:3])}"
                f"{', ...' if len(strangers) > 3 else ''}); choose an empty or new directory"
            )


def _make_out(out: str) -> None:
    from pathlib import Path

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot create {out} ({exc.strerror or exc}); choose a writable directory") from None


def _branch(args: argparse.Namespace) -> int:
    """`moelab train --branch-from PARENT --at STEP --steps N --out DIR`: a new run from the parent's
    checkpoint at STEP with a horizon of N steps (moelab.train.branch)."""
    from moelab.runs import load_run_config
    from moelab.train.branch import branch_config, start_branch
    from moelab.train.loop import train

    if args.at is None or args.steps is None:
        raise UsageError("--branch-from: give --at STEP (the parent's checkpoint) and --steps N (the branch's horizon)")
    given = [n for n in ("config", "seed", "data", "inject", "resume", "restart") if getattr(args, n)]
    if given:
        raise UsageError(f"--{given[0]}: a branch is the parent's run; only --steps and --set train.* may change it")
    if args.max_restarts or args.devices or args.coordinator:
        raise UsageError(
            "--branch-from: start the branch alone, then resume it with --resume --out for restarts or meshes"
        )
    parent = load_run_config(args.branch_from)
    cfg = branch_config(parent, args.at, args.steps, list(args.overrides))
    start_branch(args.branch_from, args.at, args.out, cfg)
    print(f"branched {args.out} from {args.branch_from} at step {args.at}: {args.steps} steps", file=sys.stderr)
    print_summary(train(cfg, args.out, resume=True, progress=not args.quiet))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.branch_from:
        return _branch(args)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    if args.devices is not None:
        from moelab.parallel.mesh import MAX_SIMULATED_DEVICES, MeshError, request_devices

        if args.devices < 1:
            raise UsageError(f"--devices: must be >= 1, got {args.devices}")
        if args.devices > MAX_SIMULATED_DEVICES and "jax" not in sys.modules:
            raise UsageError(
                f"--devices: {args.devices} simulated CPU devices is more than {MAX_SIMULATED_DEVICES} (XLA would take "
                f"minutes to start them, or hang); plan a larger mesh with moelab plan memory --mesh data=D,expert=E"
            )
        try:
            request_devices(args.devices)  # before JAX loads
        except MeshError as exc:
            raise UsageError(str(exc)) from None
    _check_out(args)
    cfg = _train_config(args)  # refuse a bad config before anything starts
    job = _job(args)  # refused here, before anything starts; in a job --devices is this process's share
    if not job and args.devices is not None and args.devices != cfg.mesh.data * cfg.mesh.expert:
        raise UsageError(
            f"--devices {args.devices}: the config's mesh is mesh.data x mesh.expert = {cfg.mesh.data} x "
            f"{cfg.mesh.expert} = {cfg.mesh.data * cfg.mesh.expert}; make the product {args.devices} (--set mesh.data=...)"
        )
    if not (job or args.max_restarts):  # (a job's processes after joining; a supervisor's child checks for itself)
        from moelab.plan.memory import fit_check

        fit_check(resolve_dtype(cfg))  # a run that cannot fit is refused before anything is written
    _make_out(args.out)
    if args.max_restarts:  # the supervisor joins no job and loads no JAX: each child is the process itself
        records = Path(args.out) / f".process-{job[2]}" if job and job[2] else Path(args.out)
        return supervise(_child_args(args), args.out, args.max_restarts, records=records)
    if job:
        _join_job(job)
    from moelab.train.loop import train
    from moelab.train.trackers import make_trackers

    summary = train(
        cfg,
        args.out,
        resume=args.resume,
        restart=args.restart,
        progress=not args.quiet,
        trackers=make_trackers(args.tracker or [], cfg, args.out),
    )
    print_summary(summary)
    return 0


def _numbers(text: str, flag: str, kind):
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


def _retrieval(args: argparse.Namespace) -> int:
    import json as _json

    from moelab.train.run_tasks import evaluate_retrieval

    lengths, depths = _numbers(args.retrieval, "--retrieval", int), _numbers(args.depths, "--depths", float)
    if not lengths or not depths:
        raise UsageError("--retrieval: give lengths in tokens, such as --retrieval 256,1024")
    res = evaluate_retrieval(args.run_dir, lengths, depths, args.examples, args.checkpoint, progress=not args.json)
    if args.json:
        print(_json.dumps(res, indent=1))
        return 0
    print(f"{args.run_dir} at step {res['step']}: retrieval accuracy, {res['n']} examples a cell (chance 0.25)")
    print(f"  {'tokens':>8} " + "".join(f"{'depth ' + format(d, 'g'):>11}" for d in depths))
    for n in lengths:
        print(f"  {n:>8} " + "".join(f"{res['acc'][f'{n}@{d:g}']:>11.3f}" for d in depths))
    return 0


def _print_tasks(args: argparse.Namespace, res: dict) -> None:
    """`moelab eval --tasks`' tables: generation tasks (pass@k), then log-likelihood tasks."""
    print(f"{args.run_dir} at step {res['step']}")
    generated = {k: r for k, r in res["tasks"].items() if "pass@1" in r}
    if generated:
        at_k = f"pass@{args.samples}" if args.samples > 1 else ""
        print(f"  {'generation task':<24} {'prompts':>8} {'pass@1':>7} {at_k:>9}")
        for name, r in generated.items():
            print(f"  {name:<24} {r['examples']:>8} {r['pass@1']:>7.3f} {format(r[at_k], '.3f') if at_k else '':>9}")
    rest = {k: r for k, r in res["tasks"].items() if k not in generated}
    if rest:
        print(f"  {'task':<24} {'examples':>8} {'acc':>7} {'acc_norm':>9} {'chance':>7} {'bits/byte':>10}")
    for name, r in rest.items():
        mc = f"{r['acc']:>7.3f} {r['acc_norm']:>9.3f} {r['chance']:>7.3f}" if "acc" in r else f"{'':>7} {'':>9} {'':>7}"
        print(f"  {name:<24} {r['examples']:>8} {mc} {r['bpb']:>10.4f}")


def _check_eval_flags(args: argparse.Namespace) -> None:
    """One evaluation at a time (--tasks, --noise, --retrieval, or the held-out loss), and no flag that
    would do nothing with it: each refused in one line naming the flag it needs."""
    modes = [f"--{n}" for n in ("tasks", "noise", "retrieval") if getattr(args, n) is not None]
    if len(modes) > 1:
        raise UsageError(f"{modes[0]} with {modes[1]}: run one evaluation at a time")
    if args.data and modes:
        raise UsageError(
            f"--data with {modes[0]}: --data is what the held-out loss is taken on; run them one at a time"
        )
    has = {"--harness": False, "--noise": args.noise is not None, "--retrieval": args.retrieval is not None,
           "--tasks": args.tasks is not None}  # fmt: skip
    for flag, given, need in (
        ("--limit", args.limit is not None, "--harness"),
        ("--against", args.against is not None, "--noise"),
        ("--depths", args.depths != "0.1,0.5,0.9", "--retrieval"),
        ("--examples", args.examples != 16, "--retrieval"),
        ("--samples", args.samples != 1, "--tasks"),
        ("--max-new-tokens", args.max_new_tokens != 128, "--tasks"),
    ):
        if given and not has[need]:
            raise UsageError(f"{flag}: only with {need}; alone it changes nothing")
    if (args.temperature != 0.8 or args.seed) and args.samples == 1:
        raise UsageError("--temperature and --seed: only with --tasks and --samples K > 1 (one sample is greedy)")


def cmd_eval(args: argparse.Namespace) -> int:
    import json as _json

    from moelab.train.evaluate import eval_noise, evaluate_run

    if args.harness is not None:
        return _harness(args)
    _check_eval_flags(args)
    if args.retrieval is not None:
        return _retrieval(args)
    if args.tasks:
        from moelab.train.run_tasks import evaluate_tasks

        res = evaluate_tasks(args.run_dir, args.tasks, args.checkpoint, progress=not args.json, samples=args.samples,
                             temperature=args.temperature, max_new=args.max_new_tokens, seed=args.seed)  # fmt: skip
        if args.json:
            print(_json.dumps(res, indent=1))
            return 0
        _print_tasks(args, res)
        return 0
    if args.noise:
        if args.against:
            from moelab.runs import load_run_config

            load_run_config(args.against)  # refused in one line before anything is said
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
    res = evaluate_run(args.run_dir, args.checkpoint, progress=not args.json, data=args.data)
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


def _harness(args: argparse.Namespace) -> int:
    """`moelab eval RUN --harness TASK,...`: lm-evaluation-harness on the exported checkpoint (moelab.export.harness)."""
    import json as _json

    given = [n for n in ("tasks", "noise", "against", "data") if getattr(args, n)]
    if given:
        raise UsageError(f"--harness with --{given[0]}: run them one at a time")
    specs = [s.strip() for s in args.harness.split(",") if s.strip()]
    if not specs:
        raise UsageError("--harness: give lm-eval task names or task YAML paths, separated by commas")
    from moelab.export.harness import evaluate_harness

    res = evaluate_harness(args.run_dir, specs, args.checkpoint, limit=args.limit, progress=not args.json)
    if args.json:
        print(_json.dumps(res, indent=1))
        return 0
    print(f"{args.run_dir} at step {res['step']}: lm-evaluation-harness {res['lm_eval']}")
    print(f"  {'task':<24} {'examples':>8} {'metric':<16} {'value':>8} {'stderr':>8}")
    for task, metrics in res["tasks"].items():
        for name, value in metrics.items():
            if name.endswith("_stderr") or "_stderr," in name:
                continue
            err = metrics.get(name.replace(",", "_stderr,", 1) if "," in name else name + "_stderr")
            err = f"{err:>8.4f}" if isinstance(err, (int, float)) else f"{'':>8}"
            n = res["examples"].get(task)
            print(f"  {task:<24} {n if n is not None else '':>8} {name:<16} {value:>8.4f} {err}")
    return 0


def register(sub) -> None:
    # long (98 lines): the train command's flags, one statement each
    p = sub.add_parser("train", help="train a model; writes config, metrics, events and checkpoints to --out")
    add_config_args(p, optional="; with --resume it may be left out: the run's own config (as re-planned)")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument(
        "--data",
        action="append",
        metavar="SOURCE",
        help="a file, folder or glob of shards (text, JSON lines, parquet, arrow; .gz/.zst/.bz2/.xz), name=path to "
        "name its domain, or stdlib; replaces data.sources (repeatable)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --out (refused when the run has records but no "
        "checkpoint: --restart)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="train the run in --out again from step 0, its records cut back, when it has no checkpoint (refused "
        "when it has one; with --resume: resume when it has one, else start over)",
    )
    p.add_argument(
        "--branch-from",
        metavar="RUN_DIR",
        help="start a new run from this run's checkpoint at --at with a horizon of --steps (the config is the parent's)",
    )
    p.add_argument("--at", type=int, metavar="STEP", help="with --branch-from: the parent's checkpoint to start from")
    p.add_argument(
        "--init-from",
        metavar="RUN[:STEP]",
        help="fine-tune: start from this run's weights at STEP (default: its newest checkpoint), or from a Hugging "
        "Face folder that `moelab export hf` wrote, with this config's own optimizer, schedule and data "
        "(train.init_from); its tokenizer too, unless data.tokenizer names one",
    )
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
        help="inject a fault (repeatable): lr_spike, lr_high, data_corruption, token_noise, data_stuck, router_collapse, router_drift or zloss_off",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out loss and bits per byte of a run's checkpoint")
    p.add_argument("run_dir", help="a run directory (train --out)")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="default: the newest")
    p.add_argument(
        "--noise",
        type=positive_int,
        nargs="?",
        const=8,
        metavar="SETS",
        help="the evaluation's own noise: the checkpoint on up to SETS (8) disjoint sets of held-out windows",
    )
    p.add_argument("--against", metavar="RUN_DIR", help="with --noise: also the noise of the ratio to this run's loss")
    p.add_argument(
        "--data",
        action="append",
        metavar="SOURCE",
        help="evaluate on this data instead of the held-out split, whole, with the run's tokenizer: a file, folder, "
        "glob or name=path, as in data.sources (repeatable); loss and bits per byte per domain",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="FILE",
        help="score task files (JSON lines: context + choices + answer, or context + continuation; see "
        "moelab.eval.tasks) by log-likelihood: accuracy, length-normalised accuracy, bits per byte; or generation "
        "tasks (prompt + tests, target or regex): pass@1 (and pass@K with --samples K)",
    )
    p.add_argument(
        "--harness",
        metavar="TASK,...",
        help="run lm-evaluation-harness (pip install 'moelab[harness]') on the exported checkpoint: lm-eval task "
        "names whose datasets are in the local Hugging Face cache, or task YAML paths over local data files; "
        "nothing is downloaded; results in evals/step_N-harness.json",
    )
    p.add_argument(
        "--samples",
        type=positive_int,
        default=1,
        metavar="K",
        help="with --tasks, for generation tasks (a prompt and tests, a target or a regex; moelab.eval.generation): "
        "K completions per prompt, 1 = greedy; prints pass@1 and pass@K (Chen et al.'s unbiased estimator)",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="with --samples K > 1: the sampling temperature")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="with --tasks: a completion's limit")
    p.add_argument("--seed", type=int, default=0, help="with --samples K > 1: the sampling seed")
    p.add_argument("--limit", type=positive_int, metavar="N", help="with --harness: at most N examples per task")
    p.add_argument(
        "--retrieval",
        metavar="LENGTH,...",
        help="the long-context retrieval task (a key planted at --depths of held-out code, asked for at the end; "
        "chance 0.25) generated for the run's tokenizer at these lengths in tokens; evals/step_N-retrieval.json",
    )
    p.add_argument("--depths", default="0.1,0.5,0.9", metavar="D,...", help="with --retrieval: where the key is (0-1)")
    p.add_argument(
        "--examples", type=positive_int, default=16, metavar="N", help="with --retrieval: per length and depth"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_eval)
