"""Shared test helpers: the reference facts and small configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = ROOT.parent / "shared" / "reference" / "marin_hero.json"
PACKAGE_REFERENCE = ROOT / "src" / "moelab" / "reference" / "marin_hero.json"


@pytest.fixture(scope="session")
def marin() -> dict:
    """Marin's published facts: the project's shared/ copy, else the copy shipped in the package."""
    path = SHARED_REFERENCE if SHARED_REFERENCE.exists() else PACKAGE_REFERENCE
    return json.loads(path.read_text())


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, cwd=ROOT)
