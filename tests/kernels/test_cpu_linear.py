"""``kernels.cpu_linear``: float32 rows through the packed-panel kernels (float32 weights, int8
weights with row scales) match their references to float32 rounding at any row count, and a
row's bits do not depend on how many rows share the call or where it sits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from kernels.cpu_linear import (
    PackedGrid,
    PackedWeight,
    int4_linear,
    int8_linear,
    pack_int4,
    pack_int8,
    pack_weight,
    packed_linear,
    q4_grid,
    q8_grid,
)
from kernels.quantized_linear import quantize, quantized_linear_float32, quantized_linear_reference

_OPS = cpu_fused_ops()
pytestmark = pytest.mark.skipif(_OPS is None or not _OPS.panel_kernel_vectorised(),
                                reason="the fused CPU ops (AVX-512) cannot be built here")


def _operands(rows: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 333), (5, 16), (96, 1536), (49, 7)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 65, 200])
def test_matches_linear(n: int, k: int, rows: int) -> None:
    x, weight, bias = _operands(rows, n, k)
    packed = pack_weight(weight)
    assert packed is not None and packed.out_features == n and packed.in_features == k
    torch.testing.assert_close(packed_linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def _assert_rows_keep_their_bits(x: torch.Tensor, multiply) -> None:
    """Row 0 of ``multiply(rows)`` is ``multiply`` of row 0 alone at every row count and position
    (other register tiles, row blocks and threads' tasks)."""
    alone = multiply(x[:1])
    for rows in (2, 3, 4, 5, 7, 8, 9, 16, 63, 64, 65, len(x)):
        assert torch.equal(multiply(x[:rows])[:1], alone), rows
    for position in (1, 5, 8, 71, len(x) - 1):
        rows = torch.cat([x[1:position + 1], x[:1], x[position + 1:]])
        assert torch.equal(multiply(rows)[position:position + 1], alone), position


def test_a_row_is_the_same_bits_at_every_row_count_and_position() -> None:
    x, weight, bias = _operands(150, 203, 333)  # columns and K not multiples of the kernel's tiles
    packed = pack_weight(weight)
    _assert_rows_keep_their_bits(x, lambda rows: packed_linear(rows, packed, bias))


def test_leading_dims_and_strided_rows() -> None:
    x, weight, bias = _operands(12, 50, 64)
    packed = pack_weight(weight)
    flat = packed_linear(x, packed, bias)
    assert torch.equal(packed_linear(x.reshape(3, 4, 64), packed, bias), flat.reshape(3, 4, 50))
    wide = torch.cat([x, x], dim=1)[:, ::2]  # a non-contiguous last dimension is copied first
    torch.testing.assert_close(packed_linear(wide, packed, bias), F.linear(wide, weight, bias), rtol=1e-5, atol=1e-5)
    sliced = torch.cat([x, x], dim=1)[:, :64]  # rows with a longer stride are read in place
    assert torch.equal(packed_linear(sliced, packed, bias), flat)


def test_other_weights_are_not_packed_and_mismatches_are_refused() -> None:
    x, weight, _ = _operands(2, 8, 32)
    assert pack_weight(weight.double()) is None
    assert pack_weight(weight[:, ::2]) is None
    packed = pack_weight(weight)
    with pytest.raises(RuntimeError, match="K = 16"):
        packed_linear(x[:, :16].contiguous(), packed)
    with pytest.raises(RuntimeError, match="bias"):
        packed_linear(x, packed, torch.zeros(7))


@pytest.mark.parametrize(("n", "k"), [(960, 576), (203, 333), (5, 16)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 70])
def test_int8_panels_match_the_dequantized_weight(n: int, k: int, rows: int) -> None:
    x, weight, _ = _operands(rows, n, k)
    quantized = quantize(weight, "int8")
    assert quantized.panels is not None and quantized.panels.out_features == n
    reference = quantized_linear_reference(x, quantized)  # float32 x @ (q * scale)^T
    torch.testing.assert_close(quantized_linear_float32(x, quantized), reference, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(int8_linear(x, quantized.panels), reference, rtol=1e-5, atol=2e-5)


def test_an_int8_row_is_the_same_bits_at_every_row_count_and_position() -> None:
    x, weight, _ = _operands(80, 203, 333)
    packed = pack_int8(*_int8(weight))
    _assert_rows_keep_their_bits(x, lambda rows: int8_linear(rows, packed))


def test_int8_packing_takes_int8_only() -> None:
    values, scales = _int8(torch.randn(8, 32))
    assert pack_int8(values.float(), scales) is None
    assert pack_int8(values, scales).scales.shape == (48,)


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


@pytest.mark.parametrize(("n", "k"), [(960, 576), (208, 352), (16, 32)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 70])
def test_int4_panels_match_the_dequantized_weight(n: int, k: int, rows: int) -> None:
    x, weight, _ = _operands(rows, n, k)
    quantized = quantize(weight, "int4")
    assert quantized.panels is not None and quantized.panels.out_features == n
    reference = quantized_linear_reference(x, quantized)  # float32 x @ ((q - 8) * scale + zero)^T
    torch.testing.assert_close(quantized_linear_float32(x, quantized), reference, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(int4_linear(x, quantized.panels), reference, rtol=1e-5, atol=5e-5)


def test_an_int4_row_is_the_same_bits_at_every_row_count_and_position() -> None:
    x, weight, _ = _operands(80, 208, 352)
    packed = quantize(weight, "int4").panels
    _assert_rows_keep_their_bits(x, lambda rows: int4_linear(rows, packed))


def test_int4_packing_needs_whole_groups() -> None:
    values = torch.randint(0, 16, (16, 48))
    assert pack_int4(values, torch.ones(1, 16, 2)) is None  # 48 input columns: not groups of 32


def _q4_grid_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight on a Q4_1 grid, as a GGUF file's dequantized: per group of 32 columns a
    float16 d and m, w = fl(q * d + m), each group's minimum at q = 0 and maximum at 15."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().double()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.05).half().double()
    q = torch.randint(0, 16, (n, k), generator=gen).double()
    q[:, ::32], q[:, 1::32] = 0, 15
    return (q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)).float()


def _q8_grid_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().double()
    q = torch.randint(-127, 128, (n, k), generator=gen).double()
    q[:, ::32] = 127
    return (q * d.repeat_interleave(32, 1)).float()


@pytest.mark.parametrize(("kind", "make"), [("q4", _q4_grid_weight), ("q8", _q8_grid_weight)])
def test_a_weight_on_a_gguf_grid_gives_the_float32_panels_bits(kind, make) -> None:
    """Packed as its Q4_1 / Q8_0 grid, a float32 weight multiplies to the same bits as from its
    float32 panels, at every row count, and keeps a row's bits alone."""
    weight = make(203, 352)
    grid, panels = pack_weight(weight), pack_weight(weight, grids=False)
    assert isinstance(grid, PackedGrid) and grid.kind == kind and isinstance(panels, PackedWeight)
    assert grid.nbytes < panels.panels.numel() * 4 / 3
    bias = torch.randn(203)
    for rows in (1, 2, 3, 5, 7, 8, 9, 16, 33, 70):
        x = torch.randn(rows, 352)
        assert torch.equal(packed_linear(x, grid, bias), packed_linear(x, panels, bias)), rows
    x = torch.randn(80, 352)
    _assert_rows_keep_their_bits(x, lambda rows: packed_linear(rows, grid))


def test_weights_off_any_grid_keep_float32_panels() -> None:
    weight = _q4_grid_weight(96, 64)
    weight[5, 7] += 1e-4  # one group off its grid
    assert q4_grid(weight) is None and isinstance(pack_weight(weight), PackedWeight)
    assert q8_grid(torch.randn(8, 64)) is None and q4_grid(torch.randn(8, 48)) is None  # K not whole groups
    q, d, m = q4_grid(_q4_grid_weight(8, 64))
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and d.shape == m.shape == (8, 2)
