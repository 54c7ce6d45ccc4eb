"""Append-only JSON-lines files whose records are written whole or not at all.

A record is one JSON object on one line, and its newline is its commit mark: a record is written
with one append (O_APPEND) ending in ``\\n``, so a crash mid-write leaves, at worst, a tail without
its newline. Such a torn tail is never read as a record; the next writer sets it aside, in
``<file>.torn`` beside the file (one JSON line per tail: where it was, its bytes), truncates it
away, and reports it (``append`` returns it; the callers record an event) before it writes its own
record, so a torn record can never swallow the next one. A line in the middle of a file that is not
a JSON object is not skipped: reading the file is an error naming the file and the line.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np

from moelab.errors import RecordError, UsageError

_CHUNK = 1 << 16


def _tail_start(fd: int, size: int) -> int:
    """The offset just past the file's last newline (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - _CHUNK)
        block = os.pread(fd, end - start, start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


def _set_aside(fd: int, path: Path) -> dict | None:
    """Move a torn tail (bytes after the last newline) into ``<path>.torn``; what was moved, or None."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return None
    start = _tail_start(fd, size)
    tail = os.pread(fd, size - start, start)
    torn = {"time": time.time(), "file": path.name, "offset": start, "length": len(tail),
            "bytes": tail.decode("utf-8", errors="backslashreplace")}  # fmt: skip
    aside = path.with_name(path.name + ".torn")
    afd = os.open(aside, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write_all(afd, (json.dumps(torn) + "\n").encode())
        os.fsync(afd)
    finally:
        os.close(afd)
    os.ftruncate(fd, start)
    return {**torn, "set_aside": aside.name}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def encode(rec: dict, default=None) -> bytes:
    line = json.dumps(rec, allow_nan=True, default=default)
    if "\n" in line:  # json.dumps escapes newlines in strings; only a custom default could do this
        raise ValueError("a JSON-lines record must be one line")
    return (line + "\n").encode()


def append(path: str | Path, rec: dict, *, default=None, lock: bool = False, sync: bool = True) -> dict | None:
    """Append ``rec`` as one line, whole (a torn tail before it is set aside first: see the module).
    ``lock``: hold an exclusive lock while writing (several writers); ``sync``: fsync before
    returning (a record that is a commitment). Returns the torn tail set aside, or None."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode(rec, default)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
        torn = _set_aside(fd, path)
        _write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock
    return torn


def read(path: str | Path) -> list[dict]:
    """Every whole record of the file, in order; a torn tail (no newline yet) is not one. A line
    that is not a JSON object before the tail: RecordError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    whole = lines[:-1]  # the piece after the last newline is empty or a torn tail
    out = []
    for n, line in enumerate(whole, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec = None
        if not isinstance(rec, dict):
            raise RecordError(
                f"{path}:{n}: not a whole record ({line[:60]!r}); a record cannot be read in the middle of the "
                "file: restore the file from a copy, or move the line out by hand and say so in the record"
            )
        out.append(rec)
    return out


def torn_tail(path: str | Path) -> bytes:
    """The bytes after the file's last newline: a record cut short, not yet set aside (b"" if none)."""
    path = Path(path)
    if not path.exists():
        return b""
    data = path.read_bytes()
    return data[data.rfind(b"\n") + 1 :]


def jsonable(x):
    """``x`` with NumPy and JAX arrays as plain numbers and lists, for JSON."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__array__"):
        arr = np.asarray(x)
        return arr.item() if arr.ndim == 0 else arr.tolist()
    return x


def input_records(path: str | Path, label: str = "", what: str = "record"):
    """(where, record) for each non-blank line of a JSON-lines input file (a task file, a data file a
    user names): ``where`` is "label: file:line" for the caller's own refusals; a file that cannot be
    read or a line that is not JSON is a UsageError naming the file (and the line)."""
    path = Path(path)
    head = f"{label}: {path}" if label else str(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UsageError(f"{head}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"{head}: cannot be read ({exc.strerror or exc})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{head}:{n}: not a JSON object ({exc.msg}); each line is one {what}") from None
        yield f"{head}:{n}", rec
