"""StepBatch.build packs a step's integer arrays into one host buffer and one copy: the batch
equals the one-tensor-per-field construction exactly (values, dtypes, shapes, LoRA groups)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import PagedAttentionMetadata
from server.engine.host_buffers import HostStaging
from server.engine.lora import LoraGroups
from server.engine.step_batch import StepBatch

BLOCK = 4
CPU = torch.device("cpu")


def reference(rows, block_size, device, logit_counts=None, row_adapters=None) -> StepBatch:
    """The construction before packing: one small tensor per field."""
    tokens, positions, last_index = [], [], []
    for row, (_, new, start) in enumerate(rows):
        tokens.extend(new)
        positions.extend(range(start, start + len(new)))
        count = 1 if logit_counts is None else logit_counts[row]
        last_index.extend(range(len(tokens) - count, len(tokens)))
    attn = PagedAttentionMetadata.build([list(t) for t, _, _ in rows], [len(n) for _, n, _ in rows],
                                        [s + len(n) for _, n, s in rows], block_size, device)
    lora = None
    if row_adapters and any(row_adapters):
        lora = LoraGroups.build([a for (_, new, _), a in zip(rows, row_adapters) for _ in new], device)
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return StepBatch(as_long(tokens), as_long(positions), as_long(last_index), attn, logit_counts, lora)


def assert_same(got: StepBatch, want: StepBatch) -> None:
    for name in ("tokens", "positions", "last_index"):
        _same_tensor(getattr(got, name), getattr(want, name))
    for name in ("slot_mapping", "query_start", "context_lens", "block_tables"):
        _same_tensor(getattr(got.attn, name), getattr(want.attn, name))
    assert got.attn.query_lens_host == want.attn.query_lens_host
    assert got.attn.context_lens_host == want.attn.context_lens_host
    assert got.logit_counts == want.logit_counts
    if want.lora is None:
        assert got.lora is None
        return
    assert len(got.lora.groups) == len(want.lora.groups)
    for (got_id, got_where), (want_id, want_where) in zip(got.lora.groups, want.lora.groups):
        assert got_id == want_id
        if isinstance(want_where, slice):
            assert got_where == want_where
        else:
            _same_tensor(got_where, want_where)


def _same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert torch.equal(got.cpu(), want.cpu())


DECODE = [([1, 2, 3], [7], 9), ([4], [8], 2), ([5, 6], [9], 5)]
MIXED = [([1, 2, 3], [7], 9), ([4, 10], [11, 12, 13, 14, 15], 0), ([5, 6], [16, 17], 4), ([20], [18], 0)]


@pytest.mark.parametrize(
    ("rows", "kwargs"),
    [
        (DECODE, {}),
        (MIXED, {}),
        (MIXED, {"logit_counts": [1, 2, 2, 1]}),
        (MIXED, {"row_adapters": [0, 1, 0, 1]}),  # adapter 1's tokens are not contiguous: an index tensor
        (MIXED, {"row_adapters": [2, 2, 0, 1], "logit_counts": [1, 5, 1, 1]}),  # runs: slices
        (DECODE, {"row_adapters": [0, 0, 0]}),
    ],
    ids=["decode", "mixed", "per-position", "lora-gather", "lora-runs", "lora-all-base"],
)
def test_packed_batch_equals_one_tensor_per_field(rows, kwargs):
    assert_same(StepBatch.build(rows, BLOCK, CPU, **kwargs), reference(rows, BLOCK, CPU, **kwargs))
    staging = HostStaging(CPU)
    assert_same(StepBatch.build(rows, BLOCK, CPU, staging=staging, **kwargs), reference(rows, BLOCK, CPU, **kwargs))


def test_cpu_staging_copies_nothing_and_never_reuses():
    staging = HostStaging(CPU)
    first, second = staging.buffer(64), staging.buffer(64)
    assert not staging.pinned and first.data_ptr() != second.data_ptr()
    assert staging.upload(first) is first


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_packed_batch_equals_one_tensor_per_field():
    device = torch.device("cuda")
    staging = HostStaging(device)
    for rows, kwargs in [(DECODE, {}), (MIXED, {"row_adapters": [0, 1, 0, 1], "logit_counts": [1, 2, 2, 1]})] * 3:
        assert_same(StepBatch.build(rows, BLOCK, device, staging=staging, **kwargs),
                    reference(rows, BLOCK, device, **kwargs))


@cuda
def test_cuda_staging_alternates_pinned_buffers_and_keeps_uploads_intact():
    staging = HostStaging("cuda")
    uploads = []
    for value in range(6):  # more uploads than slots: each buffer is refilled after its copy
        host = staging.buffer(4096 * (1 + value))  # grows as it goes
        assert host.is_pinned()
        host.view(torch.int32).fill_(value)
        uploads.append(staging.upload(host.view(torch.int32)))
    for value, device_tensor in enumerate(uploads):
        assert device_tensor.is_cuda and bool((device_tensor == value).all())
    with pytest.raises(ValueError):
        staging.upload(torch.empty(4, dtype=torch.uint8).pin_memory())
