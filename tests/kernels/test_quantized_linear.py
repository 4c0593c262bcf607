"""Weight-only quantized linear layers for the CPU: the kernels against their float32
references, rows independent of the row count, and GGUF Q4_1 weights kept."""

from __future__ import annotations

import pytest
import torch

from kernels.quantized_linear import quantize, quantized_linear, quantized_linear_reference, supports


KINDS = ["int4", "int8"] + (["bf16"] if supports("bf16", torch.empty(1, 1)) else [])


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_multiplies_by_the_dequantized_weight(kind) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    quantized = quantize(weight, kind)
    x = torch.randn(5, 128).to(torch.bfloat16)
    out = quantized_linear(x, quantized)
    reference = quantized_linear_reference(x, quantized)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
    # bf16 output: within a couple of its ulps of the float32 reference
    assert torch.allclose(out.float(), reference, rtol=2e-2, atol=2e-2)
    if kind == "bf16":  # the weight rounded to bf16, exactly
        assert torch.equal(quantized.dequantized(), weight.to(torch.bfloat16).float())
        return
    step = (weight.abs().max() / 127) if kind == "int8" else (weight.max() - weight.min()) / 15
    assert (quantized.dequantized() - weight).abs().max() <= step  # within one step of the grid


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_computed_the_same_whatever_the_row_count(kind) -> None:
    """A token's logits must not depend on what else is in the step (drafts, batching)."""
    torch.manual_seed(1)
    quantized = quantize(torch.randn(64, 96), kind)
    x = torch.randn(300, 96).to(torch.bfloat16)
    whole = quantized_linear(x, quantized)
    for rows in (1, 2, 3, 5, 8, 17, 33, 64, 65, 300):
        assert torch.equal(quantized_linear(x[:rows], quantized), whole[:rows])
        assert torch.equal(quantized_linear(x[rows - 1 : rows], quantized), whole[rows - 1 : rows])


def test_weights_on_a_q4_1_grid_come_back_up_to_the_scales_rounding() -> None:
    """GGUF's Q4_1: per 32 weights, w = d * q + m with q in 0..15 spanning the block's range."""
    torch.manual_seed(2)
    blocks = torch.randn(16, 4, 32)
    low = blocks.amin(-1, keepdim=True)
    step = (blocks.amax(-1, keepdim=True) - low) / 15
    on_grid = (torch.round((blocks - low) / step) * step + low).reshape(16, 128)
    error = (quantize(on_grid, "int4").dequantized() - on_grid).abs().reshape(16, 4, 32)
    assert (error <= 0.05 * step).all()  # bf16 scales: a few % of a step, not a whole one


def test_shapes_the_kernels_cannot_take_are_refused() -> None:
    assert not supports("int4", torch.randn(8, 40))  # not whole groups of 32
    assert not supports("int4", torch.randn(7, 64))  # odd output count
    assert supports("int8", torch.randn(7, 40)) and not supports("fp8", torch.randn(8, 64))
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize(torch.randn(8, 40), "int4")
