"""Float32 linear layers for a CPU step's few rows: each row computed as it would be alone.

A decode step, a draft's verification or a jump-forward multiplies a few rows by every weight.
MKL's small-M GEMMs read the weights well at one row but cost 1.8-2.4x that at 8 (so a draft must
be mostly kept to pay), and a row's bits change with the row count (so drafts and batching could
change a greedy token at a near-tie). ``rows_linear`` in ``kernels/csrc/cpu_fused.cpp`` reads
each weight row once for all rows and sums every output over K in 16-wide lanes in order: at one
thread 0.6-0.8x MKL's time at one row, ~0.5x at 4-8 rows, 0.6-0.9x at 16, about MKL's at 32 and
slower past it (this project's CPU; two threads alike). More rows (several sequences' drafts,
prompt chunks) and machines without the fused ops take ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops, fusable

MAX_ROWS = 16  # from 32 rows MKL is as fast or faster (its tiles use the FMA units better)


def cpu_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU ``x [M, K]``, ``weight [N, K]``; up to
    :data:`MAX_ROWS` rows through the fused kernel (each row as it would be alone), else F.linear."""
    ops = cpu_fused_ops()
    if (ops is None or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1
            or not fusable(x, weight)):
        return F.linear(x, weight, bias)
    return ops.rows_linear(x, weight, bias)
