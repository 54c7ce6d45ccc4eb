"""`moelab demo` (what `make demo` runs) end to end, shorter and on less of the standard library."""

from __future__ import annotations

import json
import re

from conftest import run_cli


def test_demo_prints_accounting_trains_and_summarises(tmp_path):
    out = tmp_path / "demo"
    res = run_cli(
        "demo",
        "--steps",
        "6",
        "--out",
        str(out),
        "--set",
        "data.max_bytes_per_domain=400000",
        "--set",
        "train.eval_every=6",
        "--set",
        "train.eval_tokens=2048",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout
    assert "535.3B [535.3B]" in text and "22.76B [22.76B]" in text
    worst = float(re.search(r"largest relative difference from Marin's figures: ([0-9.]+)%", text).group(1))
    assert worst < 0.5
    for domain in ("stdlib-code", "stdlib-tests", "stdlib-docs", "macro"):
        assert re.search(rf"^  {domain}\s+[0-9.]+\s+[0-9.]+", text, re.M), domain
    assert "tokens/s" in text and "MFU" in text and str(out) in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and (out / "metrics.jsonl").exists() and (out / "ckpt").exists()
