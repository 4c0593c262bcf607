"""Sampler pass and bitmask-apply timings on the current device.

Usage: python benchmarks/sampler_bench.py [--vocab 49152] [--iters 20] [--device cuda|cpu] [--threads N]
       [--batches 1 8 32 64] [--smoke]

For B in ``--batches`` (default 1, 8, 32, 64): one ``Sampler.sample`` pass (seeded temperature sampling) with
all rows free, one row bitmask-constrained, all rows constrained, and one DFA-constrained
row; plus ``apply_token_bitmask_inplace`` on all rows, torch reference vs Triton (CUDA).
``--smoke``: B in (1, 4), a 4096-token vocabulary, two timed calls (checks it runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import apply_token_bitmask_inplace, select_backend  # noqa: E402
from sampler import Sampler, SamplingParams  # noqa: E402
from benchmarks.smoke import parse_with_smoke  # noqa: E402


def _timer(device: torch.device, fn: Callable[[], None], setup: Callable[[], None], iters: int) -> float:
    """Median µs of ``fn`` (``setup`` runs untimed before each call)."""
    times = []
    for i in range(iters + 5):
        setup()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:  # warm-up
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _random_words(n_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    n_words = (vocab + 31) // 32
    words = torch.randint(-(2**31), 2**31 - 1, (n_rows, n_words), dtype=torch.int64)
    return words.to(torch.int32).to(device)


class _OneStateDFA:
    """A one-state DFA allowing random tokens (for the DFA column)."""

    def __init__(self, vocab: int) -> None:
        self.initial_state = 0
        self.allowed = _random_words(1, vocab, torch.device("cpu"))
        self.trans_offsets = torch.tensor([0, vocab], dtype=torch.int32)
        self.trans_tokens = torch.arange(vocab, dtype=torch.int32)
        self.trans_next = torch.zeros(vocab, dtype=torch.int32)
        self.final = torch.tensor([True])
        self.stop_token_ids = [0]


def bench_sampler(batch: int, vocab: int, device: torch.device, iters: int) -> dict[str, float]:
    """Median µs of one sampler pass per workload (free, greedy, constrained rows, a DFA row)."""
    sampler = Sampler(vocab, device)
    params = SamplingParams(temperature=0.8, seed=0)
    rows = [sampler.new_row(params, []) for _ in range(batch)]
    base = torch.randn(batch, vocab, device=device)
    work = base.clone()
    setup = lambda: work.copy_(base)  # noqa: E731
    words_all = _random_words(batch, vocab, device)
    one = torch.tensor([batch // 2], device=device)
    out = {
        "free": _timer(device, lambda: sampler.sample(work, rows), setup, iters),
        "greedy": 0.0,
        "1 constr": _timer(device, lambda: sampler.sample(work, rows, words_all[:1], one), setup, iters),
        "all constr": _timer(device, lambda: sampler.sample(work, rows, words_all), setup, iters),
    }
    greedy_rows = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(batch)]
    out["greedy"] = _timer(device, lambda: sampler.sample(work, greedy_rows), setup, iters)
    dfa_rows = [sampler.new_row(params, []) for _ in range(batch)]
    dfa_rows[batch // 2].attach_dfa(_OneStateDFA(vocab))
    out["1 DFA"] = _timer(device, lambda: sampler.sample(work, dfa_rows), setup, iters)
    return out


def bench_mask(batch: int, vocab: int, device: torch.device, iters: int) -> dict[str, float]:
    """Median µs of the bitmask apply on every row: torch reference, Triton where it runs (else nan)."""
    base = torch.randn(batch, vocab, device=device)
    work = base.clone()
    words = _random_words(batch, vocab, device)
    setup = lambda: work.copy_(base)  # noqa: E731
    ref = _timer(device, lambda: apply_token_bitmask_inplace(work, words, use_triton=False), setup, iters)
    tri = float("nan")
    if select_backend(work) == "triton":
        tri = _timer(device, lambda: apply_token_bitmask_inplace(work, words), setup, iters)
    return {"mask ref": ref, "mask triton": tri}


COLUMNS = ["free", "greedy", "1 constr", "all constr", "1 DFA", "mask ref", "mask triton"]


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"batches": [1, 4], "vocab": 4096, "iters": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes B in (1, 4), a 4096-token vocabulary and two timed calls."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default); 1 is steadier on a shared machine")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    args = parse_with_smoke(ap, argv, SMOKE, "B in (1, 4), V=4096, 2 timed calls: checks it runs")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Time every column at every batch size; returns one row per batch (µs per column) as printed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device: {name}  V={args.vocab}  median of {args.iters} iters, µs per call")
    print(f"{'B':>4} " + " ".join(f"{c:>11}" for c in COLUMNS) + f" {'1c/free':>8} {'all/free':>8} {'ref/tri':>8}")
    rows = []
    for batch in args.batches:
        r = bench_sampler(batch, args.vocab, device, args.iters) | bench_mask(batch, args.vocab, device, args.iters)
        ratios = (r["1 constr"] / r["free"], r["all constr"] / r["free"], r["mask ref"] / r["mask triton"])
        rows.append({"batch": batch, **r})
        print(f"{batch:>4} " + " ".join(f"{r[c]:>11.1f}" for c in COLUMNS) + " " + " ".join(f"{x:>8.2f}" for x in ratios))
    return rows


if __name__ == "__main__":
    main()
