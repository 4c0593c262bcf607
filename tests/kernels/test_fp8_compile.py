"""The FP8 GEMV kernel lowered for an H100 (sm_90) without a GPU: the configurations the
interpreter cannot vouch for (an FP8 ``tl.dot`` with the rows quantized inside the kernel, wide
one-row blocks on 16 warps, explicit pipeline depths)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _fp8_triton as mod

fn = mod._fp8_gemv_kernel
names = list(fn.arg_names)
def signature(split_k):
    types = {}
    for name in names:
        if name.isupper():
            types[name] = "constexpr"
        elif name == "x_ptr":
            types[name] = "*bf16"
        elif name == "w_ptr":
            types[name] = "*fp8e4nv"
        elif name == "out_ptr":
            types[name] = "*bf16" if split_k == 1 else "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        else:
            types[name] = "fp32" if name in ("scale_ub", "fp8_max", "min_scale") else "i32"
    return types
flags = dict(USE_DOT=False, X_SCALE=False, FUSED_QUANT=False, STATIC=False, HAS_UB=False)
cases = (
    (dict(flags, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, USE_DOT=True, FUSED_QUANT=True), 4, 3, True),
    (dict(flags, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, USE_DOT=True, FUSED_QUANT=True, HAS_UB=True), 4, 3, True),
    (dict(flags, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, USE_DOT=True, FUSED_QUANT=True, STATIC=True), 8, 3, True),
    (dict(flags, BLOCK_M=1, BLOCK_N=16, BLOCK_K=2048, SPLIT_K=1), 16, 3, False),
    (dict(flags, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1), 4, 1, False),
)
for constants, warps, stages, dot in cases:
    source = ASTSource(fn, signature(constants["SPLIT_K"]),
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    assert ("mma" in compiled.asm["ptx"]) == dot, constants
print("compiled")
"""


def test_the_fp8_gemv_kernel_compiles_for_sm90_without_a_gpu() -> None:
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the Triton version
        pytest.skip(f"Triton {triton.__version__} has no ahead-of-time compile API: {exc}")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "No such file" in proc.stderr:  # pragma: no cover
        pytest.skip("Triton's bundled ptxas is missing")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
