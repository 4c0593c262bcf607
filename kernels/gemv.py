"""Skinny linear layers for decode: ``y = x @ W^T (+ bias)`` with 1-8 rows of x.

At decode batch sizes a projection reads its whole weight to produce a handful of rows, so it
is bound by memory bandwidth, and cuBLAS's tiles (built for many rows) can leave SMs idle on
narrow layers. :func:`skinny_linear` runs a split-K Triton kernel (``kernels._gemv_triton``)
that reads each weight element once and spreads K over several programs when N alone gives
too few. :class:`GemvChoice` times it against ``F.linear`` per shape on the device and keeps
whichever is faster. :func:`skinny_linear_reference` (float32 matmul, then cast) is the oracle.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels._backend import select_backend

MAX_ROWS = 8  # more rows than this always take F.linear
SPLIT_CANDIDATES = (1, 2, 4, 8, 16)  # split_k values GemvChoice times
_MAX_AUTO_SPLIT = 16
# (BLOCK_N, BLOCK_K) per row tile (see kernels._gemv_triton.block_m): the CUDA-core path keeps its
# BLOCK_M x BLOCK_N x BLOCK_K product at 8K elements (64 registers a thread at 4 warps); 16 rows: tl.dot.
_BLOCKS = {1: (32, 256), 2: (32, 128), 4: (32, 64), 16: (64, 128)}

ShapeKey = tuple[int, int, int, torch.dtype]  # (row bucket, N, K, dtype of x)


def row_bucket(rows: int) -> int:
    """The rows' timing bucket: 1, 2, 4 or 8 (the kernel's row tiles: 5-8 rows share one). Row
    counts change every step with drafts and jump-forward; one choice per tile, timed once."""
    return 1 << max(rows - 1, 0).bit_length()


@functools.cache
def _triton_module() -> ModuleType | None:
    """``kernels._gemv_triton``, or None when Triton cannot be imported."""
    try:
        from kernels import _gemv_triton
    except Exception:  # noqa: BLE001 (ImportError, or a broken backend raising at import)
        return None
    return _gemv_triton


def skinny_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The oracle: ``x [..., K] @ weight [N, K]^T (+ bias [N])`` in float32, cast to x's dtype."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``.

    With at most :data:`MAX_ROWS` rows (leading dims flattened) and the Triton backend
    (:func:`kernels.select_backend`; ``use_triton=True`` with ``TRITON_INTERPRET=1`` runs
    the kernel on CPU tensors, for tests): the split-K kernel, accumulating in float32, output
    in x's dtype. ``split_k`` None picks from shapes (:func:`default_split_k`). Otherwise
    ``F.linear``.
    """
    _check_shapes(x, weight, bias)
    rows = x.shape[:-1].numel()
    mod = _triton_module() if select_backend(x, use_triton) == "triton" else None
    if mod is None or rows > MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    block_n, block_k = _BLOCKS[mod.block_m(rows)]
    splits = split_k if split_k is not None else default_split_k(x, weight.shape[0], x.shape[-1], block_n, block_k)
    out = mod.gemv(flat, weight, bias, splits, block_n, block_k)
    return out.view(*x.shape[:-1], weight.shape[0])


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x [..., K], weight [N, K], bias [N] (cheap; no device sync)."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_split_k(x: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> int:
    """K splits from shapes: on CUDA, the power of two (at most 16, at most one per
    ``block_k`` chunk of K) that brings the programs to about twice the SM count; elsewhere 1."""
    if not x.is_cuda:
        return 1
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    n_blocks = -(-n // block_n)
    want = -(-2 * _sm_count(index) // n_blocks)
    split = 1
    while split < min(want, _MAX_AUTO_SPLIT, -(-k // block_k)):
        split *= 2
    return split


_BACKLOG_CYCLES = 5_000_000  # a few ms of GPU sleep: longer than enqueueing the timed calls


def median_cuda_us(run: Callable[[int], object], iters: int = 20, warmup: int = 3) -> float:
    """Median device time of ``run(i)`` in µs over ``iters`` calls (CUDA events around each),
    after ``warmup`` untimed calls. ``i`` counts the timed calls, so a caller may rotate
    inputs (e.g. weight copies, to time reads from memory rather than L2).

    The timed calls queue up behind a short GPU sleep, so the events measure the kernels alone,
    not the host's launch cost (which CUDA graphs remove in the engine's decode steps)."""
    for i in range(warmup):
        run(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(_BACKLOG_CYCLES)
    for i in range(iters):
        starts[i].record()
        run(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))


class GemvChoice:
    """Per shape, the faster of cuBLAS (``F.linear``) and the split-K Triton kernel.

    The first call of a CUDA shape ``(M, N, K, dtype)`` with ``M <= 8`` (M by :func:`row_bucket`)
    times ``F.linear`` and the kernel at each split in ``split_candidates`` (CUDA events:
    ``warmup`` calls, then the median of ``iters``; device time, see :func:`median_cuda_us`) on
    the call's own tensors and remembers the fastest; later calls run it. ``table`` maps each
    timed shape to ``(winner, {candidate: µs})``, candidates being ``"cublas"`` and
    ``"triton_split{k}"``. CPU tensors, larger M, a device without compiled
    Triton, and a first call during CUDA-graph capture take ``F.linear`` and time nothing.
    """

    def __init__(self, split_candidates: tuple[int, ...] = SPLIT_CANDIDATES, iters: int = 20, warmup: int = 3) -> None:
        self.split_candidates = split_candidates
        self.iters = iters
        self.warmup = warmup
        self.table: dict[ShapeKey, tuple[str, dict[str, float]]] = {}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` by the implementation chosen for this shape."""
        return self._run(self.choose(x, weight, bias), x, weight, bias)

    def choose(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str:
        """The candidate name for this call's shape, timing the candidates on first sight."""
        rows = x.shape[:-1].numel()
        if not self._tunable(x, rows):
            return "cublas"
        key: ShapeKey = (row_bucket(rows), weight.shape[0], weight.shape[1], x.dtype)
        if key not in self.table:
            if torch.cuda.is_current_stream_capturing():
                return "cublas"  # no timing inside a graph capture
            self.table[key] = self._measure(x, weight, bias)
        return self.table[key][0]

    @staticmethod
    def _tunable(x: torch.Tensor, rows: int) -> bool:
        return x.is_cuda and 0 < rows <= MAX_ROWS and select_backend(x) == "triton" and _triton_module() is not None

    def _measure(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[str, dict[str, float]]:
        """Time every candidate that computes the product; (fastest name, µs per candidate)."""
        exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        candidates = [name for name in self._candidates(x, weight) if self._agrees(name, x, weight, bias, exact)]
        times = {
            name: median_cuda_us(lambda _i, n=name: self._run(n, x, weight, bias), self.iters, self.warmup)
            for name in candidates
        }
        return min(times, key=times.__getitem__), times

    def _agrees(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                exact: torch.Tensor) -> bool:
        """The candidate's output on this call is the float32 product within the dtype's rounding,
        relative to the output's largest value (a kernel that computes wrongly on some device or
        shape is never chosen). Not against cuBLAS's own output: with bfloat16 it may reduce in
        bfloat16 (``allow_bf16_reduced_precision_reduction``), off by more than a rounding
        wherever the output is near zero, and an exact kernel was rejected on an H100."""
        if name == "cublas":
            return True
        fraction = 1e-4 if x.dtype == torch.float32 else 2e-2
        error = float((self._run(name, x, weight, bias).float() - exact).abs().max())
        return error <= fraction * float(exact.abs().max()) + 1e-6

    def _candidates(self, x: torch.Tensor, weight: torch.Tensor) -> list[str]:
        """cuBLAS, then the kernel at each distinct split it would really use for this K."""
        mod = _triton_module()
        rows = x.shape[:-1].numel()
        block_k = _BLOCKS[mod.block_m(rows)][1]
        splits = sorted({mod.effective_split(weight.shape[1], s, block_k) for s in self.split_candidates})
        return ["cublas"] + [f"triton_split{s}" for s in splits]

    @staticmethod
    def _run(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if name == "cublas":
            return F.linear(x, weight, bias)
        return skinny_linear(x, weight, bias, use_triton=True, split_k=int(name.removeprefix("triton_split")))
