"""``kernels.cpu_linear``: float32 rows through the fused kernel match ``F.linear`` to float32
rounding, and a row's bits do not depend on how many rows share the call or where it sits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from kernels.cpu_linear import MAX_ROWS, cpu_rows_linear

pytestmark = pytest.mark.skipif(cpu_fused_ops() is None, reason="the fused CPU ops cannot be built here")


def _operands(rows: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 333), (5, 16), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, MAX_ROWS, 64])
def test_matches_linear(n: int, k: int, rows: int) -> None:
    x, weight, bias = _operands(rows, n, k)
    torch.testing.assert_close(cpu_rows_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_rows_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_bits_at_every_row_count() -> None:
    x, weight, bias = _operands(MAX_ROWS, 203, 333)  # columns and K not multiples of the kernel's tiles
    alone = cpu_rows_linear(x[:1], weight, bias)
    for rows in (2, 3, 4, 5, 8, 13, MAX_ROWS):
        assert torch.equal(cpu_rows_linear(x[:rows], weight, bias)[:1], alone), rows
    shifted = torch.cat([x[9:16], x[:1]])  # the 8th row: another register tile, another lane
    assert torch.equal(cpu_rows_linear(shifted, weight, bias)[-1:], alone)


def test_more_rows_and_other_layouts_take_linear() -> None:
    x, weight, bias = _operands(MAX_ROWS + 1, 48, 32)
    assert torch.equal(cpu_rows_linear(x, weight, bias), F.linear(x, weight, bias))
    strided = x[:4, ::2]
    assert torch.equal(cpu_rows_linear(strided, weight[:, :16]), F.linear(strided, weight[:, :16]))
    assert torch.equal(cpu_rows_linear(x[:2].double(), weight.double()), F.linear(x[:2].double(), weight.double()))


def test_a_weight_of_another_width_is_refused() -> None:
    x, weight, _ = _operands(2, 8, 32)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_rows_linear(x, weight[:, :16].contiguous())
