"""Kernels lowered for an H100 (sm_90) on a machine without one: Triton's ahead-of-time compile
through its NVIDIA backend and ptxas, in a subprocess with the interpreter off. Catches what the
interpreter forgives (types across loop iterations, dot shapes, constexpr misuse)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_for_sm90(script: str) -> None:
    """Run ``script`` (which compiles and prints "compiled") from the repository root; skip where
    this Triton has no ahead-of-time API or no bundled ptxas."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the Triton version
        pytest.skip(f"Triton {triton.__version__} has no ahead-of-time compile API: {exc}")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode and "ptxas" in proc.stderr and "No such file" in proc.stderr:  # pragma: no cover
        pytest.skip("Triton's bundled ptxas is missing")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def compile_for_h100(fn, dtype: str, constants: dict, num_warps: int = 4):
    """Lower Triton kernel ``fn`` for an H100 (sm_90) with ``constants`` as its constexprs; other
    arguments typed ``*dtype`` (``part_ptr``: float32) for pointers and i32 otherwise. For the
    scripts :func:`compile_for_sm90` runs (the interpreter off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)

    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*fp32" if name == "part_ptr" else "*" + dtype
        return "i32"

    signature = {name: arg_type(name) for name in names}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})
