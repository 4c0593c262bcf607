"""Backend selection shared by all kernels: Triton when it can run, pure torch otherwise.

Triton is imported lazily and guarded: a machine without a usable Triton backend (no
package, no GPU, broken toolchain) silently gets the pure-torch reference path.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["triton", "reference"]


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def interpreter_enabled() -> bool:
    """True when the Triton kernels run in the interpreter (on host tensors).

    Decided once, when the kernel module is first imported (Triton picks compiled vs
    interpreted at decoration time from ``TRITON_INTERPRET``); before that, the env var.
    """
    if triton_kernels.cache_info().currsize:
        mod = triton_kernels()
        return bool(mod is not None and mod.INTERPRETED)
    return _env_interpret()


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The module holding the ``@triton.jit`` kernels, or None when Triton cannot be imported.

    Note: Triton decides between compiled and interpreted kernels when the module is first
    imported (decoration time), so ``TRITON_INTERPRET`` must be set before the first call.
    """
    try:
        from kernels import _triton_kernels
    except Exception:  # ImportError, or a broken backend raising at import
        return None
    return _triton_kernels


@functools.cache
def layer_kernels() -> ModuleType | None:
    """The module holding a decoder layer's fused Triton kernels (norms, rotary, activation),
    or None when Triton cannot be imported."""
    try:
        from kernels import _layer_triton
    except Exception:  # ImportError, or a broken backend raising at import
        return None
    return _layer_triton


def select_backend(t: torch.Tensor, use_triton: bool | None = None) -> Backend:
    """Which implementation a kernel call on tensor ``t`` runs.

    * ``use_triton=False``: reference.
    * CUDA tensor and ``use_triton`` None/True: Triton if importable, else reference.
    * Otherwise (CPU tensor, or interpreter mode): Triton only if ``use_triton=True`` and
      ``TRITON_INTERPRET=1`` (the interpreter runs the kernels on the host), else reference.
    """
    if use_triton is False or (not t.is_cuda and not use_triton):
        return "reference"
    mod = triton_kernels()
    if mod is None:
        return "reference"
    if mod.INTERPRETED:  # interpreter: only on explicit request (tests)
        return "triton" if use_triton else "reference"
    return "triton" if t.is_cuda else "reference"
