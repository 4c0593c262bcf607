"""The FP8 GEMV kernel lowered for an H100 (sm_90) without a GPU: what the interpreter cannot
vouch for (an FP8 x FP8 ``tl.dot`` on a few rows padded to a 16-row tile, static scales, splits,
the one-row register lanes)."""

from __future__ import annotations

from tests.kernels.sm90 import compile_for_sm90

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _fp8_triton as mod

fn = mod._fp8_gemv_kernel
names = list(fn.arg_names)
def signature(split_k, x_fp8):
    types = {}
    for name in names:
        if name.isupper():
            types[name] = "constexpr"
        elif name == "x_ptr":
            types[name] = "*fp8e4nv" if x_fp8 else "*bf16"
        elif name == "w_ptr":
            types[name] = "*fp8e4nv"
        elif name == "out_ptr":
            types[name] = "*bf16" if split_k == 1 else "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        else:
            types[name] = "i32"
    return types
flags = dict(USE_DOT=False, X_SCALE=False)
cases = (
    (dict(flags, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, USE_DOT=True, X_SCALE=True), 4, True),
    (dict(flags, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, USE_DOT=True, X_SCALE=True), 4, True),
    (dict(flags, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, USE_DOT=True), 8, True),
    (dict(flags, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1), 4, False),
)
for constants, warps, dot in cases:
    source = ASTSource(fn, signature(constants["SPLIT_K"], constants["X_SCALE"]),
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert ("mma" in compiled.asm["ptx"]) == dot, constants
print("compiled")
"""


def test_the_fp8_gemv_kernel_compiles_for_sm90_without_a_gpu() -> None:
    compile_for_sm90(_SCRIPT)
