"""Batch-invariant linear: the Triton kernel (interpreter on CPU, compiled on CUDA) against the
float32 oracle, a row's output bit for bit the same at every row count and tile, the tile
choice, and the kernel lowered for an H100 on a machine without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import invariant_linear as module
from kernels.gemv import skinny_linear_reference
from kernels.invariant_linear import BASE_TILE, agreeing_tiles, invariant_linear, tile_for
from tests.kernels.sm90 import compile_for_sm90

N, K = 200, 333  # not multiples of any block size
TILES = [(16, 64, 4), (16, 16, 4), (64, 64, 4)]  # float32 operands: 128 x 128 exceeds shared memory


def _operands(rows: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device):
    x = torch.randn(rows, K, generator=gen).to(dtype).to(device)
    weight = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(device)
    bias = torch.randn(N, generator=gen).to(dtype).to(device)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 7, 37])
@pytest.mark.parametrize("tile", TILES)
def test_matches_reference_float32(backend, gen, rows: int, tile) -> None:
    x, weight, bias = _operands(rows, torch.float32, gen, backend)
    got = invariant_linear(x, weight, bias, use_triton=True, tile=tile)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tile", [(16, 64, 4), (128, 128, 8)])
def test_matches_reference_bfloat16_without_bias(backend, gen, tile) -> None:
    x, weight, _ = _operands(150, torch.bfloat16, gen, backend)
    got = invariant_linear(x, weight, None, use_triton=True, tile=tile)
    # bf16 tolerance: the interpreter truncates float32 -> bfloat16 (one ulp at most)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, None), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_at_every_row_count(backend, gen, dtype: torch.dtype) -> None:
    """The point of the kernel: row 0 alone, among 5, 16, 40 and 150 rows (each count with the
    tile serving would pick) and at another place in the batch gives identical bits."""
    x, weight, bias = _operands(150, dtype, gen, backend)
    alone = invariant_linear(x[:1], weight, bias, use_triton=True)
    for rows in (5, 16, 40, 150):
        among = invariant_linear(x[:rows], weight, bias, use_triton=True)
        assert torch.equal(among[0], alone[0]), rows
    shifted = torch.cat([x[20:37], x[:1]])  # row 0 as the 18th row: another tile, another lane
    assert torch.equal(invariant_linear(shifted, weight, bias, use_triton=True)[-1], alone[0])


def test_every_tile_agrees_where_the_device_says_so(backend, gen) -> None:
    """The tiles :func:`agreeing_tiles` keeps give the base tile's bits (the others are never used:
    the interpreter's numpy sums a 64- or 128-row tile in another order, an H100 does not)."""
    x, weight, bias = _operands(70, torch.bfloat16, gen, backend)
    kept = agreeing_tiles(backend.type, backend.index, torch.bfloat16)
    assert BASE_TILE in kept and len(kept) >= 2
    base = invariant_linear(x, weight, bias, use_triton=True, tile=BASE_TILE)
    for tile in kept:
        assert torch.equal(invariant_linear(x, weight, bias, use_triton=True, tile=tile), base), tile


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


def test_tiles_follow_rows_and_fill_the_device(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert tile_for(1, 2048, cpu) == tile_for(64, 2048, cpu) == (16, 64, 4)
    assert tile_for(65, 2048, cpu) == (128, 128, 8)
    assert tile_for(65, 2048, cpu, element_size=4) == (64, 64, 4)  # float32 tiles fit shared memory
    monkeypatch.setattr(module, "_sm_count_of", lambda device: 132)  # an H100
    assert tile_for(1, 2048, cpu) == (16, 16, 4)  # o_proj: 128 programs at most
    assert tile_for(1, 16384, cpu) == (16, 32, 4)  # gate_up: 512 programs
    assert tile_for(8, 128256, cpu) == (16, 64, 4)  # the output layer
    assert tile_for(64, 2048, cpu) == (16, 16, 4)  # decode at batch 64: 512 programs
    assert tile_for(512, 2048, cpu) == (64, 64, 4)  # 16 programs of 128 x 128 would idle the SMs
    assert tile_for(2048, 2048, cpu) == (128, 128, 8)


_COMPILE_SCRIPT = r"""
from tests.kernels.sm90 import compile_for_h100
from kernels import _gemv_triton as mod
from kernels.invariant_linear import BLOCK_K

for dtype, (block_m, block_n, warps), bias in (("bf16", (16, 16, 4), True), ("bf16", (128, 128, 8), False),
                                               ("fp16", (64, 64, 4), True), ("fp32", (16, 64, 4), False)):
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, SPLIT_K=1, HAS_BIAS=bias, USE_DOT=True,
                     IEEE_DOT=dtype == "fp32", FP32_OPERANDS=False)
    compiled = compile_for_h100(mod._gemv_splitk_kernel, dtype, constants, warps)
    if dtype != "fp32":
        assert "mma" in compiled.asm["ptx"], "tl.dot did not lower to tensor-core MMA"
print("compiled")
"""


def test_kernel_compiles_for_sm90_without_a_gpu() -> None:
    compile_for_sm90(_COMPILE_SCRIPT)
