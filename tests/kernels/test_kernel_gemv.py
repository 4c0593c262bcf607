"""Split-K skinny GEMM (decode projections): the Triton kernel (interpreter on CPU, compiled on
CUDA) against the float32 oracle, the F.linear fallbacks, GemvChoice's per-shape pick, and the
kernels lowered for an H100 on a machine without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import GemvChoice, skinny_linear, skinny_linear_reference
from kernels import gemv as gemv_module
from kernels.gemv import row_bucket
from tests.kernels.sm90 import compile_for_sm90

N, K = 200, 333  # not multiples of any block size


def _operands(rows: int, dtype: torch.dtype, with_bias: bool, gen: torch.Generator, device: torch.device):
    x = torch.randn(rows, K, generator=gen).to(dtype).to(device)
    weight = torch.randn(N, K, generator=gen).to(dtype).to(device)
    bias = torch.randn(N, generator=gen).to(dtype).to(device) if with_bias else None
    return x, weight, bias


def test_reference_matches_float64_linear(gen: torch.Generator) -> None:
    x, weight, bias = _operands(3, torch.float64, True, gen, torch.device("cpu"))
    got = skinny_linear_reference(x, weight, bias)  # computed in float32, returned as float64
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


# Rows 1 and 3 multiply on the CUDA cores, 8 rows through tl.dot.
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_triton_matches_reference_float32(backend, gen, rows: int, with_bias: bool, split_k: int) -> None:
    x, weight, bias = _operands(rows, torch.float32, with_bias, gen, backend)
    assert kernels.select_backend(x, use_triton=True) == "triton"
    got = skinny_linear(x, weight, bias, use_triton=True, split_k=split_k)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_triton_matches_reference_bfloat16(backend, gen, rows: int, with_bias: bool, split_k: int) -> None:
    x, weight, bias = _operands(rows, torch.bfloat16, with_bias, gen, backend)
    got = skinny_linear(x, weight, bias, use_triton=True, split_k=split_k)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    # bf16 tolerance: the interpreter truncates float32 -> bfloat16 (one ulp at most).
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, bias), rtol=1.6e-2, atol=1e-2)


def test_triton_flattens_leading_dims(backend, gen) -> None:
    x, weight, bias = _operands(6, torch.float32, True, gen, backend)
    x = x.view(2, 3, K)
    got = skinny_linear(x, weight, bias, use_triton=True)
    assert got.shape == (2, 3, N)
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_more_than_eight_rows_fall_back_to_linear(gen, monkeypatch) -> None:
    mod = gemv_module._triton_module()
    if mod is not None:
        monkeypatch.setattr(mod, "gemv", lambda *a, **k: pytest.fail("the kernel ran for 9+ rows"))
    x, weight, bias = _operands(12, torch.float32, True, gen, torch.device("cpu"))
    x = x.view(3, 4, K)
    got = skinny_linear(x, weight, bias, use_triton=True)
    assert torch.equal(got, F.linear(x, weight, bias))


def test_reference_backend_is_linear(gen) -> None:
    x, weight, bias = _operands(2, torch.float32, True, gen, torch.device("cpu"))
    assert torch.equal(skinny_linear(x, weight, bias), F.linear(x, weight, bias))
    assert gemv_module.default_split_k(x, N, K, 32, 128) == 1


def test_shape_mismatch_is_refused(gen) -> None:
    x, weight, _ = _operands(2, torch.float32, False, gen, torch.device("cpu"))
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x[:, :-1], weight)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, weight, torch.zeros(N + 1))


def test_choice_on_cpu_is_linear_and_times_nothing(gen, monkeypatch) -> None:
    monkeypatch.setattr(gemv_module, "median_cuda_us", lambda *a, **k: pytest.fail("timed on the CPU"))
    choice = GemvChoice()
    for rows in (1, 8, 12):
        x, weight, bias = _operands(rows, torch.float32, True, gen, torch.device("cpu"))
        assert torch.equal(choice.linear(x, weight, bias), F.linear(x, weight, bias))
        assert choice.choose(x, weight, bias) == "cublas"
    assert choice.table == {}


def test_row_counts_share_a_choice_within_the_kernels_row_tile() -> None:
    assert [row_bucket(rows) for rows in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


@pytest.mark.gpu
def test_choice_on_cuda_picks_and_matches_linear(gen) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if kernels.interpreter_enabled() or kernels.select_backend(torch.zeros(1, device="cuda")) != "triton":
        pytest.skip("compiled Triton unavailable in this process")
    choice = GemvChoice(iters=5, warmup=1)
    device = torch.device("cuda")
    for rows in (1, 4, 8):
        x, weight, bias = _operands(rows, torch.bfloat16, rows == 4, gen, device)
        got = choice.linear(x, weight, bias).float()
        exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert float((got - exact).abs().max()) <= 2e-2 * float(exact.abs().max())
        winner, times = choice.table[(rows, N, K, torch.bfloat16)]
        assert winner in times and "cublas" in times and any(n.startswith("triton_split") for n in times)
        assert all(us > 0 for us in times.values())
    assert len(choice.table) == 3


# ---- compiled for a GPU without one -----------------------------------------------------------

_COMPILE_SCRIPT = r"""
from tests.kernels.sm90 import compile_for_h100
from kernels import _gemv_triton as mod
from kernels.gemv import _BLOCKS

# (dtype, BLOCK_M, SPLIT_K, HAS_BIAS): every row tile at its dispatcher block sizes
for dtype, block_m, split, bias in (("bf16", 1, 1, True), ("fp16", 2, 4, False), ("bf16", 4, 2, True),
                                    ("bf16", 16, 4, False), ("fp32", 16, 1, True), ("fp32", 1, 2, False)):
    block_n, block_k = _BLOCKS[block_m]
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, HAS_BIAS=bias,
                     USE_DOT=block_m == 16, IEEE_DOT=dtype == "fp32", FP32_OPERANDS=False)
    compiled = compile_for_h100(mod._gemv_splitk_kernel, dtype, constants)
    if dtype != "fp32" and block_m == 16:  # fp32 runs IEEE (no TF32), which stays on the FMA units
        assert "mma" in compiled.asm["ptx"], "tl.dot did not lower to tensor-core MMA"
compile_for_h100(mod._reduce_splits_kernel, "bf16", dict(SPLIT_K=3, SPLIT_POW2=4, BLOCK_N=256, HAS_BIAS=True))
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """Lower both kernels through Triton's NVIDIA backend and ptxas for an H100 (sm_90): catches
    what the interpreter forgives (types across loop iterations, dot shapes, constexpr misuse)."""
    compile_for_sm90(_COMPILE_SCRIPT)
