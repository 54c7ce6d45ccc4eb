"""`moelab demo` (what `make demo` runs) end to end, with fewer steps."""

from __future__ import annotations

import re

from conftest import run_cli


def test_demo_prints_accounting_and_moe_metrics():
    res = run_cli("demo", "--steps", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "marin-535b-a23b" in out and "535.3B [535.3B]" in out and "22.76B [22.76B]" in out
    worst = float(re.search(r"largest relative difference from Marin's figures: ([0-9.]+)%", out).group(1))
    assert worst < 0.5
    loss = float(re.search(r"forward \+ backward on .*?: loss ([0-9.]+)", out).group(1))
    assert 5.0 < loss < 12.0  # near ln(2048) = 7.6 at initialisation
    assert out.count("dropped_frac") == 2 and "tokens/s" in out
