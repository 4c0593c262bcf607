"""``benchmarks/gemv.py``: the projection shapes are the Llama ones, the CPU run checks every
scaled-down shape under the Triton interpreter and exits 0, and on CUDA a short run times and
prints every shape (so the command meant for a GPU is known to work before device time is spent)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gemv

ROOT = Path(__file__).resolve().parents[2]


def test_projection_shapes_are_llama_decode_shapes():
    assert gemv.projections("1b") == {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                                      "down": (2048, 8192), "lm_head": (128256, 2048)}
    assert gemv.projections("8b")["qkv"] == (6144, 4096) and gemv.projections("8b")["down"] == (4096, 14336)
    small = gemv.shapes(["1b"], [1, 8], scale=32)
    assert len(small) == 10 and (small[0].n, small[0].k, small[0].batch) == (96, 64, 1)


def test_cpu_run_checks_every_shape_under_the_interpreter():
    """In a CPU-only subprocess (compiled vs interpreted Triton is fixed per process)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "benchmarks/gemv.py", "--models", "1b", "--batches", "1", "8", "--scale", "32"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "Triton interpreter" in lines[0] and "scaled down 32x" in lines[0]
    assert len(lines) == 11 and all(line.endswith(" ok") for line in lines[1:]), proc.stdout


@pytest.mark.gpu
def test_cuda_run_times_every_shape(capsys):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert gemv.main(["--models", "1b", "--batches", "1", "8", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count(" b=1 ") == 5 and out.count(" b=8 ") == 5 and "GemvChoice table" in out
