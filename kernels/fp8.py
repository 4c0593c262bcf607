"""FP8 (e4m3) linear layers: ``y = x @ W^T`` with W stored in FP8 and one float32 scale per
output channel.

- :func:`scaled_linear` (W8A8): the activations are quantized on the fly, one scale per row
  (token) from the row's absolute maximum, or with a checkpoint's static per-tensor scale
  (:func:`quantize_rows`: one Triton kernel on CUDA, its torch reference elsewhere), then
  ``torch._scaled_mm`` (sm89 and newer) multiplies the FP8 rows by the FP8 weight (column-major:
  ``W [N, K]`` row-major, transposed): "rowwise" with the ``[M, 1]`` and ``[1, N]`` scales in its
  epilogue, or "tensorwise" (cuBLASLt, unit scales) with the scales applied after.
- :func:`fp8_gemv` (W8A16, at most 64 rows: decode): a split-K Triton kernel that reads the FP8
  weight once and multiplies it by the unquantized activations in float32, as
  :mod:`kernels.gemv` does for bf16 weights. At decode the step is bound by reading weights,
  and ``_scaled_mm``'s kernels are built for many rows.

:class:`Fp8Choice` times the candidates per shape on CUDA and keeps the fastest.
:func:`scaled_linear_reference` and :func:`fp8_gemv_reference` are the oracles (float32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels._backend import select_backend
from kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE
from kernels.gemv import median_cuda_us

ALIGNMENT = 16  # _scaled_mm needs K and N to be multiples of this


@functools.cache
def _triton_module() -> ModuleType | None:
    """``kernels._fp8_triton``, or None when Triton cannot be imported."""
    try:
        from kernels import _fp8_triton
    except Exception:  # noqa: BLE001 (ImportError, or a broken backend raising at import)
        return None
    return _fp8_triton


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] as FP8 with one float32 scale per output row: (fp8 [N, K], scale [N]),
    ``weight ≈ fp8.float() * scale[:, None]``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (FP8 [N, K]) times its per-row ``scale`` [N] (or one scale), in ``dtype``."""
    scale = scale.float().reshape(-1)
    rows = scale[:, None] if scale.numel() > 1 else scale
    return (weight.float() * rows).to(dtype)


def quantize_rows_reference(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                            scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch oracle of :func:`quantize_rows`."""
    xf = x.float()
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    else:
        amax = xf.abs().amax(dim=1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None, scale_ub: float | None = None,
                  *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as FP8 rows and their float32 scales [M, 1] (``x ≈ q.float() * scale``).

    Dynamic (``input_scale`` None): each row's scale is its absolute maximum (capped at
    ``scale_ub`` when given, as fbgemm's ``activation_scale_ub``) over 448; static: every row
    takes ``input_scale`` (a float32 tensor of one element). Values beyond the range saturate."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dimension, got {tuple(x.shape)}")
    if select_backend(x, use_triton) == "triton":
        mod = _triton_module()
        if mod is not None:
            return mod.quantize_rows(x, input_scale, scale_ub)
    return quantize_rows_reference(x, input_scale, scale_ub)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
                  scale_ub: float | None = None, tensorwise: bool = False,
                  use_triton: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] * weight_scale)^T (+ bias)`` through ``torch._scaled_mm``, in
    x's dtype. ``weight``: FP8, row-major; ``weight_scale``: float32 [1, N], contiguous; the
    activations are quantized by :func:`quantize_rows` (``input_scale``, ``scale_ub``).
    ``tensorwise``: multiply with unit scales and apply both scales to the output after."""
    if weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT:
        raise ValueError(f"_scaled_mm needs N and K to be multiples of {ALIGNMENT}, got {tuple(weight.shape)}")
    q, scale = quantize_rows(x, input_scale, scale_ub, use_triton=use_triton)
    # rowwise scaling writes bf16 only on CUDA; the CPU's kernel writes any float type, and before
    # torch 2.13 took only per-tensor scales there: the CPU multiplies with unit scales
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    if tensorwise or not x.is_cuda:
        one = _unit_scale(x.device)
        out = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)
        out = out.mul_(scale.to(out.dtype)).mul_(weight_scale.to(out.dtype))
    else:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of :func:`fp8_gemv`: x times the dequantized weight in float32, cast to x's dtype."""
    out = x.float() @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


