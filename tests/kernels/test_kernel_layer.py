"""The decoder layer's fused kernels (add + RMSNorm, qk-norm + rotary + KV write, SiLU·mul)
against their torch references, on the Triton interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_mul, silu_mul_reference
from kernels.rmsnorm import add_rmsnorm, add_rmsnorm_reference
from kernels.rotary import rope_write_kv, rope_write_kv_reference

DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # float32: summation order only. bfloat16: the interpreter truncates where CUDA rounds, one ulp apart.
    tol = 1e-5 if actual.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None].float() * inv_freq[None]
    table = torch.cat([angles, angles], dim=-1)
    return table.cos().to(dtype), table.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(backend, gen, dtype, with_residual) -> None:
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    ours, theirs = residual.clone().to(backend), residual.clone()
    out = add_rmsnorm(x.to(backend), ours if with_residual else None, weight.to(backend), 1e-6, use_triton=True)
    expected = add_rmsnorm_reference(x, theirs if with_residual else None, weight, 1e-6)
    _close(out.cpu(), expected)
    _close(ours.cpu(), theirs)  # the residual stream: updated in place, or untouched
    if not with_residual:
        assert torch.equal(ours.cpu(), residual)


def test_add_rmsnorm_reference_is_transformers_norm(gen) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
    x, residual = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    stream = residual.clone()
    out = add_rmsnorm_reference(x, stream, norm.weight, 1e-5)
    assert torch.equal(stream, residual + x)
    assert torch.equal(out, norm(residual + x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(backend, gen, dtype) -> None:
    x = (torch.randn(3, 2 * 1100, generator=gen) * 3).to(dtype)  # more than one column block
    _close(silu_mul(x.to(backend), use_triton=True).cpu(), silu_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_write_kv_matches_reference(backend, gen, dtype, qk_norm, head_dim) -> None:
    heads, kv_heads, tokens = 4, 2, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    cos, sin = _rope_tables(torch.tensor([0, 5, 9]), head_dim, dtype)
    norms = (torch.randn(head_dim, generator=gen).to(dtype), torch.randn(head_dim, generator=gen).to(dtype))
    q_norm, k_norm = norms if qk_norm else (None, None)
    slots = torch.tensor([1, 6, 13])
    cache = torch.zeros(4, 4, kv_heads, head_dim, dtype=dtype)
    k_ours, v_ours = cache.clone().to(backend), cache.clone().to(backend)
    k_ref, v_ref = cache.clone(), cache.clone()
    on = [t if t is None else t.to(backend) for t in (qkv, cos, sin, slots, q_norm, k_norm)]
    q = rope_write_kv(on[0], on[1], on[2], k_ours, v_ours, on[3], heads, kv_heads, on[4], on[5], 1e-6,
                      use_triton=True)
    expected = rope_write_kv_reference(qkv, cos, sin, k_ref, v_ref, slots, heads, kv_heads, q_norm, k_norm, 1e-6)
    _close(q.cpu(), expected)
    _close(k_ours.cpu(), k_ref)
    assert torch.equal(v_ours.cpu(), v_ref)  # values are stored as they are
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not k_ours.cpu().view(16, -1)[untouched].any()  # nothing written outside the slots


def test_rope_write_kv_refuses_mismatched_shapes() -> None:
    cache = torch.zeros(2, 4, 2, 16)
    qkv = torch.zeros(3, 8 * 16)
    cos = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_write_kv(qkv[:, :-1], cos, cos, cache, cache.clone(), torch.zeros(3, dtype=torch.long), 4, 2)
    with pytest.raises(ValueError, match="cos and sin"):
        rope_write_kv(qkv, cos[:2], cos[:2], cache, cache.clone(), torch.zeros(3, dtype=torch.long), 4, 2)
    with pytest.raises(ValueError, match="go together"):
        rope_write_kv(qkv, cos, cos, cache, cache.clone(), torch.zeros(3, dtype=torch.long), 4, 2, torch.ones(16))
