"""`--max-restarts N`: a supervising process that restarts a dead training process from its newest checkpoint.

A crash, a kill or an out-of-memory costs at most the work since the last checkpoint. Each
restart is an event with its cause. A refusal (exit code 2) or a run the NaN guard stopped
(exit code 3) is not retried: running it again would fail the same way.

In a multi-process job each process has its own supervisor, and the child is that process's own
command (its --coordinator and --process-id included); the supervisor itself never joins the job.
Ctrl-C and SIGTERM reach the supervisor alone (the child runs in a process group of its own), which
passes each on to the child: the child saves a checkpoint at its next step boundary and exits 130, and
the supervisor exits with it, restarting nothing; a second one stops the child at once.

A member that dies takes the job down: the others fail at their next collective (or when the
coordinator, process 0, is gone) and their supervisors restart them too. The restarted processes meet
again at the coordinator and resume from the newest checkpoint, which all of them share.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
from pathlib import Path

from moelab.runs import RunDir

NOT_RETRIED = {0: "finished", 2: "refused", 3: "stopped by the run itself", 130: "stopped by the user"}


def _cause(code: int, tail: list[str]) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    last = next((line for line in reversed(tail) if line.strip()), "")
    return f"exit code {code}" + (f": {last.strip()[:300]}" if last else "")


def supervise(child_args: list[str], out: str, max_restarts: int, records: str | Path | None = None) -> int:
    """Run ``moelab train child_args`` until it finishes, restarting with --resume up to max_restarts times.

    The child is the whole process: in a multi-process job it joins the job itself, with its own
    --process-id (the supervisor joins nothing). The restarts are recorded in ``records`` (the run,
    ``out``, by default; a job's process I > 0 keeps its own records in ``out/.process-I``)."""
    run = RunDir(out if records is None else records)
    restarts = 0
    args = list(child_args)
    stopping: list[int] = []  # the signals passed on to the child
    while True:
        # a process group of its own: a terminal's Ctrl-C reaches the supervisor, which passes it on once
        proc = subprocess.Popen([sys.executable, "-m", "moelab", "train", *args], stderr=subprocess.PIPE, text=True,
                                process_group=0)  # fmt: skip

        def pass_on(signum, frame, p=proc):
            stopping.append(signum)
            p.send_signal(signum)

        main = threading.current_thread() is threading.main_thread()  # (handlers live in the main thread)
        before = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        tail: collections.deque[str] = collections.deque(maxlen=20)

        def pump(p=proc, t=tail):
            for line in p.stderr:
                sys.stderr.write(line)
                t.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        code = proc.wait()
        reader.join(timeout=5)
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if code in NOT_RETRIED:
            return code
        if stopping:  # stopped at once by a second signal: the user's stop, not a death to restart from
            return 128 + stopping[0]
        cause = _cause(code, list(tail))
        if restarts >= max_restarts:
            run.event("gave_up", restarts=restarts, cause=cause)
            print(
                f"moelab: training died ({cause}) and {max_restarts} restarts are used up; "
                f"continue with --resume --out {out}",
                file=sys.stderr,
            )
            return 1
        restarts += 1
        run.event("restart", restart=restarts, of=max_restarts, cause=cause, exit_code=code)
        print(
            f"moelab: training died ({cause}); restart {restarts} of {max_restarts} from the newest checkpoint",
            file=sys.stderr,
        )
        # from the newest checkpoint, or from step 0 when the child died before its first one
        args += [flag for flag in ("--resume", "--restart") if flag not in args]