GEMV_MAX_ROWS = 64  # more rows than this always take _scaled_mm
# Per row tile (see kernels._fp8_triton.gemv_block_m): the (BLOCK_N, BLOCK_K) blocks and K splits
# Fp8Choice times (each pair one Triton compilation); the first block is the default where
# nothing is timed. Up to 4 rows the K lanes accumulate in registers (rows x BLOCK_N x BLOCK_K at
# 8K), more rows go through tl.dot. Pruned to the shapes that won on an H100 at the 8B model's
# layers (one row: long K blocks, no split; 8-64 rows: 32-128 columns, split 1-8).
_DOT_BLOCKS = ((64, 128), (32, 128), (128, 128), (64, 64))
GEMV_CANDIDATES: dict[int, tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = {
    1: (((8, 1024), (16, 512), (4, 2048)), (1, 2)),
    2: (((8, 512), (16, 256), (4, 1024)), (1, 2, 4)),
    4: (((8, 256), (16, 128), (4, 512)), (1, 2, 4)),
    16: (_DOT_BLOCKS, (1, 2, 4, 8)),
    32: (_DOT_BLOCKS, (1, 2, 4, 8)),
    64: (_DOT_BLOCKS, (1, 2, 4, 8)),
}
# Up to 4 rows, also FP8 x FP8 tl.dot on the rows quantized first and padded to a 16-row tile: no
# FP8-to-float conversion of the weight (at one row on an H100 the W8A16 kernel read the 8B
# gate/up at 2.27 TB/s, the dot at 2.45 TB/s). Measured there and dropped: wider one-row
# blocks, 8-16 warps and pipeline depths (within 0.1 µs), and the quantization fused into the
# dot kernel (each program re-quantizing the rows cost more than the launch it saves).
_FEW_ROW_DOT_BLOCKS = ((64, 128), (32, 128), (128, 128), (32, 256), (64, 256))
_MAX_DEFAULT_SPLIT = 16


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the kernel; ``a8``: the activations quantized per token first and
    multiplied FP8 x FP8 by ``tl.dot`` (rows padded to a 16-row tile, CUDA sm89+)."""

    block_n: int
    block_k: int
    split_k: int
    a8: bool = False

    @property
    def name(self) -> str:
        return f"{'a8' if self.a8 else 'gemv'}_n{self.block_n}_k{self.block_k}_s{self.split_k}"

    def warps(self, tile: int) -> int:
        """4 warps; 8 or 16 for the largest tiles (register lanes past 8K, or 64 x 64+ dot tiles)."""
        if self.a8:
            tile = max(tile, 16)
        if tile <= 4:
            lanes = tile * self.block_n * self.block_k
            return 4 if lanes <= 8192 else 8 if lanes <= 16384 else 16
        return 8 if tile * self.block_n >= 4096 else 4


def gemv_configs(rows: int, fp8_dot: bool = False) -> list[GemvConfig]:
    """The configurations :class:`Fp8Choice` times for ``rows`` rows (``fp8_dot``: with the
    FP8 x FP8 ones)."""
    tile = _row_tile(rows)
    blocks, splits = GEMV_CANDIDATES[tile]
    configs = [GemvConfig(n, k, s) for n, k in blocks for s in splits]
    if fp8_dot:
        dot_blocks, dot_splits = (blocks, splits) if tile >= 16 else (_FEW_ROW_DOT_BLOCKS, (1, 2))
        configs += [GemvConfig(n, k, s, a8=True) for n, k in dot_blocks for s in dot_splits]
    return configs


def _row_tile(rows: int) -> int:
    tile = 1 << max(rows - 1, 0).bit_length()
    return tile if rows <= 4 else max(tile, 16)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             *, config: GemvConfig | None = None, input_scale: torch.Tensor | None = None,
             scale_ub: float | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] * weight_scale)^T (+ bias)`` with the activations unquantized
    (W8A16; an ``a8`` config quantizes them as :func:`scaled_linear` does, ``input_scale`` and
    ``scale_ub``), in x's dtype: the Triton kernel for at most :data:`GEMV_MAX_ROWS` rows where
    the backend allows (``config`` None: :func:`default_gemv_config`), else the reference."""
    mod = _triton_module() if select_backend(x, use_triton) == "triton" else None
    if mod is None or x.shape[0] > GEMV_MAX_ROWS:
        return fp8_gemv_reference(x, weight, weight_scale, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    config = config or default_gemv_config(x, weight)
    operand, x_scale = x, None
    if config.a8:
        operand, x_scale = quantize_rows(x, input_scale, scale_ub, use_triton=use_triton)
        x_scale = x_scale.reshape(-1)
    out = mod.fp8_gemv(operand, weight, weight_scale.reshape(-1), config.split_k, config.block_n, config.block_k,
                       num_warps=config.warps(_row_tile(x.shape[0])), x_scale=x_scale, out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def default_gemv_config(x: torch.Tensor, weight: torch.Tensor) -> GemvConfig:
    """The row tile's first blocks, split along K until the programs are about twice the SM
    count (CUDA; else no split)."""
    block_n, block_k = GEMV_CANDIDATES[_row_tile(x.shape[0])][0][0]
    if not x.is_cuda:
        return GemvConfig(block_n, block_k, 1)
    programs = -(-weight.shape[0] // block_n)
    want = -(-2 * _sm_count(x.device) // programs)
    split = 1
    while split < min(want, _MAX_DEFAULT_SPLIT):
        split *= 2
    return GemvConfig(block_n, block_k, split)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


ShapeKey = tuple[int, int, int, torch.dtype]  # (row bucket, N, K, dtype of x)


def row_bucket(rows: int) -> int:
    """The rows' timing bucket: the kernel's row tile up to 64 rows, then powers of two. The
    engine's row counts change every step (drafts, jump-forward, prefill chunks): timing every
    count on its first call cost 50 ms steps on an H100, one choice per bucket does not."""
    return _row_tile(rows) if rows <= GEMV_MAX_ROWS else 1 << (rows - 1).bit_length()


class Fp8Choice:
    """Per shape (rows by :func:`row_bucket`), the fastest of ``_scaled_mm`` rowwise, tensorwise
    and (at most 64 rows) the W8A16 kernel in each of :func:`gemv_configs`, timed on the device
    on the shape's first call
    (CUDA events, median of ``iters`` after ``warmup``); later calls run the winner. Elsewhere,
    and for a first call inside a CUDA-graph capture, a fixed choice: the kernel's default
    configuration where its backend runs, rowwise otherwise. ``table``: shape → (winner, µs per
    candidate)."""

    def __init__(self, iters: int = 20, warmup: int = 3) -> None:
        self.iters, self.warmup = iters, warmup
        self.table: dict[ShapeKey, tuple[str, dict[str, float]]] = {}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
               scale_ub: float | None = None, use_triton: bool | None = None) -> torch.Tensor:
        """The FP8 layer's output by the candidate chosen for this shape (arguments of :func:`scaled_linear`)."""
        configs = {}
        if self._gemv_runs(x, use_triton):
            configs = {c.name: c for c in gemv_configs(x.shape[0], fp8_dot=x.is_cuda)}

        def run(name: str) -> torch.Tensor:
            if name in configs:
                return fp8_gemv(x, weight, weight_scale, bias, config=configs[name], input_scale=input_scale,
                                scale_ub=scale_ub, use_triton=use_triton)
            return scaled_linear(x, weight, weight_scale, bias, input_scale=input_scale, scale_ub=scale_ub,
                                 tensorwise=name == "tensorwise", use_triton=use_triton)

        if not configs:
            return run("rowwise")
        key: ShapeKey = (row_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype)
        if key not in self.table:
            if not x.is_cuda or torch.cuda.is_current_stream_capturing():
                return fp8_gemv(x, weight, weight_scale, bias, use_triton=use_triton)
            self.table[key] = self._measure(run, ["tensorwise", *configs])
        return run(self.table[key][0])

    def _measure(self, run, candidates: list[str]) -> tuple[str, dict[str, float]]:
        """Time rowwise and every candidate that runs here and agrees with it (a kernel that fails
        to compile, or computes wrongly, on some device is never chosen)."""
        expected = run("rowwise").float()
        tolerance = 0.05 * float(expected.abs().max()) + 1e-3
        times = {"rowwise": median_cuda_us(lambda _i: run("rowwise"), self.iters, self.warmup)}
        for name in candidates:
            try:
                if float((run(name).float() - expected).abs().max()) > tolerance:
                    continue
                times[name] = median_cuda_us(lambda _i, n=name: run(n), self.iters, self.warmup)
            except Exception:  # noqa: BLE001, S112 (a candidate the device or Triton refuses is skipped)
                continue
        return min(times, key=times.__getitem__), times

    @staticmethod
    def _gemv_runs(x: torch.Tensor, use_triton: bool | None) -> bool:
        return (0 < x.shape[0] <= GEMV_MAX_ROWS and select_backend(x, use_triton) == "triton"
                and _triton_module() is not None)


def scaled_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
                            scale_ub: float | None = None) -> torch.Tensor:
    """The oracle of :func:`scaled_linear`: the same FP8 operands and scales, multiplied in float32."""
    q, scale = quantize_rows_reference(x, input_scale, scale_ub)
    out = (q.float() * scale) @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
