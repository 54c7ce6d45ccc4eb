"""Generation tasks: a prompt, completions the model writes, and a check of each (issue 41, item 4).

A task file is JSON lines, one task per line, each with a ``prompt`` and exactly one check:

- ``{"prompt": str, "tests": str}``: prompt + completion + tests run as one Python program in a
  sandbox (``run_program``); the completion passes when the program exits 0 (HumanEval's form).
- ``{"prompt": str, "target": str}``: exact match of the completion and the target, each stripped
  of surrounding white space.
- ``{"prompt": str, "regex": str}``: the pattern is found in the completion (``re.search``).

A line may also name its task (``"name"``) and say where a completion ends (``"stop"``, a list of
strings; by default DEFAULT_STOPS of its check: HumanEval's for a program, the line's end for a
target). A bad line is refused in one line naming file:line.

``model_completions`` samples completions from a moelab model (``moelab.model.decode``): one greedy
completion per prompt, or k at a temperature, each from its own seed, cut at the first stop string.
``pass_at_k`` is Chen et al. (2021)'s unbiased estimator of pass@k from n samples of which c pass.

The sandbox is a subprocess in a scratch folder of its own (removed after), with a time limit, a
memory limit and a cap on its processes (a fork bomb), in its own session so that it is killed with
every process it started. Where the machine allows user namespaces (``unshare``), it runs without a
network, with every folder but its own read-only, in a pid namespace of its own; elsewhere Python's
audit hooks refuse sockets, new processes and writes outside its folder (``Sandbox.isolation``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from moelab.errors import UsageError
from moelab.jsonl import input_records
from moelab.model.decode import Generator

CHECKS = ("tests", "target", "regex")
# where a completion ends unless its line says: a program at the next top-level statement (HumanEval's
# stop sequences), a target at the line's end, a pattern at the token limit
DEFAULT_STOPS = {"tests": ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"), "target": ("\n",), "regex": ()}

# the namespace mode: run as `sh -c SETUP sh SCRATCH PROGRAM...` inside new user, network, mount and pid
# namespaces. It keeps the scratch folder writable (a bind mount of itself), makes every other mount
# read-only, then enters a second user and mount namespace so that the program, root there, cannot make
# them writable again (the kernel locks a read-only flag inherited by a less privileged namespace)
SETUP = """S="$1"; shift
mount --bind "$S" "$S" || exit 97
while read -r _ _ _ _ mp _; do
  [ "$mp" = "$S" ] || [ "$mp" = /proc ] || mount -o remount,bind,ro "$mp" 2>/dev/null
done < /proc/self/mountinfo
cd "$S" || exit 97
exec unshare -rm "$@"
"""
NAMESPACES = ["unshare", "-rnmpf", "--mount-proc", "--kill-child"]

# run as `python -I -S -c LIMITER MEM,CPU,FSIZE,NPROC CGROUP PATH ARGV...`: sets the limits on itself,
# joins the pids cgroup (when one is named), then becomes the program (exec)
LIMITER = """import os, resource, sys
mem, cpu, fsize, nproc = map(int, sys.argv[1].split(","))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if nproc:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
if sys.argv[2]:
    with open(os.path.join(sys.argv[2], "cgroup.procs"), "w") as fh:
        fh.write(str(os.getpid()))
os.execv(sys.argv[3], sys.argv[4:])
"""

# the fallback (no namespaces), run before the program: no socket, no new process, no native code, and
# no file opened for writing, made, moved or removed outside the scratch folder (Python's audit hooks:
# a guard for the programs a model writes, not a wall against one written to escape it)
GUARD = """import sys as _sys, os as _os
def _guard(event, args, _root=_os.path.realpath(_os.getcwd()) + _os.sep, _os=_os):
    def _inside(p):
        if isinstance(p, int):
            return True
        return _os.path.realpath(_os.fsdecode(p)).startswith(_root)
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.system",
                         "os.spawn", "pty.", "ctypes.", "os.kill", "signal.pthread_kill")):
        if event not in ("socket.getaddrinfo", "socket.gethostname"):
            raise PermissionError(f"{event} is not allowed in the sandbox")
    elif event == "open" and args[0] is not None and (
            (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
            or (isinstance(args[2], int) and args[2] & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT))):
        if not _inside(args[0]):
            raise PermissionError(f"writing {args[0]} is outside the sandbox's folder")
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                   "os.symlink", "os.link", "os.rename", "shutil.rmtree"):
        for p in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
            if p is not None and not _inside(p):
                raise PermissionError(f"{event} {p} is outside the sandbox's folder")
