"""Paged attention with per-query limits (``PagedAttentionMetadata.visible_until``: a query sees
keys up to its limit, as Gemma 3's image tokens see their whole image): the oracle against dense
masks, the torch path (batched and token by token) and the Triton kernel (interpreter on CPU,
compiled on CUDA) against the oracle, with random limits at or after each query's position."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
)
from tests.kernels.sm90 import compile_for_sm90
from tests.kernels.test_paged_attention import (
    MIXED,
    TRITON_ROWS,
    VARIANTS,
    make_step,
    tolerance,
    variant_kwargs,
)


def _limits(rows: list[tuple[int, int]], seed: int, beyond: bool = False, dtype=torch.int32) -> torch.Tensor:
    """Per query: its own position, or (half of them) a later position of its row's context;
    ``beyond``: some limits past the context (cut to its last key)."""
    rng = random.Random(seed)
    out = []
    for q_len, ctx in rows:
        for j in range(q_len):
            pos = ctx - q_len + j
            if rng.random() < 0.5:
                out.append(pos)
            else:
                out.append(rng.randint(pos, ctx - 1 + (5 if beyond else 0)))
    return torch.tensor(out, dtype=dtype)


def _with_limits(step, limits: torch.Tensor):
    return replace(step.meta, visible_until=limits.to(step.query.device))


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_dense_masks(window) -> None:
    rows = [(1, 9), (12, 12), (5, 20), (0, 4)]
    step = make_step(rows, heads=4, kv_heads=2, head_dim=16, block_size=4)
    limits = _limits(rows, seed=1)
    out = paged_attention_reference(step.query, step.k_cache, step.v_cache, _with_limits(step, limits), scale=0.3,
                                    sliding_window=window)
    begin = 0
    for (q_len, ctx), keys, values in zip(rows, step.keys, step.values):
        if q_len == 0:
            continue
        q_pos = torch.arange(ctx - q_len, ctx).view(-1, 1)
        k_pos = torch.arange(ctx).view(1, -1)
        mask = k_pos <= limits[begin : begin + q_len].long().view(-1, 1)
        if window is not None:
            mask &= k_pos > q_pos - window
        q = step.query[begin : begin + q_len].transpose(0, 1).unsqueeze(0)
        want = F.scaled_dot_product_attention(q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                                              attn_mask=mask, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[begin : begin + q_len], want, atol=1e-5, rtol=1e-5)
        begin += q_len


def test_limits_at_the_own_positions_are_causal() -> None:
    step = make_step(MIXED, heads=4, kv_heads=2, head_dim=32)
    own = torch.cat([torch.arange(ctx - q, ctx) for q, ctx in MIXED]).int()
    meta = _with_limits(step, own)
    for fn in (paged_attention_reference, paged_attention_torch):
        torch.testing.assert_close(fn(step.query, step.k_cache, step.v_cache, meta, scale=0.2),
                                   fn(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2),
                                   atol=1e-6, rtol=1e-6)
    # and a later limit does change what a prefill query sees
    later = own.clone()
    later[MIXED[0][0]] = MIXED[1][1] - 1  # the 20-token prefill's first query sees its whole row
    got = paged_attention_reference(step.query, step.k_cache, step.v_cache, _with_limits(step, later), scale=0.2)
    causal = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2)
    assert not torch.allclose(got[1], causal[1])
    torch.testing.assert_close(got[2:], causal[2:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize(
    "rows",
    [MIXED, [(1, 30), (4, 40), (70, 70), (2, 100)], [(12, 12), (30, 30)], [(70, 70)], [(40, 90), (1, 5)]],
    ids=["mixed", "short-rows-beside-a-long-prefill", "prefills", "one-prefill", "one-chunk-and-a-decode"],
)
def test_torch_path_matches_reference(rows, variant: dict) -> None:
    step = make_step(rows, heads=6, kv_heads=2, head_dim=32, block_size=8, seed=len(rows))
    meta = _with_limits(step, _limits(rows, seed=len(rows), beyond=True, dtype=torch.int64))
    kwargs = variant_kwargs(variant, 6)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.2, **kwargs)
    got = paged_attention_torch(step.query, step.k_cache, step.v_cache, meta, scale=0.2, **kwargs)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("window", [None, 5])
def test_token_by_token_matches_reference(window) -> None:
    """``prompt_counts``: each row's prompt part alone (its limits inside the prompt part), then
    each output query alone (a later limit too)."""
    rows = [(9, 20), (1, 7), (12, 12)]
    prompts = (6, 0, 12)
    step = make_step(rows, heads=4, kv_heads=2, head_dim=16, block_size=4, seed=7)
    rng = random.Random(3)
    limits = []
    for (q_len, ctx), prompt in zip(rows, prompts):
        first = ctx - q_len
        for j in range(q_len):
            end = first + prompt - 1 if j < prompt else ctx - 1  # the prompt part sees within itself
            limits.append(rng.randint(first + j, max(first + j, end)))
    meta = replace(_with_limits(step, torch.tensor(limits)), prompt_counts=prompts)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.25, sliding_window=window)
    got = paged_attention_torch(step.query, step.k_cache, step.v_cache, meta, scale=0.25, sliding_window=window)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_torch_path_half_precision(dtype) -> None:
    rows = [(1, 30), (7, 20), (33, 40)]
    step = make_step(rows, heads=4, kv_heads=2, head_dim=64, dtype=dtype)
    meta = _with_limits(step, _limits(rows, seed=2))
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.125)
    got = paged_attention(step.query, step.k_cache, step.v_cache, meta, scale=0.125, use_triton=False)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


# ---- the Triton kernel (interpreter on CPU, compiled on CUDA) ------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "plain")
def test_triton_mixed_step(backend: torch.device, variant: dict) -> None:
    step = make_step(TRITON_ROWS, heads=9, kv_heads=3, head_dim=64, device=backend, seed=3)
    meta = _with_limits(step, _limits(TRITON_ROWS, seed=4, beyond=True))
    kwargs = variant_kwargs(variant, 9, backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.125, **kwargs)
    got = paged_attention(step.query, step.k_cache, step.v_cache, meta, scale=0.125, use_triton=True, **kwargs)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_tiles_reach_their_farthest_limit(backend: torch.device, splits: int) -> None:
    """A 40-token prefill in tiles of a few queries: every query of the first tile sees the whole
    row (the loop must run to the row's end, past the tile's own positions), int64 limits; split
    keys too."""
    rows = [(40, 40), (3, 19)]
    step = make_step(rows, heads=4, kv_heads=2, head_dim=32, block_size=8, device=backend, seed=9)
    limits = torch.cat([torch.full((10,), 39), torch.arange(10, 40), torch.tensor([16, 18, 18])]).long()
    meta = _with_limits(step, limits)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.2, sliding_window=30)
    got = paged_attention(step.query, step.k_cache, step.v_cache, meta, scale=0.2, sliding_window=30,
                          use_triton=True, num_kv_splits=splits)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_triton_half_precision(backend: torch.device) -> None:
    rows = [(1, 30), (7, 20), (17, 17)]
    step = make_step(rows, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=backend)
    meta = _with_limits(step, _limits(rows, seed=5))
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, meta, scale=0.125)
    got = paged_attention(step.query, step.k_cache, step.v_cache, meta, scale=0.125, use_triton=True)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _paged_attention_triton as mod

fn = mod._paged_attention_kernel
names = list(fn.arg_names)
pointers = {"sinks_ptr": "*fp32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_ptr": "*i32",
            "visible_until_ptr": "*i32"}
for dtype, window, splits in (("bf16", True, 1), ("fp32", False, 1), ("fp16", True, 4)):
    signature = {}
    for name in names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
    constants = dict(GROUP=3, BLOCK_Q=5, BLOCK_M=16, TILE_N=32, HEAD_DIM=64, HAS_SINKS=False, HAS_SOFTCAP=False,
                     HAS_WINDOW=window, IEEE_DOT=dtype == "fp32", FP32_OPERANDS=False, NUM_SPLITS=splits,
                     HAS_LIMITS=True)
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernel_with_limits_compiles_for_sm90_without_a_gpu() -> None:
    compile_for_sm90(_COMPILE_SCRIPT)
