"""Attention of one engine step over a paged KV cache: every row's new tokens in one call.

The cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]`` (the
"NHD" paged layout of flash-attn and FlashInfer). A row (one sequence this step) owns the
blocks listed in its block-table row; its ``q_len`` new tokens are written into the cache
first (:func:`write_kv`), then attend causally over the row's whole context: query ``j`` of
row ``r`` sits at position ``context_lens[r] - q_len + j`` and sees keys ``0..`` that position
(or only the last ``sliding_window`` of them). Decode rows (``q_len == 1``), prefill chunks and
multi-token continuations mix freely in one call. A step may let some queries see further ahead
(``PagedAttentionMetadata.visible_until``: Gemma 3's image tokens attend to their whole image).

:func:`paged_attention_reference` is the oracle: plain torch, one row at a time, float32
softmax. The Triton kernel and the CPU fast path are tested against it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels._backend import select_backend
from kernels.cpu_fused import vectorised_cpu_ops


@dataclass
class PagedAttentionMetadata:
    """Where one step's tokens go and what each row attends to (tensors on the cache's device).

    slot_mapping: [N] int64, flat cache slot ``block * block_size + offset`` of each new token.
    query_start: [R + 1] int32, row ``r``'s queries are ``query[query_start[r]:query_start[r + 1]]``.
    context_lens: [R] int32, tokens in row ``r``'s cache once this step's tokens are written.
    block_tables: [R, max_blocks] int32, row ``r``'s physical blocks in order (padding: any valid id).
    query_lens_host / context_lens_host: the same lengths as Python ints, for grids and CPU paths.
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_host: list[int]
    context_lens_host: list[int]
    # per row, how many of its first new tokens are prompt tokens; when given (torch path), each
    # row's prompt part attends on its own, as it would with nothing after it, and every other
    # query alone over exactly its visible keys (the C++ kernel takes every query alone, prompt
    # ones too): a token's output then depends on its context only, not on its row or the batch
    prompt_counts: tuple[int, ...] | None = None
    # per row, its first block when the blocks holding its context are consecutive ids (-1: not):
    # the torch path then reads the keys and values as a view of the cache instead of a gather
    block_runs_host: list[int] | None = None
    # [N] int (int32 or int64, on the cache's device), per query: the last key position it sees
    # (its own position or later; the sliding window still starts from its own position). Keys
    # past a row's context do not exist: a limit beyond it is cut to the row's last key. None:
    # causal, each query sees up to its own position (and no extra work is done).
    visible_until: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host, default=0)

    @staticmethod
    def build(
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> "PagedAttentionMetadata":
        """From per-row block lists, new-token counts and context lengths (after this step).

        One small tensor per field: the reference construction. The engine packs a whole step
        into one host buffer and one copy instead (``server.engine.step_batch``) from
        :func:`host_layout`, with the same values."""
        slots, starts, width = host_layout(block_tables, query_lens, context_lens, block_size)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return PagedAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), width),
            query_lens_host=list(query_lens),
            context_lens_host=list(context_lens),
            block_runs_host=block_runs(block_tables, context_lens, block_size),
        )


