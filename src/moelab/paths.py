"""Paths moelab writes to: a local folder, or an object store's URL (gs://...) through etils' epath."""

from __future__ import annotations

from pathlib import Path

from etils import epath

from moelab.errors import UsageError


def is_local(root) -> bool:
    """Whether ``root`` is a POSIX path (fsync and rename apply) rather than an object store URL."""
    return "://" not in str(root)


def as_path(root):
    """``root`` as a path object: a pathlib.Path when local, an etils epath.Path for a URL (gs://...)."""
    return Path(root) if is_local(root) else epath.Path(str(root))


def writable_place(out: str | Path, flag: str = "--out", make: bool = False) -> None:
    """Whether ``out`` can be written: its nearest existing folder is a folder this process may write
    in (with ``make``, the missing folders on the way are made now). Refused in one line (UsageError)
    naming the flag, rather than a traceback once the work is done."""
    import os
    import tempfile

    out = Path(os.path.abspath(out))
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise UsageError(f"{flag} {out}: {above} is a file, not a folder; choose another place")
    try:  # a folder made and removed: what this process may really write there (root or not, /proc or not)
        os.rmdir(tempfile.mkdtemp(prefix=".moelab-probe-", dir=above))
    except OSError as exc:
        raise UsageError(
            f"{flag} {out}: cannot write in {above} ({exc.strerror or exc}); choose a writable place"
        ) from None
    if make:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"{flag} {out}: cannot create {out.parent} ({exc.strerror or exc}); choose a writable place"
            ) from None
