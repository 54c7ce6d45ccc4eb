"""`make bench`: every benchmark script in this folder, one after another, each printing its figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = ["moe_dispatch.py", "fault_detection.py", "drops_vs_context.py"]

if __name__ == "__main__":
    failed = []
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script)]).returncode != 0:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
