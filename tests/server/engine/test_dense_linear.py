"""``DenseLinears``: which kernels a runner's unquantized weights take, chosen once at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from server.engine.dense_linear import DenseLinears

CPU = torch.device("cpu")


@pytest.mark.skipif(cpu_fused_ops() is None, reason="the fused CPU ops cannot be built here")
def test_float32_cpu_rows_take_the_row_kernel() -> None:
    dense = DenseLinears(CPU, torch.float32, None)
    assert dense.cpu_rows and dense.gemv is None and not dense.batch_invariant and dense.num_kv_splits is None
    x, weight = torch.randn(3, 40), torch.randn(24, 40)
    got = dense.linear(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(dense.linear(x[:1], weight, None), got[:1])  # a row as it would be alone


def test_other_dtypes_and_the_interpreter_keep_linear() -> None:
    assert not DenseLinears(CPU, torch.bfloat16, None).cpu_rows
    assert not DenseLinears(CPU, torch.float32, True).cpu_rows  # the CUDA path in Triton's interpreter
    x, weight, bias = torch.randn(2, 8).double(), torch.randn(4, 8).double(), torch.randn(4).double()
    assert torch.equal(DenseLinears(CPU, torch.float64, None).linear(x, weight, bias), F.linear(x, weight, bias))


def test_batch_invariance_applies_with_triton_and_refuses_fp8_and_lora() -> None:
    assert not DenseLinears(CPU, torch.float32, None, batch_invariant=True).batch_invariant  # CPU paths as they are
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, lora=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, fp8=True)
