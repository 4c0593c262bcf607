"""``DenseLinears``: which kernels a runner's unquantized weights take, chosen once at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from server.engine.dense_linear import DenseLinears

CPU = torch.device("cpu")
_OPS = cpu_fused_ops()


@pytest.mark.skipif(_OPS is None or not _OPS.panel_kernel_vectorised(), reason="no AVX-512 fused CPU ops here")
def test_float32_cpu_weights_packed_at_load_take_the_panel_kernel() -> None:
    dense = DenseLinears(CPU, torch.float32, None)
    assert dense.cpu_packed and dense.gemv is None and not dense.batch_invariant and dense.num_kv_splits is None
    x, weight, other = torch.randn(70, 40), torch.randn(24, 40), torch.randn(24, 40)
    dense.pack([weight])
    assert dense.packed_bytes == 48 * 40 * 4  # one panel of 48 weight rows
    got = dense.linear(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(dense.linear(x[:1], weight, None), got[:1])  # a row as it would be alone
    assert torch.equal(dense.linear(x, other, None), F.linear(x, other))  # a weight never packed
    assert torch.equal(dense.linear(x, weight.clone(), None), F.linear(x, weight))  # same values, another tensor


def test_other_dtypes_and_the_interpreter_keep_linear() -> None:
    for dense in (DenseLinears(CPU, torch.bfloat16, None), DenseLinears(CPU, torch.float32, True)):
        assert not dense.cpu_packed  # bf16; the CUDA path in Triton's interpreter
        weight = torch.randn(4, 8)
        dense.pack([weight])
        assert dense.packed_bytes == 0
    x, weight, bias = torch.randn(2, 8).double(), torch.randn(4, 8).double(), torch.randn(4).double()
    assert torch.equal(DenseLinears(CPU, torch.float64, None).linear(x, weight, bias), F.linear(x, weight, bias))


def test_batch_invariance_applies_with_triton_and_refuses_fp8_and_lora() -> None:
    assert not DenseLinears(CPU, torch.float32, None, batch_invariant=True).batch_invariant  # CPU paths as they are
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, lora=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, fp8=True)
