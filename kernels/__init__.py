"""Kernels for the sampler and the engine: Triton implementations + pure-torch references.

Every public kernel dispatches on the tensor's device: Triton on CUDA (when importable),
the Triton interpreter on CPU when ``TRITON_INTERPRET=1`` and ``use_triton=True``, and
the pure-torch reference otherwise. The references double as test oracles.
"""

from kernels._backend import interpreter_enabled, select_backend, triton_kernels
from kernels.bitmask import (
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_reference,
    apply_token_bitmask_rows_inplace,
    unpack_bitmask,
)
from kernels.dfa import dfa_advance, dfa_advance_reference, dfa_apply_mask_inplace
from kernels.gemv import GemvChoice, skinny_linear, skinny_linear_reference
from kernels.paged_attention import (
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    write_kv,
)
from kernels.penalties import apply_penalties_inplace, apply_penalties_reference

__all__ = [
    "GemvChoice",
    "PagedAttentionMetadata",
    "apply_penalties_inplace",
    "apply_penalties_reference",
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_inplace_reference",
    "apply_token_bitmask_rows_inplace",
    "dfa_advance",
    "dfa_advance_reference",
    "dfa_apply_mask_inplace",
    "interpreter_enabled",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_torch",
    "select_backend",
    "skinny_linear",
    "skinny_linear_reference",
    "triton_kernels",
    "unpack_bitmask",
    "write_kv",
]
