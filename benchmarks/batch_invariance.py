"""Does a row's output depend on the rest of the batch? Default kernels vs batch-invariant ones.

Speculation, jump-forward and CUDA-graph padding change a step's row count; cuBLAS and split
attention then change a sequence's bfloat16 logits by an ulp, and greedy ties flip. This script
measures it op by op and for whole runner steps, and what the invariant kernels cost:

- tiles: which (BLOCK_M, BLOCK_N, warps) tiles of the invariant kernel give the base tile's bits
  on this device (:func:`kernels.invariant_linear.agreeing_tiles`).
- GEMM, the 1B shape's projections: row 0 of x at M = 1, 2, 3, 5, 8, 16, 33, 64, 257, for cuBLAS
  (``F.linear``), the runner's default (:class:`kernels.GemvChoice`) and
  :func:`kernels.invariant_linear.invariant_linear`: how many M give other bits than M = 1, and
  the largest difference; then µs per call (CUDA events) at M = 1, 8, 64, 512, 2048, and at M = 1
  by column tile.
- attention: one query over 1,000 keys decoded alone (automatic key split), unsplit, and as the
  first query of a 4-token verification.
- runner steps, the 1B shape with random weights: a sequence's next-token logits alone, among 7
  other rows with a prompt chunk, and inside a 4-token draft, default vs ``batch_invariant``:
  identical bits? same argmax?

Without CUDA (``--smoke`` or no GPU) the same checks run at scaled-down shapes in the Triton
interpreter, without timings.

    python benchmarks/batch_invariance.py            # CUDA: the 1B shape
    python benchmarks/batch_invariance.py --smoke    # anywhere, under a minute
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before kernels is imported: Triton reads it at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import PagedAttentionMetadata, paged_attention  # noqa: E402
from kernels.gemv import GemvChoice, median_cuda_us  # noqa: E402
from kernels.invariant_linear import agreeing_tiles, invariant_linear, tile_for  # noqa: E402
from server.engine.model import ModelRunner  # noqa: E402
from server.engine.step_batch import StepBatch  # noqa: E402

ROW_COUNTS = (1, 2, 3, 5, 8, 16, 33, 64, 257)
TIMED_ROWS = (1, 8, 64, 512, 2048)
PROJECTIONS_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                  "lm_head": (128256, 2048)}


def row_drift(linear, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, float]:
    """(row counts whose row 0 differs from M = 1, largest absolute difference)."""
    alone = linear(x[:1], weight).float()
    differ, largest = 0, 0.0
    for rows in ROW_COUNTS[1:]:
        got = linear(x[:rows], weight)[:1].float()
        if not torch.equal(got, alone):
            differ += 1
            largest = max(largest, float((got - alone).abs().max()))
    return differ, largest


def gemm_lines(device: torch.device, dtype: torch.dtype, scale: int, timed: bool) -> list[str]:
    choice = GemvChoice()
    interpreted = device.type != "cuda"
    kinds = {"F.linear": lambda x, w: F.linear(x, w), "default": lambda x, w: choice.linear(x, w),
             "invariant": lambda x, w: invariant_linear(x, w, use_triton=True if interpreted else None)}
    gen = torch.Generator().manual_seed(0)
    lines = []
    for name, (n, k) in PROJECTIONS_1B.items():
        n, k = n // scale, k // scale
        weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
        x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(dtype).to(device)
        drift = {kind: row_drift(fn, x, weight) for kind, fn in kinds.items()}
        text = "  ".join(f"{kind} {d}/{len(ROW_COUNTS) - 1} differ (max {m:.2g})" for kind, (d, m) in drift.items())
        lines.append(f"gemm {name} N={n} K={k}: {text}")
        if timed:
            xs = torch.randn(max(TIMED_ROWS), k, generator=gen).to(dtype).to(device)
            times = []
            for rows in TIMED_ROWS:
                cublas = median_cuda_us(lambda _i, r=rows: F.linear(xs[:r], weight))
                inv = median_cuda_us(lambda _i, r=rows: invariant_linear(xs[:r], weight))
                times.append(f"M={rows} {cublas:.0f}/{inv:.0f} ({inv / cublas:.2f}x)")
            lines.append(f"    µs cuBLAS/invariant: {'  '.join(times)}")
            one = [f"{t[1]}: {median_cuda_us(lambda _i, t=t: invariant_linear(xs[:1], weight, tile=t)):.0f}"
                   for t in ((16, 64, 4), (16, 32, 4), (16, 16, 4))]
            lines.append(f"    µs at M=1 by column tile: {'  '.join(one)} (chosen {tile_for(1, n, device)[1]})")
    return lines


def attention_line(device: torch.device, dtype: torch.dtype, context: int) -> str:
    """A decode query alone (auto split), unsplit, and as the first of a 4-token tile."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block = 32, 8, 64, 16
    blocks = -(-(context + 4) // block)
    k_cache = torch.randn(blocks + 1, block, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(blocks + 1, block, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query = torch.randn(4, heads, head_dim, generator=gen).to(dtype).to(device)
    table = [list(range(1, blocks + 1))]
    use = True if device.type != "cuda" else None

    def attend(q_len: int, splits: int | None) -> torch.Tensor:
        meta = PagedAttentionMetadata.build(table, [q_len], [context + q_len], block, device)
        return paged_attention(query[:q_len], k_cache, v_cache, meta, scale=head_dim**-0.5, use_triton=use,
                               num_kv_splits=splits)[:1].float()

    auto, unsplit, tile = attend(1, None), attend(1, 1), attend(4, 1)
    return (f"attention, one query over {context} keys: auto split vs unsplit max diff "
            f"{float((auto - unsplit).abs().max()):.2g}; unsplit alone vs first of a 4-token tile: "
            f"{'identical' if torch.equal(unsplit, tile) else f'max diff {float((unsplit - tile).abs().max()):.2g}'}")


def runner_line(model, batch_invariant: bool, interpreted: bool, prompt_len: int = 40) -> str:
    """A sequence's next-token logits alone, among other rows, and inside a draft."""
    vocab = model.config.vocab_size
    runner = ModelRunner.for_sequences(model, 8, 256, block_size=16, use_triton=True if interpreted else None,
                                       batch_invariant=batch_invariant)
    per_seq = 256 // 16

    def step(rows, logit_counts=None) -> torch.Tensor:
        paged = [([1 + slot * per_seq + i for i in range(per_seq)], new, start) for slot, new, start in rows]
        return runner.forward(StepBatch.build(paged, 16, runner.device, logit_counts=logit_counts)).float()

    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    others = prompt_len - 10  # the other sequences' history lengths start here
    draft = torch.randint(3, vocab, (4,), generator=gen).tolist()
    with torch.inference_mode():
        step([(0, prompt, 0)])
        alone = step([(0, draft[:1], prompt_len)])
        step([(1, prompt, 0)] + [(s, torch.randint(3, vocab, (others + s,), generator=gen).tolist(), 0)
                                 for s in range(2, 8)])
        mixed = [(s, [5], others + s) for s in range(2, 7)] + [(1, draft[:1], prompt_len),
                                                                 (7, [9, 10, 11], others + 7)]
        among = step(mixed)[5:6]
        step([(2, prompt, 0)])
        verified = step([(2, draft, prompt_len)], logit_counts=[4])[:1]
    label = "batch-invariant" if batch_invariant else "default"
    return (f"runner {label}: alone vs among 7 rows: {_compare(alone, among)}; "
            f"alone vs first of a draft: {_compare(alone, verified)}")


def _compare(a: torch.Tensor, b: torch.Tensor) -> str:
    """"identical", or the largest difference and whether the argmax moved."""
    if torch.equal(a, b):
        return "identical"
    argmax = "same" if int(a.argmax()) == int(b.argmax()) else "DIFFERS"
    return f"max diff {float((a - b).abs().max()):.2g}, argmax {argmax}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="scaled-down shapes in the Triton interpreter")
    parser.add_argument("--vocab", type=int, default=32000, help="the runner model's vocabulary (1B shape)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter, scaled down 64x)'} "
          f"dtype={str(dtype).removeprefix('torch.')}", flush=True)
    print(f"tiles giving the base tile's bits: {sorted(agreeing_tiles(device.type, device.index, dtype))}", flush=True)
    for line in gemm_lines(device, dtype, scale=1 if cuda else 64, timed=cuda):
        print(line, flush=True)
    print(attention_line(device, dtype, 1000 if cuda else 100), flush=True)
    from benchmarks.gpu import build_model

    model = build_model("1b" if cuda else "tiny", args.vocab if cuda else 320, 2, dtype, device)
    for invariant in (False, True):
        print(runner_line(model, invariant, interpreted=not cuda, prompt_len=40 if cuda else 14), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
