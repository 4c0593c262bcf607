"""``benchmarks/json_schema_suite.py --smoke``: three groups in the suite's form, written by the
script itself (no checkout), go through the benchmark's workers and tables end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_passes_its_three_groups():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "json_schema_suite.py"), "--smoke", "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| core | 3 | 3 / 0 / 0 / 0 |" in done.stdout, done.stdout
