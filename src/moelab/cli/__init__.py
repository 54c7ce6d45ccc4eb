"""`moelab ...`: the command line. Every command that takes a config takes ``--set`` overrides.

A config or input the user can fix is refused with one line per problem and exit code 2. One small
module per area registers its subcommands: config, train, lab, ladder, plan, bench, use (sample, export); printing shared by
them lives in cli/common.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from moelab.cli.common import new_outputs, remove_new_outputs  # (the standard library alone: no start-up cost)
from moelab.errors import ConfigError, Interrupted, RunError, UsageError

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (what is wrong and where to read more) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moelab", description="An open laboratory for MoE training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    # the areas load here, not when this module does: the `moelab` command restarts itself with huge
    # pages (main) before anything heavy is imported, not after
    from moelab.cli import bench, config, lab, ladder, plan, train, use

    for area in (config, train, lab, ladder, plan, bench, use):
        area.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
    except BrokenPipeError:  # the reader left (`moelab config --explain model | head`): quiet, as SIGPIPE would be
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush then goes nowhere
        code = 128 + 13
    except KeyboardInterrupt:  # before the command began (its imports, its arguments)
        print("moelab: interrupted", file=sys.stderr)
        code = INTERRUPTED
    if argv is None:  # the command itself: out at once when it is done (moelab/_alloc.py)
        from moelab._alloc import leave

        leave(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    if argv is None:  # the command itself (not a call from Python): restart with huge pages (moelab/_alloc.py)
        from moelab._alloc import restart_with_hugepages

        restart_with_hugepages(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    started, created = time.time_ns(), new_outputs(args)  # a refused command leaves none of them behind
    try:
        code = args.func(args)
        if code == 2:  # refused where it was said (a supervised run's first process)
            remove_new_outputs(created, started)
        return code
    except ConfigError as exc:
        remove_new_outputs(created, started)
        for line in exc.errors:
            print(f"moelab: {line}", file=sys.stderr)
        return 2
    except UsageError as exc:
        remove_new_outputs(created, started)
        print(f"moelab: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"moelab: {exc}", file=sys.stderr)
        return 3
    except Interrupted as exc:  # a run stopped at a step boundary, its checkpoint saved
        print(f"moelab: {exc}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # anywhere else (or a second Ctrl-C): one line, not a traceback
        remove_new_outputs(created, started)  # what it had begun, unless it records work done (a checkpoint)
        print(f"moelab: interrupted; {_kept(args)}", file=sys.stderr)
        return INTERRUPTED


def _kept(args) -> str:
    """What an interrupted command leaves: a run keeps its newest complete checkpoint and its records."""
    out = getattr(args, "out", None)
    if getattr(args, "command", None) == "train" and out and os.path.isdir(out):
        return f"what {out} holds is kept (moelab train --resume --out {out} continues from its newest checkpoint)"
    return "the outputs it had begun are removed"


if __name__ == "__main__":
    sys.exit(main())