_sys.addaudithook(_guard)
del _sys, _os, _guard
"""


@dataclass(frozen=True)
class GenTask:
    """One task: its prompt and its check (``kind`` one of CHECKS, ``check`` the text of it)."""

    name: str
    prompt: str
    kind: str
    check: str
    stop: tuple[str, ...] = ()


def load_gen_tasks(path: str | Path, label: str = "") -> list[GenTask]:
    """The tasks of a JSON-lines file; UsageError naming file:line for a line that is not one."""
    path = Path(path)
    tasks = []
    for where, rec in input_records(path, label, "task object"):
        if not isinstance(rec, dict):
            raise UsageError(f"{where}: a task is a JSON object with a prompt and one of {', '.join(CHECKS)}")
        if not isinstance(rec.get("prompt"), str):
            raise UsageError(f'{where}: no "prompt" string')
        kinds = [k for k in CHECKS if k in rec]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise UsageError(f"{where}: give exactly one check of {', '.join(CHECKS)} (got {got})")
        kind = kinds[0]
        if not isinstance(rec[kind], str):
            raise UsageError(f'{where}: "{kind}" must be a string')
        if kind == "regex":
            try:
                re.compile(rec[kind])
            except re.error as exc:
                raise UsageError(f'{where}: "regex" is not a regular expression ({exc})') from None
        stop = rec.get("stop", DEFAULT_STOPS[kind])
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
            raise UsageError(f'{where}: "stop" must be a list of non-empty strings')
        name = rec.get("name", f"{path.stem}/{where.rsplit(':', 1)[1]}")
        tasks.append(GenTask(str(name), rec["prompt"], kind, rec[kind], tuple(stop)))
    if not tasks:
        raise UsageError(f"{label + ': ' if label else ''}{path}: holds no task")
    return tasks


def is_generation_file(path: str | Path) -> bool:
    """Whether a task file holds generation tasks (its first line has a "prompt"), not log-likelihood ones."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    return isinstance(rec, dict) and "prompt" in rec
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the log-likelihood reader refuses it, naming what is wrong
    return False


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k: 1 - C(n - c, k) / C(n, k), the chance that k of the n samples
    drawn without replacement hold at least one that passed (as a stable product)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class Outcome:
    passed: bool
    returncode: int | None  # None: killed at the time limit
    seconds: float
    output: str  # the last of what the program printed (stdout and stderr)


@cache
def _namespaces() -> bool:
    """Whether this machine lets this process make the namespaces of the sandbox (tried once, on /tmp)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="moelab-sandbox-") as scratch:
        cmd = [*NAMESPACES, "sh", "-c", SETUP, "sh", scratch, "sh", "-c", "touch made && ! touch /tmp/x 2>/dev/null"]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _user_processes() -> int:
    """How many processes this user runs now (RLIMIT_NPROC counts them all)."""
    uid, n = os.getuid(), 0
    for d in Path("/proc").glob("[0-9]*"):
        try:
            n += d.stat().st_uid == uid
        except OSError:
            pass
    return n


class _PidsCgroup:
    """A pids cgroup of its own for root, whom RLIMIT_NPROC does not hold (the kernel exempts root's
    own user): made under this process's cgroup with ``pids.max``, removed after. None where the
    machine's cgroups are not writable (``make`` returns None)."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def make(cls, limit: int) -> _PidsCgroup | None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            base = Path("/sys/fs/cgroup/pids") if "pids" in controllers.split(",") else None
            if controllers == "" and not Path("/sys/fs/cgroup/pids").is_dir():
                base = Path("/sys/fs/cgroup")  # the unified hierarchy (cgroup v2)
            if base is None:
                continue
            path = base / rel.lstrip("/") / f"moelab-sandbox-{os.getpid()}-{time.monotonic_ns()}"
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text(str(limit))
                return cls(path)
            except OSError:
                path.rmdir()
        return None

    def remove(self) -> None:
        for _ in range(100):  # the killed processes leave the group as the kernel reaps them
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


