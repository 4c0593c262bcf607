"""Kernel test setup: enable the Triton interpreter on CPU-only machines, before any kernel
module is imported (Triton picks compiled vs interpreted at decoration time)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# On CPU-only machines run the Triton kernels in the interpreter. Triton reads the flag when
# kernels are decorated *and* while they run, so it stays set for this test process (it only
# changes how Triton kernels execute; nothing here compiles Triton for CPU otherwise).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402  (after the environment is set)


def _interpreter_skip_reason() -> str | None:
    """Why the Triton interpreter cannot run the kernels in this process, or None."""
    mod = kernels.triton_kernels()
    if mod is None:
        return "triton cannot be imported here"
    if type(mod._mask_rows_kernel).__name__ != "InterpretedFunction":
        return "Triton kernels are compiled (not interpreted) in this process: see test_kernel_interpreter_subprocess"
    try:
        x = torch.zeros(1, 33)
        kernels.apply_token_bitmask_inplace(x, torch.zeros(1, 2, dtype=torch.int32), use_triton=True)
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"triton interpreter does not run here: {exc!r}"
    if not torch.isneginf(x).all():
        return "triton interpreter produced wrong results on a smoke test"
    return None


@pytest.fixture(params=["interpret", "cuda"])
def backend(request: pytest.FixtureRequest) -> torch.device:
    """Device on which the Triton path is exercised (CPU interpreter or real CUDA)."""
    if request.param == "interpret":
        reason = _interpreter_skip_reason()
        if reason:
            pytest.skip(reason)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if kernels.interpreter_enabled() or kernels.triton_kernels() is None:
        pytest.skip("compiled Triton unavailable in this process")
    return torch.device("cuda")


@pytest.fixture
def gen() -> torch.Generator:
    """Seeded CPU generator for test data."""
    return torch.Generator().manual_seed(1234)
