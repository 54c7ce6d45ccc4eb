"""What a long phase says while it runs: a tqdm bar on a terminal; elsewhere (CI, a log file, nohup)
plain lines on stderr every few seconds, so a log never goes silent. With MOELAB_TIMING=1 a command
also stamps each phase of its process and prints their seconds at its end (``phase``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def say(text: str, enabled: bool = True) -> None:
    """One line about the phase that starts now (stderr, flushed)."""
    if enabled:
        print(f"moelab: {text}", file=sys.stderr, flush=True)


TIMING_ENV = "MOELAB_TIMING"
# (name, wall time, CPU seconds of the process) at each phase's start, the process's start first
_phases: list[tuple[str, float, float]] = []


def _process_age() -> float | None:
    """Seconds since this process started (an exec, such as the huge-pages restart, keeps the start), or
    None where /proc does not say."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def phase(name: str) -> None:
    """The phase ``name`` of this process starts now (the one before ends). Off unless MOELAB_TIMING=1:
    then each start is a line on stderr, ``moelab: timing: NAME at T s, cpu C s`` (T from the process's
    start, C the CPU seconds of all its threads so far), and ``exit`` (the command is done; the
    interpreter's shutdown follows) prints the seconds each phase took, wall and CPU, phases of the same
    name added up (a run's evaluations, its checkpoints). The CPU seconds say where the work is on a
    machine whose other load stretches the wall time."""
    if os.environ.get(TIMING_ENV) != "1":
        return
    if _phases and _phases[-1][0] == name:
        return  # still in it (the steps between a run's evaluations and checkpoints)
    now, times = time.time(), os.times()
    if not _phases:
        age = _process_age()
        _phases.append(("start-up", now - age if age is not None else now, 0.0))
    _phases.append((name, now, times.user + times.system))
    t0 = _phases[0][1]
    print(f"moelab: timing: {name} at {now - t0:.2f} s, cpu {_phases[-1][2]:.2f} s", file=sys.stderr, flush=True)
    if name == "exit":
        took: dict[str, list[float]] = {}
        for (what, start, cpu0), (_, end, cpu1) in zip(_phases, _phases[1:], strict=False):
            row = took.setdefault(what, [0.0, 0.0])
            row[0] += end - start
            row[1] += cpu1 - cpu0
        rows = "".join(f"\n  {what:<14} {w:7.2f} {c:7.2f}" for what, (w, c) in took.items())
        print(f"moelab: seconds per phase ({TIMING_ENV}=1), {now - t0:.2f} to the exit; wall, then CPU:{rows}",
              file=sys.stderr, flush=True)  # fmt: skip


def _eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """``update(n)``, ``set_postfix(**fields)``, ``write(text)``, ``close()``: a tqdm bar when stderr is
    a terminal, else a line every ``every`` seconds (MOELAB_PROGRESS_EVERY, default 10) with the
    count, the fields and the time left."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "it", enabled: bool = True,
                 every: float | None = None):  # fmt: skip
        self.total, self.n, self.desc, self.unit, self.enabled = total, initial, desc, unit, enabled
        self.every = float(os.environ.get("MOELAB_PROGRESS_EVERY", 10)) if every is None else every
        self.fields: dict = {}
        self.bar = None
        self.t0 = self.last = time.monotonic()
        self.first: tuple[float, int] | None = None  # time and count at the first update (after a compile)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.first is None:
            self.first = (time.monotonic(), self.n)
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (
            self.first[1] == self.n or time.monotonic() - self.last >= self.every or self.n >= self.total
        ):
            self._line()

    def set_postfix(self, **fields) -> None:
        self.fields.update(fields)
        if self.bar is not None:
            self.bar.set_postfix(**fields)

    def write(self, text: str) -> None:
        if self.bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.last != self.t0 and self.n < self.total:
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        self.last = now
        t1, n1 = self.first or (now, self.n)
        rate = (self.n - n1) / (now - t1) if now > t1 else 0.0  # from the first update: a compile is not speed
        left = f", about {_eta((self.total - self.n) / rate)} left" if rate > 0 and self.n < self.total else ""
        extra = "".join(f", {k} {v}" for k, v in self.fields.items())
        pct = f" ({self.n / self.total:.0%})" if self.total else ""
        print(f"{self.desc}: {self.unit} {self.n}/{self.total}{pct}{extra}{left}", file=sys.stderr, flush=True)