class Sandbox:
    """Runs Python programs under the limits of the module's docstring.

    ``isolation`` says how: "namespaces" (no network, every mount but the scratch folder read-only,
    a pid namespace whose processes all die with the program) or "audit hook" (the fallback where the
    machine makes no namespace: GUARD). ``process_limit`` says what caps the processes it may run at
    once (``processes``): "RLIMIT_NPROC", "pids cgroup", or None where neither can be set (root on a
    machine whose cgroups are not writable; the audit hook then refuses every new process)."""

    def __init__(self, timeout: float = 10.0, memory_mb: int = 1024, output_chars: int = 2000,
                 processes: int = 64, namespaces: bool | None = None):  # fmt: skip
        self.timeout, self.memory_mb, self.output_chars, self.processes = timeout, memory_mb, output_chars, processes
        use = _namespaces() if namespaces is None else namespaces
        if use and not _namespaces():
            raise UsageError("this machine makes no user namespace for the sandbox; leave namespaces unset")
        self.isolation = "namespaces" if use else "audit hook"
        if os.getuid() != 0:
            self.process_limit = "RLIMIT_NPROC"
        else:
            group = _PidsCgroup.make(1)
            self.process_limit = "pids cgroup" if group else None
            if group:
                group.remove()

    def _limits(self, group: _PidsCgroup | None) -> list[str]:
        """The command that sets the limits and then runs the rest of the command line (LIMITER): set in
        a process of its own, not between fork and exec (``preexec_fn`` is unsafe in a threaded process
        such as one running JAX)."""
        nproc = _user_processes() + self.processes if self.process_limit == "RLIMIT_NPROC" else 0
        spec = [self.memory_mb * 1024 * 1024, int(math.ceil(self.timeout)) + 1, 64 * 1024 * 1024, nproc]
        return [sys.executable, "-I", "-S", "-c", LIMITER, ",".join(map(str, spec)), str(group.path) if group else ""]

    def run(self, code: str) -> Outcome:
        """Run ``code``; passed when it exits 0 within the limits."""
        scratch = Path(tempfile.mkdtemp(prefix="moelab-sandbox-")).resolve()
        group = _PidsCgroup.make(self.processes + 4) if self.process_limit == "pids cgroup" else None
        try:
            program = scratch / "program.py"
            program.write_text(code if self.isolation == "namespaces" else GUARD + code)
            cmd = [sys.executable, "-I", "-B", str(program)]
            if self.isolation == "namespaces":
                cmd = [*NAMESPACES, "sh", "-c", SETUP, "sh", str(scratch), *cmd]
            cmd = [*self._limits(group), shutil.which(cmd[0]) or cmd[0], *cmd]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch), "LANG": "C.UTF-8"}
            log = scratch / "output.txt"  # a file, not a pipe: a process the program left behind cannot hold it open
            t0 = time.perf_counter()
            with open(log, "wb") as fh:
                proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
                try:
                    returncode = proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    returncode = None
                finally:
                    _kill_session(proc.pid)  # the program and whatever it left running
                    proc.wait()
            text = log.read_bytes().decode("utf-8", "replace")[-self.output_chars :]
            return Outcome(returncode == 0, returncode, time.perf_counter() - t0, text)
        finally:
            if group is not None:
                group.remove()
            shutil.rmtree(scratch, ignore_errors=True)


