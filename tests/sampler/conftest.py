"""Sampler tests: make the repository importable; provide devices and small TokenDFAs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for path in (str(_HERE.parents[1]), str(_HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    """CPU always; CUDA when present."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)
