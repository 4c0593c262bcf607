"""On machines where this process compiled Triton for CUDA, rerun the kernel tests in a
CPU-only subprocess with TRITON_INTERPRET=1 so the interpreter path is still covered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels


@pytest.mark.skipif(kernels.interpreter_enabled(), reason="interpreter tests already run in this process")
def test_interpreter_suite_in_subprocess() -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).parent), "-k", "interpret"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
