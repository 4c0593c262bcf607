"""A minimal paged Llama runner for tests: transformers' layers, Trellis's paged KV and attention.

It implements the runner interface the engine and :class:`GraphedRunner` use (``forward(batch)``
→ float32 logits [R, V], ``device``, ``dtype``, ``vocab_size``, ``block_size``, ``kv``,
``last_hidden``). ``attention="reference"`` uses :func:`kernels.paged_attention.paged_attention`;
``attention="dense_decode"`` runs decode-only batches through a torch attention that reads
lengths only from tensors (no host sync), so a CUDA graph can capture it (other batches still
use the reference).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv
from server.engine.kv_cache import KVShape, PagedKVCache
from server.engine.step_batch import StepBatch


class PagedLlama:
    def __init__(self, hf_model, num_blocks: int, block_size: int, attention: str = "reference") -> None:
        config = hf_model.config
        self.hf = hf_model
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.block_size = block_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv = PagedKVCache(KVShape(config.num_hidden_layers, self.num_kv_heads, self.head_dim),
                               num_blocks, block_size, self.dtype, self.device)
        self.attention = attention
        self.last_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        inner = self.hf.model
        hidden = inner.embed_tokens(batch.tokens.view(1, -1))  # [1, N, D]
        cos, sin = inner.rotary_emb(hidden, batch.positions.view(1, -1))
        for index, layer in enumerate(inner.layers):
            hidden = hidden + self._attend(layer, index, layer.input_layernorm(hidden), cos, sin, batch.attn)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[0] if batch.logit_counts is None and batch.all_single else hidden[0, batch.last_index]
        self.last_hidden = inner.norm(last)
        return self.hf.lm_head(self.last_hidden).float()

    def _attend(self, layer, index: int, x: torch.Tensor, cos, sin, meta: PagedAttentionMetadata) -> torch.Tensor:
        attn, tokens = layer.self_attn, x.shape[1]
        q = attn.q_proj(x).view(1, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache, v_cache = self.kv.k[index], self.kv.v[index]
        write_kv(k_cache, v_cache, k[0].transpose(0, 1), v[0], meta.slot_mapping)
        query = q[0].transpose(0, 1)  # [N, h, d]
        scale = self.head_dim**-0.5
        if self.attention == "dense_decode" and meta.max_query_len <= 1:
            out = dense_decode_attention(query, k_cache, v_cache, meta, scale)
        else:
            out = paged_attention(query, k_cache, v_cache, meta, scale=scale)
        return attn.o_proj(out.reshape(1, tokens, self.num_heads * self.head_dim))


def dense_decode_attention(query, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """One query per row over its blocks, lengths from ``meta.context_lens`` (tensor only)."""
    rows, width = meta.block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    groups = query.shape[1] // kv_heads
    blocks = meta.block_tables.long()
    keys = k_cache[blocks].view(rows, width * block_size, kv_heads, head_dim).float()
    values = v_cache[blocks].view(rows, width * block_size, kv_heads, head_dim).float()
    q = query.float().view(rows, kv_heads, groups, head_dim)
    scores = torch.einsum("rkgd,rlkd->rkgl", q, keys) * scale
    visible = torch.arange(width * block_size, device=query.device).view(1, -1) < meta.context_lens.view(-1, 1)
    scores = scores.masked_fill(~visible.view(rows, 1, 1, -1), float("-inf"))
    out = torch.einsum("rkgl,rlkd->rkgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(rows, kv_heads * groups, head_dim).to(query.dtype)
