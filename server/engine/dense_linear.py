"""How a runner multiplies its unquantized weights, chosen once at load.

- CUDA, default: the faster per shape of cuBLAS and the split-K kernel at 1-8 rows
  (:class:`kernels.gemv.GemvChoice`, timed on first sight of a shape).
- CUDA with ``batch_invariant``: every row count through :func:`kernels.invariant_linear.invariant_linear`
  and attention unsplit, so a row's logits do not depend on the rows beside it (drafts,
  jump-forward, graph padding, other requests). Not with FP8 weights or LoRA adapters, whose
  kernels are not invariant.
- CPU, float32: every row count through :func:`kernels.cpu_linear.packed_linear` from weights
  packed once at load (:meth:`DenseLinears.pack`): each row as it would be alone, so drafts,
  jump-forward, batching and prompt chunks never change a row's bits, and a few rows cost little
  more than one. A weight lying on a GGUF grid (the default model's, dequantized from its Q4_1
  file) is packed as the grid: the same bits from a fifth of the bytes.
- Otherwise ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from kernels.cpu_linear import PackedWeight, pack_weight, packed_linear
from kernels.gemv import GemvChoice
from kernels.invariant_linear import agreeing_tiles, invariant_linear


class DenseLinears:
    """The unquantized linear layers' kernels of one runner (see the module docstring)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, use_triton: bool | None, *,
                 batch_invariant: bool = False, fp8: bool = False, lora: bool = False) -> None:
        """``use_triton`` as :class:`server.engine.model.ModelRunner`'s: True on the CPU runs the CUDA
        path's kernels in Triton's interpreter (tests), where ``batch_invariant`` applies too."""
        self.use_triton = use_triton
        self.batch_invariant = batch_invariant and (device.type == "cuda" and use_triton is not False
                                                    or use_triton is True)
        if self.batch_invariant and (fp8 or lora):
            raise ValueError("batch-invariant kernels cover bf16/fp16/fp32 weights without LoRA adapters")
        if self.batch_invariant:  # its tile check runs now, never inside a step or a graph capture
            agreeing_tiles(device.type, device.index, dtype)
        cuda_triton = device.type == "cuda" and use_triton is not False
        self.gemv = GemvChoice() if cuda_triton and not self.batch_invariant else None
        self.cpu_packed = (device.type == "cpu" and dtype == torch.float32 and use_triton is not True
                           and cpu_fused_ops() is not None)  # built now, not in a step
        self._packed: dict[int, tuple[torch.Tensor, PackedWeight]] = {}  # id(weight) -> (weight, packed)

    @property
    def num_kv_splits(self) -> int | None:
        """Attention's key splits: 1 (unsplit) for batch invariance, else the kernel's own choice."""
        return 1 if self.batch_invariant else None

    def pack(self, weights: Iterable[torch.Tensor]) -> None:
        """Pack these float32 CPU weights for :func:`kernels.cpu_linear.packed_linear` (at load: a
        weight seen first in a step would be packed inside it). A no-op off that path."""
        if not self.cpu_packed:
            return
        for weight in weights:
            if id(weight) not in self._packed and (packed := pack_weight(weight)) is not None:
                self._packed[id(weight)] = (weight, packed)

    @property
    def packs(self) -> bool:
        """Whether weights were packed (every row through the panels: each row's bits alone)."""
        return bool(self._packed)

    @property
    def packed_bytes(self) -> int:
        """The packed copies' bytes (they sit beside the weights)."""
        return sum(packed.nbytes for _, packed in self._packed.values())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` by this runner's kernels."""
        if self.batch_invariant:
            return invariant_linear(x, weight, bias, use_triton=self.use_triton)
        if self._packed:
            entry = self._packed.get(id(weight))
            if entry is not None and entry[0] is weight and x.dtype == torch.float32:
                return packed_linear(x, entry[1], bias)
            return F.linear(x, weight, bias)
        if self.gemv is None:
            return F.linear(x, weight, bias)
        return self.gemv.linear(x, weight, bias)