def _kill_session(pid: int) -> None:
    """SIGKILL to the program's session (its process group): the program and every process it started
    there (in the namespaces, the pid namespace's first process dies with it, and every other with that)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check(task: GenTask, completion: str, sandbox: Sandbox | None = None) -> bool:
    """Whether ``completion`` passes ``task``'s check."""
    if task.kind == "target":
        return completion.strip() == task.check.strip()
    if task.kind == "regex":
        return re.search(task.check, completion) is not None
    sandbox = sandbox or Sandbox()
    return sandbox.run(task.prompt + completion + "\n" + task.check + "\n").passed


def score(tasks: list[GenTask], completions: list[list[str]], ks=(1,), sandbox: Sandbox | None = None) -> dict:
    """pass@k for each k (averaged over tasks) from each task's samples, and each task's passes."""
    if len(completions) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} lists of completions")
    sandbox = sandbox or Sandbox()
    passes = [sum(check(t, c, sandbox) for c in samples) for t, samples in zip(tasks, completions, strict=True)]
    n = min(len(s) for s in completions)
    out = {f"pass@{k}": sum(pass_at_k(len(s), p, k) for s, p in zip(completions, passes, strict=True)) / len(tasks)
           for k in ks if k <= n}  # fmt: skip
    out["passed"] = {t.name: p for t, p in zip(tasks, passes, strict=True)}
    out["samples"] = n
    return out


def cut(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first of ``stops`` (all of it where none occurs)."""
    ends = [i for i in (text.find(x) for x in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def model_completions(generator, tok, tasks: list[GenTask], samples: int = 1, temperature: float = 0.8,
                      top_p: float = 0.95, max_new: int = 128, seed: int = 0, progress=None) -> list[list[str]]:  # fmt: skip
    """``samples`` completions of each task's prompt by ``generator`` (a ``moelab.model.decode.Generator``)
    with the run's tokenizer ``tok`` (``moelab.data.tokenizer.load_saved``): greedy for one sample, else at
    ``temperature`` and ``top_p``, sample j of task i from seed (seed, i, j). A prompt starts as a
    document does (after the bos or the end-of-text, as log-likelihood tasks score it) and keeps its last
    tokens where it is longer than the context leaves room for. ``progress(i)`` after each task."""
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be at least 1")
    start = tok.bos if tok.add_bos and tok.bos is not None else tok.eos
    room = max(generator.context - max_new, 1)
    out = []
    for i, task in enumerate(tasks):
        ids = [start, *tok.tokenizer.encode(task.prompt, add_special_tokens=False).ids][-room:]
        got = []
        for j in range(samples):

            def ended(new: list[int], stops=task.stop) -> bool:
                return bool(stops) and any(x in tok.tokenizer.decode(new) for x in stops)

            new, _ = generator.generate(
                ids, max_new, 0.0 if samples == 1 else temperature, 0, 1.0 if samples == 1 else top_p,
                seed=int(np.random.SeedSequence([seed, i, j]).generate_state(1)[0]), stop=tok.eos, until=ended,
                chunked=True,
            )  # fmt: skip
            if new and new[-1] == tok.eos:
                new = new[:-1]
            got.append(cut(tok.tokenizer.decode(new), task.stop))
        out.append(got)
        if progress is not None:
            progress(i)
    return out


def score_model(params, model_state, m, tok, tasks: list[GenTask], samples: int = 1, temperature: float = 0.8,
                max_new: int = 128, seed: int = 0, progress=None) -> dict:  # fmt: skip
    """A generation task scored for a model: ``model_completions``, then ``score`` with pass@1 (and
    pass@samples) in a default Sandbox; with each task's first completion (``first``)."""
    gen = Generator(params, model_state, m)
    got = model_completions(gen, tok, tasks, samples, temperature, max_new=max_new, seed=seed, progress=progress)
    out = score(tasks, got, (1, samples) if samples > 1 else (1,), Sandbox())
    out["first"] = {t.name: c[0] for t, c in zip(tasks, got, strict=True)}
    return out
