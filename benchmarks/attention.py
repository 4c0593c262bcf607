"""Paged attention of one step: the row-by-row oracle vs the batched torch path (vs Triton on CUDA).

Usage: python benchmarks/attention.py [--device cpu|cuda] [--iters 10] [--context 512] [--threads N] [--smoke]

Two steps per attention shape (SmolLM2-135M: 9 heads / 3 kv heads / dim 64; Llama-3.2-1B:
32 / 8 / 64): 16 decode rows at ``--context`` tokens each, and one ``--context``-token prefill
beside 15 such decode rows. Blocks of 16 slots, handed out in a shuffled order. float32 on the
CPU, bfloat16 on CUDA. Prints the median time of one call per implementation and the speed-up
over the oracle; every implementation's output is checked against the oracle first. "unpaged
SDPA" runs the same step over per-row contiguous keys (gathered before timing): what the torch
path would cost without paging. ``--smoke``: 48-token contexts, one timed call (checks it runs).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.smoke import parse_with_smoke  # noqa: E402
from kernels import (  # noqa: E402
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    select_backend,
)

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-1B": (32, 8, 64)}
BLOCK_SIZE = 16


def build_step(
    rows: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Random query and caches for rows of (new tokens, context length), blocks shuffled."""
    need = [-(-ctx // BLOCK_SIZE) for _, ctx in rows]
    blocks = list(range(sum(need)))
    random.Random(0).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in need]
    shape = (sum(need), BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(sum(q for q, _ in rows), heads, head_dim, dtype=dtype, device=device)
    meta = PagedAttentionMetadata.build(tables, [q for q, _ in rows], [c for _, c in rows], BLOCK_SIZE, device)
    return query, k_cache, v_cache, meta


def contiguous_sdpa(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float
) -> Callable[[], torch.Tensor]:
    """The same step over keys/values already contiguous per row (no paging, no gather): the
    decode rows in one SDPA call, each longer row in its own; the floor for the torch path."""
    kv_heads, head_dim = k_cache.shape[2:]
    rows = []
    begin = 0
    for row, (q_len, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
        blocks = meta.block_tables[row, : -(-ctx // BLOCK_SIZE)].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1).contiguous().unsqueeze(0)
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1).contiguous().unsqueeze(0)
        rows.append((begin, q_len, keys, values))
        begin += q_len
    decode = [r for r in rows if r[1] == 1]
    assert len({r[2].shape for r in decode}) <= 1, "decode rows of one length only"
    dec_tokens = [r[0] for r in decode]
    dec_keys = torch.cat([r[2] for r in decode]) if decode else None
    dec_values = torch.cat([r[3] for r in decode]) if decode else None

    def run() -> torch.Tensor:
        out = torch.empty_like(query)
        if decode:
            q = query[dec_tokens].unsqueeze(2)  # [D, h, 1, d]
            o = F.scaled_dot_product_attention(q, dec_keys, dec_values, scale=scale, enable_gqa=True)
            out[dec_tokens] = o[:, :, 0]
        for begin, q_len, keys, values in rows:
            if q_len > 1:  # whole prefills in this benchmark: plain causal
                q = query[begin : begin + q_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
                out[begin : begin + q_len] = o[0].transpose(0, 1)
        return out

    return run


def median_us(impls: dict[str, Callable[[], object]], device: torch.device, iters: int) -> dict[str, float]:
    """Median wall time of one call in µs per implementation, after two warm-up rounds.

    The implementations take turns within each round, so a load change on a shared machine
    hits them alike and the ratios stay fair.
    """
    times: dict[str, list[float]] = {name: [] for name in impls}
    for i in range(iters + 2):
        for name, fn in impls.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"context": 48, "iters": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes 48-token contexts and one timed call."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parse_with_smoke(parser, argv, SMOKE, "48-token contexts, one timed call: checks it runs")
    return args


def implementations(query, k_cache, v_cache, meta, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """Every implementation of one step, the oracle first (Triton only where it runs)."""
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "oracle (rows)": lambda: paged_attention_reference(query, k_cache, v_cache, meta, scale=scale),
        "torch batched": lambda: paged_attention_torch(query, k_cache, v_cache, meta, scale=scale),
        "unpaged SDPA": contiguous_sdpa(query, k_cache, v_cache, meta, scale),
    }
    if select_backend(query) == "triton":
        impls["triton"] = lambda: paged_attention(query, k_cache, v_cache, meta, scale=scale)
    return impls


def main(argv: list[str] | None = None) -> list[dict]:
    """Check and time every implementation; returns one row per (shape, step, implementation) as printed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = args.context
    steps = {f"16 decode × {ctx}": [(1, ctx)] * 16, f"prefill {ctx} + 15 decode": [(ctx, ctx)] + [(1, ctx)] * 15}
    print(f"device={device} dtype={dtype} threads={torch.get_num_threads()} block_size={BLOCK_SIZE}")
    print(f"{'shape':<14} {'step':<24} {'implementation':<16} {'µs/call':>10} {'vs oracle':>10}")
    rows = []
    for shape_name, (heads, kv_heads, head_dim) in SHAPES.items():
        for step_name, step_rows in steps.items():
            query, k_cache, v_cache, meta = build_step(step_rows, heads, kv_heads, head_dim, dtype, device)
            impls = implementations(query, k_cache, v_cache, meta, head_dim**-0.5)
            want = impls["oracle (rows)"]().float()
            for fn in impls.values():
                torch.testing.assert_close(fn().float(), want, atol=3e-2, rtol=3e-2)
            timings = median_us(impls, device, args.iters)
            for impl_name, us in timings.items():
                ratio = timings["oracle (rows)"] / us
                rows.append({"shape": shape_name, "step": step_name, "implementation": impl_name, "us": us,
                             "vs_oracle": ratio})
                print(f"{shape_name:<14} {step_name:<24} {impl_name:<16} {us:>10.0f} {ratio:>9.1f}×")
    return rows


if __name__ == "__main__":
    main()
