"""The paged KV cache: fixed-size blocks of keys/values, sized from a memory budget.

Every layer holds ``[num_blocks, block_size, kv_heads, head_dim]`` keys and values (the paged
"NHD" layout of :mod:`kernels.paged_attention`). Nothing is reserved per sequence: the block
manager hands blocks out as sequences grow, so the number of sequences running together is
bounded by the tokens they actually hold, not by ``slots x max_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Keys + values of one block over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


class PagedKVCache:
    """Keys and values ``[layers, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        size = (shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` into block ``dst`` in every layer, for each ``(src, dst)``."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def plan_num_blocks(
    shape: KVShape,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    cpu_bytes: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    min_blocks: int = 1,
) -> int:
    """How many blocks fit: on CUDA, ``gpu_memory_utilization`` of the device's total memory
    minus what is already allocated (weights, workspaces); elsewhere ``cpu_bytes``."""
    per_block = shape.bytes_per_block(block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free)
    else:
        budget = cpu_bytes
    return max(min_blocks, budget // per_block)