def block_runs(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> list[int]:
    """Per row, its first block when the blocks of its first ``context_len`` positions are
    consecutive ids, else -1 (see :attr:`PagedAttentionMetadata.block_runs_host`)."""
    runs = []
    for table, ctx in zip(block_tables, context_lens, strict=True):
        used = -(-ctx // block_size)
        # the ends first: a table that is not one run usually fails there, in O(1)
        consecutive = used > 0 and table[used - 1] - table[0] == used - 1 and _consecutive(table, used)
        runs.append(table[0] if consecutive else -1)
    return runs


def _consecutive(table: list[int], count: int) -> bool:
    return all(table[i + 1] - table[i] == 1 for i in range(count - 1))


def host_layout(
    block_tables: list[list[int]], query_lens: list[int], context_lens: list[int], block_size: int
) -> tuple[list[int], list[int], int]:
    """The metadata's integer arrays as host lists: (slot_mapping [N], query_start [R + 1],
    block-table width; rows of ``block_tables`` are padded with block 0 up to that width)."""
    slots: list[int] = []
    for table, q_len, ctx in zip(block_tables, query_lens, context_lens, strict=True):
        for position in range(ctx - q_len, ctx):
            slots.append(table[position // block_size] * block_size + position % block_size)
    width = max((len(t) for t in block_tables), default=0) or 1
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return slots, starts, width


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[N, kv_heads, head_dim]`` at their flat slots ``[N]``."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slot_mapping] = value.to(v_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [N, heads, head_dim] → [N, heads, head_dim], row by row in float32.

    ``sliding_window``: a query at position p sees keys ``p - sliding_window + 1 .. p``.
    ``sinks`` [heads]: one extra logit per head in the softmax denominator (gpt-oss).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2).
    ``meta.visible_until``: a query sees keys up to ``max(p, visible_until[q])``.
    """
    heads = query.shape[1]
    kv_heads, head_dim = k_cache.shape[-2:]
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    for row in range(meta.num_rows):
        start = int(meta.query_start[row])
        q_len, ctx = meta.query_lens_host[row], meta.context_lens_host[row]
        if q_len == 0:
            continue
        blocks = meta.block_tables[row, : -(-ctx // block_size)].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()  # [ctx, kv, d]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, h, d]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start : start + q_len].float()  # [q, h, d]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(-1, 1)
        k_pos = torch.arange(ctx, device=query.device).view(1, -1)
        last = q_pos
        if meta.visible_until is not None:
            limits = meta.visible_until[start : start + q_len].to(query.device, torch.long).view(-1, 1)
            last = torch.maximum(q_pos, limits)
        visible = k_pos <= last
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(heads, 1, 1).expand(heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


@functools.cache
def _triton_module() -> ModuleType | None:
    """``kernels._paged_attention_triton``, or None when Triton cannot be imported."""
    try:
        from kernels import _paged_attention_triton
    except Exception:  # ImportError, or a broken backend raising at import
        return None
    return _paged_attention_triton


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    use_triton: bool | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """query [N, heads, head_dim] → [N, heads, head_dim] (see the module docstring).

    On CUDA with Triton: one kernel launch (a second merges split keys) whose grid depends only
    on tensor shapes (CUDA-graph capturable; the host lists in ``meta`` are not read). Elsewhere: the batched torch path
    (:func:`paged_attention_torch`). ``use_triton`` follows :func:`kernels.select_backend`
    (``True`` with ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors, for tests).
    ``num_kv_splits`` (Triton only; a power of two): split each row's keys over that many
    programs and merge (flash-decoding); None picks from shapes (small decode-only steps split).
    """
    _check_shapes(query, k_cache, v_cache, meta, sinks)
    if select_backend(query, use_triton) == "triton":
        mod = _triton_module()
        if mod is not None:
            return mod.paged_attention(
                query,
                k_cache,
                v_cache,
                meta.query_start,
                meta.context_lens,
                meta.block_tables,
                scale=scale,
                sliding_window=sliding_window,
                sinks=sinks,
                softcap=softcap,
                num_kv_splits=num_kv_splits,
                visible_until=meta.visible_until,
            )
    return paged_attention_torch(
        query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, sinks=sinks, softcap=softcap
    )


def _check_shapes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    sinks: torch.Tensor | None,
) -> None:
    """Shape agreement between query, caches, sinks and metadata (cheap; no device sync)."""
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "query [N, heads, dim] and caches [blocks, block_size, kv_heads, dim] expected, "
            f"got {tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    heads, head_dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads of dim {head_dim} cannot share {kv_heads} kv heads of dim {k_cache.shape[3]}"
        )
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks must be [{heads}], got {tuple(sinks.shape)}")
    rows = meta.context_lens.shape[0]
    if meta.block_tables.shape[0] != rows or meta.query_start.shape[0] != rows + 1:
        raise ValueError("metadata rows disagree: block_tables [R, B], context_lens [R], query_start [R + 1]")
    if meta.visible_until is not None and meta.visible_until.shape != (query.shape[0],):
        raise ValueError(f"visible_until must be [{query.shape[0]}], got {tuple(meta.visible_until.shape)}")


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The batched torch path (CPU, or a device without Triton); reads ``meta``'s host lists.

    All decode rows (``q_len == 1``) attend together: their blocks gathered and padded to the
    longest of their contexts, one ``F.scaled_dot_product_attention`` call (GQA) with a length
    mask. Short multi-token rows (drafts, jump-forward runs: up to ``SHORT_QUERY`` tokens) attend
    together the same way, their queries padded to the longest, with each row's causal offset
    mask; each longer row (a prefill chunk) is one SDPA call with its own. Sinks ride along as
    an extra key; a softcap (which SDPA cannot apply) takes a masked float32 matmul instead.
    ``meta.visible_until`` widens the multi-token rows' masks (a decode row's limit cannot reach
    past its own position, the last key of its context).
    """
    kernel = _output_kernel(query, k_cache, sinks, softcap)
    if meta.prompt_counts is not None:
        if kernel is not None and meta.visible_until is None:
            return _attend_every_query_alone(kernel, query, k_cache, v_cache, meta, scale, sliding_window)
        return _attend_token_by_token(query, k_cache, v_cache, meta, scale, sliding_window, sinks, softcap)
    if kernel is not None and meta.visible_until is None:
        return _attend_short_rows_alone(kernel, query, k_cache, v_cache, meta, scale, sliding_window)
    decode_rows = [r for r, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    if len(decode_rows) == query.shape[0] == meta.num_rows:  # a decode-only step: no indexing
        return _attend_decode_rows(query, k_cache, v_cache, meta, slice(None), scale, sliding_window, sinks, softcap)
    out = torch.empty_like(query)
    starts = _query_starts(meta)
    if decode_rows:
        tokens = [starts[r] for r in decode_rows]
        out[tokens] = _attend_decode_rows(
            query[tokens], k_cache, v_cache, meta, decode_rows, scale, sliding_window, sinks, softcap
        )
    multi = [r for r, q_len in enumerate(meta.query_lens_host) if q_len > 1]
    short = [r for r in multi if meta.query_lens_host[r] <= SHORT_QUERY]
    if len(short) > 1:
        tokens = [starts[r] + j for r in short for j in range(meta.query_lens_host[r])]
        out[tokens] = _attend_short_rows(query, k_cache, v_cache, meta, short, starts, scale, sliding_window,
                                         sinks, softcap)
        multi = [r for r in multi if r not in set(short)]
    for row in multi:
        begin, q_len = starts[row], meta.query_lens_host[row]
        out[begin : begin + q_len] = _attend_one_row(
            query[begin : begin + q_len], k_cache, v_cache, meta, row, scale, sliding_window, sinks, softcap,
            limits=_limits(meta, begin, q_len),
        )
    return out


def _attend_every_query_alone(kernel: ModuleType, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """A step with ``meta.prompt_counts`` on the kernel's CPU: every query, prompt or output, in
    one kernel call, each over exactly its visible keys. A token's bits depend on its context
    only, so prompt chunking, the prefix cache and drafts change none; the kernel computes a
    row's queries together, which a prompt's one call per cache block (SDPA) could not."""
    out = torch.empty_like(query)
    per_row = _output_queries(meta, sliding_window, (0,) * meta.num_rows)
    if per_row:
        kernel.output_attention(out, query, k_cache, v_cache, _int32(meta.block_tables), _items(per_row), scale)
    return out


def _attend_token_by_token(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """The torch path with ``meta.prompt_counts``: each row's prompt part on its own, one call
    per cache block it covers (the keys after it are not visible to it anyway; a scheduler that
    cuts prompts at block boundaries then makes the same calls however a prompt was chunked),
    then the output queries, each over exactly its visible keys (:func:`_attend_outputs_padded`)."""
    out = torch.empty_like(query)
    starts = _query_starts(meta)
    for row, prompt in enumerate(meta.prompt_counts):
        q_len, ctx = meta.query_lens_host[row], meta.context_lens_host[row]
        begin = starts[row]
        first, done, block = ctx - q_len, 0, k_cache.shape[1]
        while done < prompt:
            # one call per cache block of the prompt: the same calls however it was chunked (not
            # with visible_until: a query inside an image sees keys past its block)
            block_end = ((first + done) // block + 1) * block - first
            end = prompt if meta.visible_until is not None else min(prompt, block_end)
            out[begin + done : begin + end] = _attend_one_row(query[begin + done : begin + end], k_cache, v_cache,
                                                              meta, row, scale, sliding_window, sinks, softcap,
                                                              ctx=first + end, limits=_limits(meta, begin + done,
                                                                                              end - done))
            done = end
    per_row = _output_queries(meta, sliding_window)
    if per_row:
        kernel = _output_kernel(query, k_cache, sinks, softcap)
        if kernel is not None:
            kernel.output_attention(out, query, k_cache, v_cache, _int32(meta.block_tables), _items(per_row), scale)
        elif sinks is None and not softcap:
            _attend_outputs_padded(out, query, k_cache, v_cache, meta, per_row, scale)
        else:
            _attend_outputs_alone(out, query, k_cache, v_cache, meta, per_row, scale, sinks, softcap)
    return out


OutputQuery = tuple[int, int, int, int]  # (row, token, first visible key, keys seen)


def _output_queries(meta: PagedAttentionMetadata, sliding_window: int | None,
                    prompt_counts: tuple[int, ...] | None = None) -> dict[int, list[OutputQuery]]:
    """The output queries (past each row's prompt part: ``meta.prompt_counts`` unless given), by
    row. The same in every layer of a step: worked out once per metadata (the last one is kept,
    per thread)."""
    last = getattr(_workspace, "outputs", None)
    if last is not None and last[0] is meta and last[1] == (sliding_window, prompt_counts):
        return last[2]
    starts = _query_starts(meta)
    per_row: dict[int, list[OutputQuery]] = {}
    for row, prompt in enumerate(meta.prompt_counts if prompt_counts is None else prompt_counts):
        q_len, ctx, begin = meta.query_lens_host[row], meta.context_lens_host[row], starts[row]
        for j in range(prompt, q_len):
            seen = ctx - q_len + 1 + j
            low = max(0, seen - sliding_window) if sliding_window is not None else 0
            if meta.visible_until is not None:  # a later limit (read back: this path is the CPU's)
                seen = min(ctx, max(seen, int(meta.visible_until[begin + j]) + 1))
            per_row.setdefault(row, []).append((row, begin + j, low, seen))
    _workspace.outputs = (meta, (sliding_window, prompt_counts), per_row)
    return per_row


def _output_kernel(query: torch.Tensor, k_cache: torch.Tensor, sinks: torch.Tensor | None,
                   softcap: float | None) -> ModuleType | None:
    """The C++ kernel that attends output queries one by one where they lie in the cache
    (``kernels/csrc/cpu_attention.cpp``: float32 on an AVX-512 CPU, no sinks or softcap), or None."""
    if (sinks is not None or softcap or not query.is_cpu or query.dtype != torch.float32
            or k_cache.dtype != torch.float32 or query.shape[2] % 16 or query.stride(2) != 1):
        return None
    return vectorised_cpu_ops()


def _items(per_row: dict[int, list[OutputQuery]]) -> torch.Tensor:
    """``per_row``'s queries as the kernel's int64 [Q, 4] (row, token, low, seen), once per step."""
    last = getattr(_workspace, "items", None)
    if last is not None and last[0] is per_row:
        return last[1]
    items = torch.tensor([item for queries in per_row.values() for item in queries], dtype=torch.int64)
    _workspace.items = (per_row, items)
    return items


def _int32(tables: torch.Tensor) -> torch.Tensor:
    return tables if tables.dtype == torch.int32 and tables.stride(-1) == 1 else tables.to(torch.int32).contiguous()


def _attend_short_rows_alone(kernel: ModuleType, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: PagedAttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """A step without prompt counts on the kernel's CPU: every query of a row of up to
    ``SHORT_QUERY`` tokens (decode rows, drafts, forced runs) attends alone, as the same token
    would in a step with prompt counts; a longer row (a prompt chunk) is one SDPA call."""
    out = torch.empty_like(query)
    long_rows = tuple(q_len if q_len > SHORT_QUERY else 0 for q_len in meta.query_lens_host)
    per_row = _output_queries(meta, sliding_window, long_rows)
    if per_row:
        kernel.output_attention(out, query, k_cache, v_cache, _int32(meta.block_tables), _items(per_row), scale)
    starts = _query_starts(meta)
    for row, q_len in enumerate(long_rows):
        if q_len:
            begin = starts[row]
            out[begin : begin + q_len] = _attend_one_row(query[begin : begin + q_len], k_cache, v_cache, meta, row,
                                                         scale, sliding_window, None, None)
    return out


def _attend_outputs_padded(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, per_row: dict[int, list[OutputQuery]],
                           scale: float) -> None:
    """Output queries ``(row, token, low, seen)`` by row, each a single query over its row's cache
    blocks (padded to whole blocks) with a mask of keys ``low .. seen - 1``, batched: SDPA
    computes a single query the same whatever the block-multiple padding and the other queries
    of the call (tested: ``tests/kernels/test_paged_attention_token_by_token.py``), so a token's
    output still depends on its context only. Rows read one by one make one call per output
    query (their blocks a view of the cache when consecutive); rows gathered together
    (:func:`_gather_rows_together`) make one call for the first output query of every row, then
    one per further output query (drafts, forced runs)."""
    block = k_cache.shape[1]
    widths = {row: -(-meta.context_lens_host[row] // block) * block for row in per_row}
    if not _gather_rows_together(meta, widths):
        for row, items in per_row.items():
            width = widths[row]
            keys = _gather_kv(k_cache, meta, row, width, "k").unsqueeze(0)  # [1, W, kv, d], a view
            values = _gather_kv(v_cache, meta, row, width, "v").unsqueeze(0)
            for item in items:  # one call each: an expanded batch of the row's keys is copied, and slower
                _attend_group(out, query, keys, values, [item], scale)
        return
    rows = list(per_row)
    width = max(widths.values())
    keys = _gather_kv(k_cache, meta, rows, width, "k")  # [R, W, kv, d]
    values = _gather_kv(v_cache, meta, rows, width, "v")
    groups = list(per_row.values())
    for rank in range(max(map(len, groups))):  # the n-th output query of each row (drafts, forced runs)
        having = [i for i, items in enumerate(groups) if rank < len(items)]
        idle = len(groups) - len(having)
        if rank == 0 or (len(having) > 1 and idle * width <= KEYS_PER_CALL * (len(having) - 1)):
            # together; a row without an n-th query repeats its first (its result is not kept)
            picked = [items[rank] if rank < len(items) else items[0] for items in groups]
            _attend_group(out, query, keys, values, picked, scale, keep=having if idle else None)
        else:
            for i in having:
                _attend_group(out, query, keys[i : i + 1], values[i : i + 1], [groups[i][rank]], scale)


def _gather_rows_together(meta: PagedAttentionMetadata, widths: dict[int, int]) -> bool:
    """Whether the rows' blocks are gathered into one tensor padded to the longest (one call for
    their first output queries) rather than read row by row (a call per row): not when every
    row's blocks are consecutive (each is then a view of the cache, nothing to copy), nor when the
    padding would copy more keys than the calls it saves are worth (on the CPU a gathered key
    costs ~0.15 µs a layer, an SDPA call ~30 µs: :data:`KEYS_PER_CALL`)."""
    runs = meta.block_runs_host
    if len(widths) == 1 or (runs is not None and all(runs[row] >= 0 for row in widths)):
        return False
    padding = len(widths) * max(widths.values()) - sum(widths.values())
    return padding <= KEYS_PER_CALL * (len(widths) - 1)


def _attend_group(out: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  picked: list[OutputQuery], scale: float, keep: list[int] | None = None) -> None:
    """One SDPA call: ``picked[i]``'s query over ``keys[i]`` / ``values[i]`` [n, W, kv, d] masked
    to its keys, written to ``out`` (only at the indices ``keep``, when given)."""
    visible = _key_mask(tuple((low, seen) for _, _, low, seen in picked), keys.shape[1], query.device)
    tokens = [token for _, token, _, _ in picked]
    if tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        q = query[tokens[0] : tokens[0] + len(tokens)].unsqueeze(1)  # [n, 1, h, d], a view
    else:
        q = query[tokens].unsqueeze(1)
    result = _attend(q, keys, values, visible, scale, None, None).squeeze(1)
    if keep is not None:
        result, picked = result[keep], [picked[i] for i in keep]
    out[[token for _, token, _, _ in picked]] = result


@functools.lru_cache(maxsize=64)
def _key_mask(bounds: tuple[tuple[int, int], ...], width: int, device: torch.device) -> torch.Tensor:
    """[n, 1, width] bool: query i sees keys ``bounds[i][0] .. bounds[i][1] - 1``. The same for
    every layer of a step, so made once per step (never written to)."""
    k_pos = torch.arange(width, device=device).view(1, -1)
    limits = torch.tensor(bounds, device=device)
    return ((k_pos >= limits[:, :1]) & (k_pos < limits[:, 1:])).view(len(bounds), 1, width)


def _attend_outputs_alone(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: PagedAttentionMetadata, per_row: dict[int, list[OutputQuery]], scale: float,
                          sinks: torch.Tensor | None, softcap: float | None) -> None:
    """Output queries one call each over exactly their visible keys (sinks and softcaps, whose
    extra key or float path would not keep a padded call's result the same)."""
    for row, items in per_row.items():
        ctx = meta.context_lens_host[row]
        keys = _gather_kv(k_cache, meta, row, ctx, "k")  # [ctx, kv, d]
        values = _gather_kv(v_cache, meta, row, ctx, "v")
        for _, token, low, seen in items:
            q = query[token].view(1, 1, *query.shape[1:])
            out[token] = _attend(q, keys[None, low:seen], values[None, low:seen], None, scale, sinks, softcap)[0, 0]


def _limits(meta: PagedAttentionMetadata, begin: int, count: int) -> torch.Tensor | None:
    """The ``visible_until`` of queries ``begin .. begin + count``, or None (causal)."""
    return None if meta.visible_until is None else meta.visible_until[begin : begin + count]


def _query_starts(meta: PagedAttentionMetadata) -> list[int]:
    """Row start offsets into the query from the host lengths (no device read)."""
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    return starts


KEYS_PER_CALL = 200  # on the CPU an SDPA call's overhead is worth ~200 keys gathered or attended in vain
SHORT_QUERY = 64  # multi-token rows up to this long (drafts, forced runs) attend together in one call
_WORKSPACE_MAX_BYTES = 64 << 20  # gathers up to this size reuse one buffer per thread
_workspace = threading.local()


def _gather_buffer(slot: str, numel: int, like: torch.Tensor) -> torch.Tensor | None:
    """A reusable [numel] buffer for gathered keys or values (``slot`` "k"/"v"), or None when
    the gather is too large to keep. Reusing it spares the CPU the page faults of a fresh large
    allocation on every layer of every step (several times the copy itself)."""
    if numel * like.element_size() > _WORKSPACE_MAX_BYTES:
        return None
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    key = (slot, like.device, like.dtype)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor, even when made under inference mode: the same thread may gather outside it later
        with torch.inference_mode(False):
            buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _gather_kv(
    cache: torch.Tensor, meta: PagedAttentionMetadata, rows: list[int] | slice | int, length: int, slot: str
) -> torch.Tensor:
    """The first ``length`` cached positions of ``rows``: [rows, length, kv, d] (or one row).

    One row whose blocks are consecutive (:attr:`PagedAttentionMetadata.block_runs_host`) is a
    view of the cache, no copy. Otherwise ``index_select`` of whole flattened blocks (several
    times faster on the CPU than advanced indexing of the 4-d cache) into a per-thread buffer
    that lives until the next gather of the same ``slot``: use the result before gathering again.
    """
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    width = -(-length // block_size)
    run = _block_run(meta, rows)
    if run is not None:
        view = cache[run : run + width].view(width * block_size, kv_heads, head_dim)[:length]
        return view if isinstance(rows, int) else view.unsqueeze(0)
    blocks = meta.block_tables[rows, :width]
    flat = cache.view(num_blocks, -1)
    ids = blocks.reshape(-1).long()
    buf = _gather_buffer(slot, ids.numel() * flat.shape[1], cache)
    if buf is None:
        gathered = flat.index_select(0, ids)
    else:
        gathered = torch.index_select(flat, 0, ids, out=buf.view(ids.numel(), flat.shape[1]))
    return gathered.view(*blocks.shape[:-1], width * block_size, kv_heads, head_dim)[..., :length, :, :]


def _block_run(meta: PagedAttentionMetadata, rows: list[int] | slice | int) -> int | None:
    """The first block of the one row in ``rows`` when its blocks are consecutive, else None."""
    runs = meta.block_runs_host
    if runs is None:
        return None
    if isinstance(rows, int):
        row = rows
    elif isinstance(rows, slice):
        if len(runs) != 1 or rows != slice(None):
            return None
        row = 0
    elif len(rows) == 1:
        row = rows[0]
    else:
        return None
    return runs[row] if runs[row] >= 0 else None


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, q, h, d] over keys/values [B, k, kv, d] → [B, q, h, d] in q's dtype.

    ``visible`` [B, q, k]; None: every key, or plain causal (q == k) with ``causal``. SDPA does
    the work unless a softcap is asked for; a sink rides along as one extra key of zeros whose
    additive mask is the sink logit, so it joins the softmax denominator and adds nothing to the
    output.
    """
    if softcap:
        return _softcapped_attention(q, keys, values, visible, scale, sinks, softcap, causal)
    batch, q_len, heads, _ = q.shape
    keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)  # [B, kv, k, d]
    mask = None if visible is None else visible.unsqueeze(1)  # [B, 1, q, k]
    if sinks is not None:
        if mask is None:
            mask = _default_visible(batch, q_len, keys.shape[2], causal, q.device).unsqueeze(1)
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        mask = torch.cat([mask.expand(batch, heads, q_len, -1), sink], dim=-1)
        keys = F.pad(keys, (0, 0, 0, 1))
        values = F.pad(values, (0, 0, 0, 1))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def _default_visible(batch: int, q_len: int, k_len: int, causal: bool, device: torch.device) -> torch.Tensor:
    """[B, q, k] bool: lower-triangular when ``causal`` (q == k), else all True."""
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return (visible.tril() if causal else visible).expand(batch, q_len, k_len)


def _softcapped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float,
    causal: bool,
) -> torch.Tensor:
    """:func:`_attend` with ``softcap * tanh(scores / softcap)``: a batched masked matmul in float32."""
    batch, q_len, heads, head_dim = q.shape
    kv_heads, k_len = keys.shape[2], keys.shape[1]
    group = heads // kv_heads
    if visible is None:
        visible = _default_visible(batch, q_len, k_len, causal, q.device)
    qg = q.float().view(batch, q_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, kv, g, q, d]
    kt = keys.float().permute(0, 2, 3, 1).unsqueeze(2)  # [B, kv, 1, d, k]
    vt = values.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, kv, 1, k, d]
    scores = softcap * torch.tanh(torch.matmul(qg, kt) * (scale / softcap))  # [B, kv, g, q, k]
    scores = scores.masked_fill(~visible.view(batch, 1, 1, q_len, k_len), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(batch, kv_heads, group, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
        vt = F.pad(vt, (0, 0, 0, 1))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vt)  # [B, kv, g, q, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim).to(q.dtype)


def _attend_decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    rows: list[int] | slice,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """One query token per row, [D, h, d]: all rows in one call padded to the longest context."""
    ctx_host = meta.context_lens_host[rows] if isinstance(rows, slice) else [meta.context_lens_host[r] for r in rows]
    longest = max(ctx_host)
    keys = _gather_kv(k_cache, meta, rows, longest, "k")  # [D, L, kv, d]
    values = _gather_kv(v_cache, meta, rows, longest, "v")
    visible = None  # every row sees all `longest` keys
    if sliding_window is not None or min(ctx_host) < longest:
        ctx = torch.tensor(ctx_host, device=q.device).view(-1, 1)
        k_pos = torch.arange(longest, device=q.device).view(1, -1)
        visible = k_pos < ctx  # the query sits at ctx - 1
        if sliding_window is not None:
            visible &= k_pos >= ctx - sliding_window
        visible = visible.unsqueeze(1)
    return _attend(q.unsqueeze(1), keys, values, visible, scale, sinks, softcap).squeeze(1)


def _attend_short_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    rows: list[int],
    starts: list[int],
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Several multi-token rows in one call: [sum of their q_len, h, d], rows in order. Queries
    are padded to the longest row and keys to the longest context; the padding queries' outputs
    are dropped (each sees at least key 0, so nothing is NaN)."""
    q_lens = [meta.query_lens_host[r] for r in rows]
    contexts = [meta.context_lens_host[r] for r in rows]
    width, longest = max(q_lens), max(contexts)
    heads_dims = query.shape[1:]
    padded = [i * width + j for i, q_len in enumerate(q_lens) for j in range(q_len)]
    tokens = [starts[r] + j for r, q_len in zip(rows, q_lens) for j in range(q_len)]
    q = query.new_zeros((len(rows) * width, *heads_dims))
    q[padded] = query[tokens]
    keys = _gather_kv(k_cache, meta, rows, longest, "k")  # [B, L, kv, d]
    values = _gather_kv(v_cache, meta, rows, longest, "v")
    first = torch.tensor([c - n for c, n in zip(contexts, q_lens)], device=query.device).view(-1, 1, 1)
    q_pos = first + torch.arange(width, device=query.device).view(1, -1, 1)  # [B, W, 1]
    k_pos = torch.arange(longest, device=query.device).view(1, 1, -1)
    last = q_pos
    if meta.visible_until is not None:
        limits = torch.full((len(rows) * width,), -1, dtype=torch.long, device=query.device)
        limits[padded] = meta.visible_until[tokens].to(query.device, torch.long)
        last_key = torch.tensor(contexts, device=query.device).view(-1, 1, 1) - 1  # not the padding keys
        last = torch.minimum(torch.maximum(q_pos, limits.view(len(rows), width, 1)), last_key)
    visible = k_pos <= last
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    out = _attend(q.view(len(rows), width, *heads_dims), keys, values, visible, scale, sinks, softcap)
    return out.reshape(-1, *heads_dims)[padded]


def _attend_one_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    row: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    ctx: int | None = None,
    limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """A multi-token row [q, h, d] over its context (plain causal when it is a whole prefill);
    ``ctx``: the context its last query sees, when the row goes on beyond these queries;
    ``limits`` [q]: the queries' ``visible_until`` (None: causal)."""
    q_len, ctx = q.shape[0], ctx if ctx is not None else meta.context_lens_host[row]
    keys = _gather_kv(k_cache, meta, row, ctx, "k").unsqueeze(0)  # [1, ctx, kv, d]
    values = _gather_kv(v_cache, meta, row, ctx, "v").unsqueeze(0)
    visible = None
    if sliding_window is not None or q_len != ctx or limits is not None:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).view(-1, 1)
        k_pos = torch.arange(ctx, device=q.device).view(1, -1)
        last = q_pos if limits is None else torch.maximum(q_pos, limits.to(q.device, torch.long).view(-1, 1))
        visible = k_pos <= last
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        visible = visible.unsqueeze(0)
    return _attend(q.unsqueeze(0), keys, values, visible, scale, sinks, softcap, causal=True).squeeze(0)
