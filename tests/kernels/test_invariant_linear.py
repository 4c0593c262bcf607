"""Batch-invariant linear: the Triton kernel (interpreter on CPU, compiled on CUDA) against the
float32 oracle, a row's output bit for bit the same at every row count, the configuration read
from the weight's shape alone, and the kernel lowered for an H100 on a machine without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.gemv import skinny_linear_reference
from kernels.invariant_linear import invariant_config, invariant_linear
from tests.kernels.sm90 import compile_for_sm90

N, K = 200, 333  # not multiples of any block size


def _operands(rows: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, n: int = N, k: int = K):
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 7, 16, 37])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_reference_float32(backend, gen, rows: int, split_k: int) -> None:
    x, weight, bias = _operands(rows, torch.float32, gen, backend)
    got = invariant_linear(x, weight, bias, use_triton=True, split_k=split_k)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("split_k", [1, 2])
def test_matches_reference_bfloat16_without_bias(backend, gen, split_k: int) -> None:
    x, weight, _ = _operands(20, torch.bfloat16, gen, backend)
    got = invariant_linear(x, weight, None, use_triton=True, split_k=split_k)
    # bf16 tolerance: the interpreter truncates float32 -> bfloat16 (one ulp at most)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, None), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_at_every_row_count(backend, gen, dtype: torch.dtype) -> None:
    """The point of the kernel: row 0 alone, among 5, among 16 and among 40 (and at another
    place in the batch) gives identical bits, where the split-K layout is the one serving uses."""
    x, weight, bias = _operands(40, dtype, gen, backend)
    splits = invariant_config(N, K, x.device)[0] if backend.type == "cuda" else 2
    alone = invariant_linear(x[:1], weight, bias, use_triton=True, split_k=splits)
    for rows in (5, 16, 40):
        among = invariant_linear(x[:rows], weight, bias, use_triton=True, split_k=splits)
        assert torch.equal(among[0], alone[0]), rows
    shifted = torch.cat([x[20:37], x[:1]])  # row 0 as the 18th row: another tile, another lane
    assert torch.equal(invariant_linear(shifted, weight, bias, use_triton=True, split_k=splits)[-1], alone[0])


def test_leading_dims_are_flattened(backend, gen) -> None:
    x, weight, bias = _operands(6, torch.float32, gen, backend)
    got = invariant_linear(x.view(2, 3, K), weight, bias, use_triton=True)
    assert got.shape == (2, 3, N)
    torch.testing.assert_close(got.view(6, N), skinny_linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_reference_backend_is_linear(gen) -> None:
    x, weight, bias = _operands(3, torch.float32, gen, torch.device("cpu"))
    assert torch.equal(invariant_linear(x, weight, bias, use_triton=False), F.linear(x, weight, bias))


def test_shape_mismatch_is_refused(gen) -> None:
    x, weight, bias = _operands(2, torch.float32, gen, torch.device("cpu"))
    with pytest.raises(ValueError, match="weight"):
        invariant_linear(x[:, :-1], weight, bias)


def test_configuration_depends_on_the_weight_alone() -> None:
    cpu = torch.device("cpu")
    assert invariant_config(4096, 4096, cpu) == invariant_config(4096, 4096, cpu)
    assert invariant_config(4096, 4096, cpu)[0] == 1  # the interpreter and CPU run unsplit
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        narrow, wide = invariant_config(2048, 8192, gpu)[0], invariant_config(128256, 2048, gpu)[0]
        assert narrow > 1 and wide == 1  # a narrow layer splits K to fill the SMs at one row
    assert kernels.select_backend(torch.zeros(1)) == "reference"


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _invariant_gemm_triton as mod
from kernels.invariant_linear import _BLOCK_K, _BLOCK_N

def compile_for_h100(fn, dtype, constants):
    names = list(fn.arg_names)
    def arg_type(name):
        if name in constants:
            return "constexpr"
        if name.endswith("_ptr"):
            return "*fp32" if name == "part_ptr" else "*" + dtype
        return "i32"
    signature = {name: arg_type(name) for name in names}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

for dtype, split, bias in (("bf16", 1, True), ("bf16", 8, False), ("fp16", 4, True), ("fp32", 2, False)):
    constants = dict(BLOCK_M=mod.BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, SPLIT_K=split, HAS_BIAS=bias,
                     IEEE_DOT=dtype == "fp32", FP32_OPERANDS=False)
    compiled = compile_for_h100(mod._invariant_gemm_kernel, dtype, constants)
    if dtype != "fp32":
        assert "mma" in compiled.asm["ptx"], "tl.dot did not lower to tensor-core MMA"
print("compiled")
"""


def test_kernel_compiles_for_sm90_without_a_gpu() -> None:
    compile_for_sm90(_COMPILE_SCRIPT)
