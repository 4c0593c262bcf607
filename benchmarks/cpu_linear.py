"""Float32 CPU projections: MKL (``F.linear``) vs the packed-panel kernel (``kernels.cpu_linear``).

For the default model's projections (SmolLM2-135M: qkv, o, gate_up, down, the output layer) at
row counts from a decode step's one row through drafts and batches to prompt chunks: µs per call
of each, interleaved in one run (medians of alternating rounds), the ratio, and whether the
packed kernel's rows keep their bits at every row count (each row as it would be alone; MKL's do
not). Every shape's result is checked against ``F.linear`` first.

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --rows 1 8 64 --shapes gate_up down --rounds 9
    python benchmarks/cpu_linear.py --smoke      # tiny shapes, a few calls: checks it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from kernels.cpu_linear import pack_weight, packed_linear

# weight [N, K] of SmolLM2-135M's fused projections
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
SMOKE_SHAPES = {"qkv": (96, 64), "down": (64, 160)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def time_us(fn: Callable[[], torch.Tensor], calls: int) -> float:
    """Mean µs of ``calls`` calls of ``fn`` (after one untimed call)."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def rows_keep_bits(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether row 0 of ``fn(x)`` is bit for bit ``fn`` of row 0 alone."""
    return torch.equal(fn(x)[:1], fn(x[:1]))


def measure(name: str, n: int, k: int, rows: int, rounds: int, calls: int) -> dict:
    """One shape at one row count: both kernels' µs (median of alternating rounds), checked first."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(rows, k, generator=gen)
    packed = pack_weight(weight)
    if packed is None:
        raise SystemExit("the packed kernel is not available here (no C++ build or no AVX-512)")
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    mkl, panel = [], []
    for _ in range(rounds):
        mkl.append(time_us(lambda: F.linear(x, weight), calls))
        panel.append(time_us(lambda: packed_linear(x, packed), calls))
    return {"shape": name, "n": n, "k": k, "rows": rows, "mkl_us": statistics.median(mkl),
            "packed_us": statistics.median(panel),
            "mkl_keeps_bits": rows_keep_bits(x, lambda t: F.linear(t, weight)),
            "packed_keeps_bits": rows_keep_bits(x, lambda t: packed_linear(t, packed))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per point (median kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1, 9 and 70 rows, one round")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes}
    rows_list, rounds = ([1, 9, 70], 1) if args.smoke else (args.rows, args.rounds)
    print(f"threads={torch.get_num_threads()} rounds={rounds}")
    print(f"{'shape':8s} {'N x K':>12s} {'rows':>5s} {'MKL µs':>10s} {'packed µs':>10s} {'packed/MKL':>10s}"
          f" {'row bits kept (MKL / packed)':>30s}")
    for name, (n, k) in shapes.items():
        for rows in rows_list:
            calls = 1 if args.smoke else max(2, min(50, int(2e8 / (2 * n * k * rows))))
            r = measure(name, n, k, rows, rounds, calls)
            kept = f"{'yes' if r['mkl_keeps_bits'] else 'no'} / {'yes' if r['packed_keeps_bits'] else 'no'}"
            print(f"{name:8s} {f'{n} x {k}':>12s} {rows:5d} {r['mkl_us']:10.1f} {r['packed_us']:10.1f}"
                  f" {r['packed_us'] / r['mkl_us']:9.2f}x {kept:>30s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
