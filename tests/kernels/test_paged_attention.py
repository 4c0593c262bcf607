"""Paged attention: the torch oracle against SDPA, and the batched torch path and the Triton
kernel (interpreter on CPU, compiled on CUDA) against the oracle on mixed steps."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import (
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    write_kv,
)
from tests.kernels.sm90 import compile_for_sm90


@dataclass
class Step:
    """One engine step's attention inputs over a freshly filled paged cache."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    keys: list[torch.Tensor]  # per row, the row's whole context [ctx, kv, d] (for SDPA checks)
    values: list[torch.Tensor]


def make_step(
    rows: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Step:
    """Rows given as (q_len, context_len); blocks handed out in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-ctx // block_size) for _, ctx in rows]
    num_blocks = sum(need) + 3  # a few blocks no row owns
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # stale junk everywhere
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    keys = [torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype) for _, ctx in rows]
    values = [torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype) for _, ctx in rows]
    # The cached prefix of each row goes in through the same write path as the new tokens.
    cached = [ctx - q for q, ctx in rows]
    prefix = PagedAttentionMetadata.build(tables, cached, cached, block_size, torch.device("cpu"))
    if prefix.slot_mapping.numel():
        write_kv(k_cache, v_cache, torch.cat([k[: ctx - q] for k, (q, ctx) in zip(keys, rows)]),
                 torch.cat([v[: ctx - q] for v, (q, ctx) in zip(values, rows)]), prefix.slot_mapping)
    q_lens, ctx_lens = [q for q, _ in rows], [ctx for _, ctx in rows]
    meta = PagedAttentionMetadata.build(tables, q_lens, ctx_lens, block_size, torch.device("cpu"))
    write_kv(k_cache, v_cache, torch.cat([k[ctx - q :] for k, (q, ctx) in zip(keys, rows)]),
             torch.cat([v[ctx - q :] for v, (q, ctx) in zip(values, rows)]), meta.slot_mapping)
    query = torch.randn(sum(q for q, _ in rows), heads, head_dim, generator=gen).to(dtype)
    device = torch.device(device)
    if device.type != "cpu":
        meta = PagedAttentionMetadata.build(tables, q_lens, ctx_lens, block_size, device)
        query, k_cache, v_cache = query.to(device), k_cache.to(device), v_cache.to(device)
    return Step(query, k_cache, v_cache, meta, keys, values)


# (q_len, context_len): decode rows, fresh prefills, continuations on a cached prefix, an idle row.
MIXED = [(1, 37), (20, 20), (1, 1), (5, 70), (0, 9), (1, 16), (3, 33), (17, 17), (1, 64)]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype in (torch.bfloat16, torch.float16) else {"atol": 2e-5, "rtol": 1e-4}


# ---- the oracle itself ---------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 3), (8, 2)])
def test_reference_matches_sdpa_on_contiguous_rows(heads: int, kv_heads: int) -> None:
    step = make_step(MIXED, heads=heads, kv_heads=kv_heads, head_dim=32)
    out = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2)
    begin = 0
    for (q_len, ctx), keys, values in zip(MIXED, step.keys, step.values):
        q = step.query[begin : begin + q_len].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(ctx).view(1, -1) <= torch.arange(ctx - q_len, ctx).view(-1, 1)
        want = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=0.2, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[begin : begin + q_len], want, atol=1e-5, rtol=1e-5)
        begin += q_len


def test_reference_window_sinks_softcap_by_hand() -> None:
    """One decode row, written out: window keeps the last 3 keys, the sink joins the denominator."""
    step = make_step([(1, 9)], heads=2, kv_heads=1, head_dim=16, block_size=4)
    sinks = torch.tensor([0.5, -1.0])
    out = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta,
                                    scale=0.3, sliding_window=3, sinks=sinks, softcap=2.0)
    keys, values = step.keys[0][-3:, 0], step.values[0][-3:, 0]  # [3, d]
    for h in range(2):
        scores = 2.0 * torch.tanh(step.query[0, h] @ keys.T * 0.3 / 2.0)
        probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), dim=0)[:3]
        torch.testing.assert_close(out[0, h], probs @ values, atol=1e-5, rtol=1e-5)


# ---- the batched torch path ------------------------------------------------------------------

VARIANTS = [
    {},
    {"sliding_window": 7},
    {"sinks": True},
    {"softcap": 5.0},
    {"sliding_window": 12, "sinks": True, "softcap": 3.0},
]


def variant_kwargs(variant: dict, heads: int, device: torch.device | str = "cpu") -> dict:
    kwargs = dict(variant)
    if kwargs.get("sinks"):
        kwargs["sinks"] = torch.linspace(-1.0, 2.0, heads, device=device)
    return kwargs


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (8, 2, 64), (6, 3, 32)])
def test_torch_path_matches_reference(variant: dict, heads: int, kv_heads: int, head_dim: int) -> None:
    step = make_step(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=heads)
    kwargs = variant_kwargs(variant, heads)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=head_dim**-0.5, **kwargs)
    got = paged_attention_torch(step.query, step.k_cache, step.v_cache, step.meta, scale=head_dim**-0.5, **kwargs)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_half_precision(dtype: torch.dtype) -> None:
    step = make_step(MIXED, heads=9, kv_heads=3, head_dim=64, dtype=dtype)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    got = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, use_triton=False)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "plain")
@pytest.mark.parametrize(
    "rows",
    [[(1, 5), (1, 40), (1, 17)], [(1, 24), (1, 24)], [(12, 12), (30, 30)], [(1, 30), (4, 40), (70, 70), (2, 100)]],
    ids=["decode", "decode-equal-lengths", "prefill", "drafts-beside-a-long-prefill"],
)
def test_torch_path_decode_only_and_prefill_only(rows: list, variant: dict) -> None:
    step = make_step(rows, heads=4, kv_heads=2, head_dim=32, block_size=8)
    kwargs = variant_kwargs(variant, 4)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2, **kwargs)
    got = paged_attention_torch(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2, **kwargs)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_bad_shapes_are_refused() -> None:
    step = make_step([(1, 4)], heads=4, kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention(step.query[:, :3], step.k_cache, step.v_cache, step.meta, scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=1.0, sinks=torch.zeros(3))


# ---- the Triton kernel (interpreter on CPU, compiled on CUDA) ------------------------------

# Kept small: the interpreter runs every program in Python.
TRITON_ROWS = [(1, 37), (18, 18), (1, 1), (0, 6), (5, 40), (3, 19)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "plain")
def test_triton_mixed_step(backend: torch.device, variant: dict) -> None:
    step = make_step(TRITON_ROWS, heads=9, kv_heads=3, head_dim=64, device=backend, seed=3)
    kwargs = variant_kwargs(variant, 9, backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, **kwargs)
    got = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, use_triton=True, **kwargs)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 128), (4, 2, 64), (8, 2, 64)])
def test_triton_gqa_groups_and_head_dims(backend: torch.device, heads: int, kv_heads: int, head_dim: int) -> None:
    step = make_step([(1, 21), (6, 6), (2, 35)], heads=heads, kv_heads=kv_heads, head_dim=head_dim, device=backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=head_dim**-0.5)
    got = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=head_dim**-0.5, use_triton=True)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_triton_decode_only_step(backend: torch.device) -> None:
    """N == R: one token per tile, no spare tiles; odd block size 5 and a padded head dim 40."""
    step = make_step([(1, 9), (1, 23), (1, 1)], heads=6, kv_heads=2, head_dim=40, block_size=5, device=backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.15, sliding_window=10)
    got = paged_attention(
        step.query, step.k_cache, step.v_cache, step.meta, scale=0.15, sliding_window=10, use_triton=True
    )
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_padding_row_of_a_graph_bucket_is_zero(backend: torch.device, with_sinks: bool) -> None:
    """A row padding a captured batch (one query, empty context) reads nothing and writes zeros."""
    step = make_step([(1, 20), (1, 1), (1, 7)], heads=4, kv_heads=2, head_dim=32, device=backend)
    step.meta.context_lens[1] = 0
    step.meta.context_lens_host[1] = 0
    sinks = torch.ones(4, device=backend) if with_sinks else None
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2, sinks=sinks)
    for splits in (1, 2):
        got = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.2, sinks=sinks,
                              use_triton=True, num_kv_splits=splits)
        assert torch.count_nonzero(got[1]) == 0
        torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(backend: torch.device, dtype: torch.dtype) -> None:
    step = make_step([(1, 30), (7, 20)], heads=4, kv_heads=2, head_dim=64, dtype=dtype, device=backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    got = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, use_triton=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


SPLIT_CASES = [
    pytest.param([(1, 70), (1, 5), (1, 33)], {}, id="decode"),
    pytest.param([(1, 70), (1, 5), (1, 33)], {"sliding_window": 9, "sinks": True}, id="decode-window-sinks"),
    pytest.param([(1, 70), (1, 5), (1, 33)], {"softcap": 4.0}, id="decode-softcap"),
    pytest.param([(1, 37), (9, 9), (0, 6), (3, 19)], {"sinks": True}, id="mixed-sinks"),
]


@pytest.mark.parametrize("rows,variant", SPLIT_CASES)
def test_triton_split_keys(backend: torch.device, rows: list, variant: dict) -> None:
    """Flash-decoding: keys split over 4 programs, partial softmax states merged (empty splits
    included: a 5-token context leaves three of them nothing)."""
    step = make_step(rows, heads=6, kv_heads=2, head_dim=64, device=backend, seed=5)
    kwargs = variant_kwargs(variant, 6, backend)
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, **kwargs)
    got = paged_attention(
        step.query, step.k_cache, step.v_cache, step.meta, scale=0.125, use_triton=True, num_kv_splits=4, **kwargs
    )
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def test_triton_split_count_must_be_a_power_of_two(backend: torch.device) -> None:
    step = make_step([(1, 8)], heads=2, kv_heads=1, head_dim=16, device=backend)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=1.0, use_triton=True, num_kv_splits=3)


def test_triton_float32_query_over_a_bfloat16_cache(backend: torch.device) -> None:
    step = make_step([(1, 12), (4, 9)], heads=4, kv_heads=2, head_dim=32, dtype=torch.bfloat16, device=backend)
    query = step.query.float()
    want = paged_attention_reference(query, step.k_cache, step.v_cache, step.meta, scale=0.2)
    got = paged_attention(query, step.k_cache, step.v_cache, step.meta, scale=0.2, use_triton=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tolerance(torch.bfloat16))


# ---- CUDA only ------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_default_dispatch_and_graph_capture() -> None:
    """Default dispatch on CUDA is the kernel; a captured launch replays on new lengths."""
    rows = [(1, 100), (1, 300), (1, 17), (1, 64)]
    step = make_step(rows, heads=32, kv_heads=8, head_dim=64, dtype=torch.bfloat16, device="cuda")
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    torch.testing.assert_close(paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125).float(),
                               want.float(), **tolerance(torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)  # warm-up compile
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = paged_attention(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    step.meta.context_lens.copy_(torch.tensor([101, 5, 17, 60], dtype=torch.int32))
    step.meta.context_lens_host[:] = [101, 5, 17, 60]
    graph.replay()
    want = paged_attention_reference(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    torch.testing.assert_close(out.float(), want.float(), **tolerance(torch.bfloat16))


# ---- compiled for a GPU without one -----------------------------------------------------------

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import _paged_attention_triton as mod

fn = mod._paged_attention_kernel
names = list(fn.arg_names)
pointers = {"sinks_ptr": "*fp32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_ptr": "*i32"}
def constexprs(fn, constants):
    names = list(fn.arg_names)
    return {(names.index(k),): v for k, v in constants.items()}

cases = (("bf16", (True, True, True), 1), ("fp32", (False, False, False), 1), ("fp16", (True, False, True), 8))
for dtype, flags, splits in cases:
    signature = {}
    for name in names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
    constants = dict(GROUP=3, BLOCK_Q=5, BLOCK_M=16, TILE_N=32, HEAD_DIM=64, HAS_SINKS=flags[0], HAS_SOFTCAP=flags[1],
                     HAS_WINDOW=flags[2], IEEE_DOT=dtype == "fp32", FP32_OPERANDS=False, NUM_SPLITS=splits)
    source = ASTSource(fn, signature, constexprs=constexprs(fn, constants))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    if dtype == "bf16":  # fp32 runs IEEE (no TF32), which stays on the FMA units
        assert "mma.sync" in compiled.asm["ptx"], "tl.dot did not lower to tensor-core MMA"
merge = mod._merge_splits_kernel
def merge_type(name):
    if name.isupper():
        return "constexpr"
    return ("*bf16" if name == "out_ptr" else "*fp32") if name.endswith("_ptr") else "i32"
signature = {name: merge_type(name) for name in merge.arg_names}
constants = dict(NUM_SPLITS=8, HEAD_DIM=64, HAS_SINKS=True)
triton.compile(ASTSource(merge, signature, constexprs=constexprs(merge, constants)), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernel_compiles_for_sm90_without_a_gpu() -> None:
    """Lower the kernel through Triton's NVIDIA backend and ptxas for an H100 (sm_90): catches
    what the interpreter forgives (types across loop iterations, dot shapes, constexpr misuse)."""
    compile_for_sm90(_COMPILE_SCRIPT)


def test_torch_path_runs_outside_inference_mode_after_running_inside() -> None:
    """The per-thread gather workspace made during an engine step (inference mode) is reused by a
    later call on the same thread outside it."""
    step = make_step(MIXED, heads=9, kv_heads=3, head_dim=64, seed=1)
    with torch.inference_mode():
        inside = paged_attention_torch(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    outside = paged_attention_torch(step.query, step.k_cache, step.v_cache, step.meta, scale=0.125)
    torch.testing.assert_close(outside, inside)


@pytest.mark.parametrize("q_len", [1, 5, 70])
def test_a_row_in_consecutive_blocks_reads_a_view_with_the_same_result(q_len):
    """One row whose blocks are consecutive ids attends over a view of the cache (no gather):
    the same output as the gather and as the oracle."""

    ctx, block_size, kv_heads, head_dim, heads = 70, 16, 2, 32, 4
    table = [3, 4, 5, 6, 7]
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(10, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(10, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(q_len, heads, head_dim, generator=gen)
    meta = PagedAttentionMetadata.build([table], [q_len], [ctx], block_size, torch.device("cpu"))
    assert meta.block_runs_host == [3]
    viewed = paged_attention_torch(query, k_cache, v_cache, meta, scale=0.2)
    meta.block_runs_host = None
    gathered = paged_attention_torch(query, k_cache, v_cache, meta, scale=0.2)
    torch.testing.assert_close(viewed, gathered, rtol=0, atol=0)
    torch.testing.assert_close(viewed, paged_attention_reference(query, k_cache, v_cache, meta, scale=0.2),
                               rtol=1e-5, atol=1e-5)


def test_block_runs_name_consecutive_tables_only():
    from kernels.paged_attention import block_runs

    tables = [[3, 4, 5], [3, 5, 6], [9, 10, 2], [8], []]
    assert block_runs(tables, [40, 40, 20, 5, 0], 16) == [3, -1, 9, 8, -1]
