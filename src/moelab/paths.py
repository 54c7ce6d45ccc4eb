"""Paths moelab writes to: a local folder, or an object store's URL (gs://...) through etils' epath."""

from __future__ import annotations

from pathlib import Path

from etils import epath


def is_local(root) -> bool:
    """Whether ``root`` is a POSIX path (fsync and rename apply) rather than an object store URL."""
    return "://" not in str(root)


def as_path(root):
    """``root`` as a path object: a pathlib.Path when local, an etils epath.Path for a URL (gs://...)."""
    return Path(root) if is_local(root) else epath.Path(str(root))
