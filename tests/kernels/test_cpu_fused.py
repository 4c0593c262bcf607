"""The fused CPU layer ops (``kernels/csrc/cpu_fused.cpp``) against their torch references."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.activation import silu_mul, silu_mul_reference
from kernels.bitmask import _mask_rows_fused, _mask_rows_reference
from kernels.cpu_fused import cpu_fused_ops
from kernels.quantized_linear import quantize, quantized_linear, quantized_linear_float32
from kernels.rmsnorm import add_rmsnorm, add_rmsnorm_reference
from kernels.rotary import rope_write_kv, rope_write_kv_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK = 6, 2, 16, 5, 4


@pytest.fixture(scope="module")
def ops():
    module = cpu_fused_ops()
    if module is None:
        if shutil.which("c++") and shutil.which("ninja"):
            pytest.fail("a C++ compiler and ninja are here, yet the fused CPU ops did not build")
        pytest.skip("no C++ toolchain: the references serve")
    return module


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_the_reference(ops, rows, with_residual):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576), torch.randn(576)
    residual = torch.randn(rows, 576) if with_residual else None
    expected_residual = None if residual is None else residual.clone()
    expected = add_rmsnorm_reference(x, expected_residual, weight, 1e-5)
    got = add_rmsnorm(x, residual, weight, 1e-5, cpu_fused=True)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    if residual is not None:
        assert torch.equal(residual, expected_residual)  # the same float32 additions


def rotary_inputs(tokens: int):
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    angles = torch.randn(tokens, HEAD_DIM // 2)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    slots = torch.randperm(BLOCKS * BLOCK)[:tokens]
    return qkv, cos, sin, slots


@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_write_kv_is_the_reference_bit_for_bit(ops, tokens):
    qkv, cos, sin, slots = rotary_inputs(tokens)
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(4)]
    expected = rope_write_kv_reference(qkv, cos, sin, caches[0], caches[1], slots, HEADS, KV_HEADS)
    got = rope_write_kv(qkv, cos, sin, caches[2], caches[3], slots, HEADS, KV_HEADS, cpu_fused=True)
    assert torch.equal(got, expected)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_rope_write_kv_refuses_a_slot_outside_the_cache(ops):
    qkv, cos, sin, _ = rotary_inputs(1)
    k_cache, v_cache = torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="out of range"):
        rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.tensor([BLOCKS * BLOCK]), HEADS, KV_HEADS, cpu_fused=True)


def test_silu_mul_matches_the_reference(ops):
    x = torch.randn(3, 2 * 1536) * 4
    torch.testing.assert_close(silu_mul(x, cpu_fused=True), silu_mul_reference(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_projection_of_float32_rows_is_the_kernels(ops, kind):
    """The casts around torch's kernels (float32 rows where the packed panels do not apply)."""
    torch.manual_seed(0)
    weight = quantize(torch.randn(96, 128), kind)
    x = torch.randn(3, 128)
    fused = (ops.int4_linear(x, weight.data, weight.group_size, weight.scales) if kind == "int4"
             else ops.int8_linear(x, weight.data, weight.scales))
    assert torch.equal(fused, quantized_linear(x.to(torch.bfloat16), weight).float())
    if weight.panels is not None:  # float32 rows take the panels: float32 activations, not bf16
        torch.testing.assert_close(quantized_linear_float32(x, weight), x @ weight.dequantized().t(),
                                   rtol=1e-5, atol=5e-5)


def test_a_rows_result_does_not_depend_on_the_others(ops):
    """Drafts and batching change the rows a call carries: each row must come out the same."""
    torch.manual_seed(1)
    x, residual, weight = torch.randn(6, 576), torch.randn(6, 576), torch.randn(576)
    together = ops.add_rmsnorm(x, residual.clone(), weight, 1e-5)
    alone = torch.cat([ops.add_rmsnorm(x[i : i + 1], residual[i : i + 1].clone(), weight, 1e-5) for i in range(6)])
    assert torch.equal(together, alone)
    gate_up = torch.randn(6, 64)
    assert torch.equal(ops.silu_mul(gate_up), torch.cat([ops.silu_mul(gate_up[i : i + 1]) for i in range(6)]))


def test_other_dtypes_keep_the_reference(ops):
    x, weight = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(add_rmsnorm(x, None, weight, 1e-5, cpu_fused=True), add_rmsnorm_reference(x, None, weight, 1e-5))


@pytest.mark.parametrize("vocab", [70, 96, 130])  # fewer columns than the words cover, as many, more
def test_bitmask_rows_are_the_reference_bit_for_bit(ops, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab)
    words = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)
    cases = [(None, None), (None, torch.tensor([4, 0, 2])),  # bitmask row r -> logits row dst[r]
             (torch.tensor([2, -1, 0, 1, -1]), None)]  # logits row r <- bitmask row word_rows[r]
    for word_rows, dst_rows in cases:
        expected, got = logits.clone(), logits.clone()
        _mask_rows_reference(expected, words, word_rows, dst_rows)
        assert _mask_rows_fused(got, words, word_rows, dst_rows)
        assert torch.equal(got, expected)
