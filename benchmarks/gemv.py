"""Split-K skinny GEMM (``kernels.skinny_linear``) vs cuBLAS on Llama decode projections.

For each projection of the Llama 1B and 8B shapes (qkv, o, gate_up, down, lm_head; weight
``[N, K]``) at batch 1/2/4/8 in bfloat16: cuBLAS (``F.linear``) µs, the best Triton split-K
µs and its split, and the GB/s each achieves on the weight bytes (a decode projection reads
its whole weight once; x and y are negligible). Every candidate's output is checked against
``F.linear`` first. Times are CUDA-event medians over rotated weight copies (at least twice
the L2 size in all), so small layers are read from HBM as in a real decode step. Then the
table of a :class:`kernels.GemvChoice` run over the same shapes (timed on one weight each, so
small layers may sit in L2 there).

Without CUDA no time is taken: each shape, scaled down (N and K divided by ``--scale``), runs
through the Triton interpreter at split_k 1 and 4 and one correctness line is printed per shape.

    python benchmarks/gemv.py
    python benchmarks/gemv.py --models 8b --batches 1 8 --iters 50
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before kernels is imported: Triton reads it at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import GemvChoice, select_backend, skinny_linear, skinny_linear_reference
from kernels.gemv import SPLIT_CANDIDATES, median_cuda_us

# (hidden, intermediate, query heads, kv heads, head dim, vocab)
MODELS = {"1b": (2048, 8192, 32, 8, 64, 128256), "8b": (4096, 14336, 32, 8, 128, 128256)}
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


@dataclass
class Shape:
    """One decode projection: ``y [batch, n] = x [batch, k] @ W [n, k]^T``."""

    model: str
    proj: str
    n: int
    k: int
    batch: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.proj} N={self.n} K={self.k} b={self.batch}"


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode projection of ``model`` (q/k/v and gate/up each fused into one weight)."""
    hidden, inter, heads, kv_heads, head_dim, vocab = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }


def shapes(models: list[str], batches: list[int], scale: int = 1) -> list[Shape]:
    """Every (model, projection, batch), N and K divided by ``scale`` (at least 1)."""
    return [
        Shape(model, proj, max(1, n // scale), max(1, k // scale), batch)
        for model in models
        for proj, (n, k) in projections(model).items()
        for batch in batches
    ]


def _weight(shape: Shape, device: torch.device, gen: torch.Generator | None = None) -> torch.Tensor:
    """A random bf16 weight scaled like an initialised layer (outputs of order one)."""
    weight = torch.randn(shape.n, shape.k, generator=gen, device=device) * shape.k**-0.5
    return weight.to(torch.bfloat16)


def _l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def time_shape(shape: Shape, device: torch.device, iters: int) -> dict[str, float]:
    """µs per candidate ("cublas", "triton_split{k}") over rotated weight copies, checked first."""
    weight_bytes = shape.n * shape.k * 2
    copies = max(1, -(-2 * _l2_bytes(device) // weight_bytes))
    weights = [_weight(shape, device) for _ in range(copies)]
    x = torch.randn(shape.batch, shape.k, device=device, dtype=torch.bfloat16)
    runners: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"cublas": lambda w: F.linear(x, w)}
    for split in SPLIT_CANDIDATES:
        runners[f"triton_split{split}"] = lambda w, s=split: skinny_linear(x, w, use_triton=True, split_k=s)
    want = F.linear(x, weights[0])
    for name, run in runners.items():
        torch.testing.assert_close(run(weights[0]), want, **BF16_TOL, msg=lambda m, n=name: f"{n}: {m}")
    return {
        name: median_cuda_us(lambda i, r=run: r(weights[i % copies]), iters=iters, warmup=3)
        for name, run in runners.items()
    }


def run_cuda(all_shapes: list[Shape], iters: int) -> None:
    """The timing table, then a GemvChoice's table over the same shapes."""
    device = torch.device("cuda")
    print(f"device={torch.cuda.get_device_name(device)} dtype=bfloat16 iters={iters} (cold: rotated weight copies)")
    print(f"{'shape':<40} {'MB':>7} {'cuBLAS µs':>10} {'GB/s':>7} {'Triton µs':>10} {'split':>5} {'GB/s':>7} {'speedup':>8}")
    for shape in all_shapes:
        times = time_shape(shape, device, iters)
        best = min((name for name in times if name != "cublas"), key=times.__getitem__)
        weight_bytes = shape.n * shape.k * 2
        cublas_us, triton_us = times["cublas"], times[best]
        print(
            f"{shape.label:<40} {weight_bytes / 1e6:>7.1f} {cublas_us:>10.1f} {weight_bytes / cublas_us / 1e3:>7.0f} "
            f"{triton_us:>10.1f} {best.removeprefix('triton_split'):>5} {weight_bytes / triton_us / 1e3:>7.0f} "
            f"{cublas_us / triton_us:>7.2f}x"
        )
    print_choice_table(all_shapes, device)


def print_choice_table(all_shapes: list[Shape], device: torch.device) -> None:
    """Run a GemvChoice over every shape (one weight each) and print what it picked."""
    choice = GemvChoice()
    for shape in all_shapes:
        weight = _weight(shape, device)
        x = torch.randn(shape.batch, shape.k, device=device, dtype=torch.bfloat16)
        torch.testing.assert_close(choice.linear(x, weight), F.linear(x, weight), **BF16_TOL)
    print("\nGemvChoice table (M, N, K) -> winner | µs per candidate (one weight: small layers may be in L2)")
    for (m, n, k, _dtype), (winner, times) in choice.table.items():
        cells = " ".join(f"{name.replace('triton_', '')}={us:.1f}" for name, us in times.items())
        print(f"({m}, {n}, {k}) -> {winner:<14} | {cells}")


def run_interpreter(all_shapes: list[Shape], scale: int) -> int:
    """Correctness of each scaled-down shape under the Triton interpreter (no timing); exit code."""
    probe = torch.zeros(1, 1)
    if select_backend(probe, use_triton=True) != "triton":
        print("no CUDA and the Triton interpreter is unavailable here: nothing checked")
        return 0
    print(f"no CUDA: correctness only (no timing), under the Triton interpreter, on shapes scaled down "
          f"{scale}x (N/{scale}, K/{scale}); split_k 1 and 4 (capped at one split per BLOCK_K chunk of K)")
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for shape in all_shapes:
        x = torch.randn(shape.batch, shape.k, generator=gen).bfloat16()
        weight = _weight(shape, torch.device("cpu"), gen)
        want = skinny_linear_reference(x, weight).float()
        got = {split: skinny_linear(x, weight, use_triton=True, split_k=split).float() for split in (1, 4)}
        ok = all(torch.allclose(out, want, **BF16_TOL) for out in got.values())
        failures += not ok
        errors = " ".join(f"split{split}={(out - want).abs().max().item():.3g}" for split, out in got.items())
        print(f"{shape.label:<40} max|err| {errors} {'ok' if ok else 'MISMATCH'}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per candidate (CUDA)")
    parser.add_argument("--scale", type=int, default=16, help="without CUDA: divide N and K by this")
    args = parser.parse_args(argv)
    if any(not 1 <= b <= 8 for b in args.batches):
        parser.error("batches must be 1..8 (skinny_linear falls back to F.linear above 8 rows)")
    if torch.cuda.is_available():
        run_cuda(shapes(args.models, args.batches), args.iters)
        return 0
    return run_interpreter(shapes(args.models, args.batches, args.scale), args.scale)


if __name__ == "__main__":
    raise SystemExit(main())
