"""``benchmarks/batch_invariance.py --smoke``: the invariant kernels leave a row's bits alone at every
row count, in attention tiles and in whole runner steps (scaled down, Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_invariant_rows():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/batch_invariance.py", "--smoke"], check=False, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    gemms = [line for line in lines if line.startswith("gemm ")]
    assert len(gemms) == 5 and all("invariant 0/8 differ" in line for line in gemms), proc.stdout
    assert any(line.startswith("attention") and line.endswith("identical") for line in lines), proc.stdout
    invariant = next(line for line in lines if line.startswith("runner batch-invariant"))
    assert invariant.count("identical") == 2, invariant
    assert any(line.startswith("runner default") for line in lines), proc.stdout
