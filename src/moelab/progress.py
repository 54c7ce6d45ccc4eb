"""What a long phase says while it runs: a tqdm bar on a terminal; elsewhere (CI, a log file, nohup)
plain lines on stderr every few seconds, so a log never goes silent."""

from __future__ import annotations

import os
import sys
import time


def say(text: str, enabled: bool = True) -> None:
    """One line about the phase that starts now (stderr, flushed)."""
    if enabled:
        print(f"moelab: {text}", file=sys.stderr, flush=True)


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
