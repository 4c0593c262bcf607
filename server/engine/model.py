"""Model runner: a Llama-family forward over a slot-based KV cache.

transformers loads the weights (safetensors or GGUF, any rope scaling it knows), and this module
runs the layers itself so that every sequence of a batch can sit at its own position: the cache
keeps one slot per running sequence, slots ``0..n-1`` are always the live ones (a finished
sequence's slot is refilled by moving the last one). One step is one forward over all rows' new
tokens flattened (one token for decoding rows, several for prefill chunks and jump-forward
continuations), so the weights are read once per step; single-token rows attend together over a
plain view of the first ``n`` slots with a per-slot length mask, multi-token rows attend causally
over their own slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from server.engine.lora import LoraBank, LoraGroups, add_lora

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(RuntimeError):
    """The model's architecture is not one the runner implements."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` means float32 on the CPU (fast and exact there) and bfloat16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_hf_model(directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load a causal LM with transformers and check that its architecture is supported."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type '{config.model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.to(device).eval()


@dataclass
class StepBatch:
    """One engine step flattened: every row's new tokens back to back.

    tokens / positions / token_slots: [N] per token. last_index: the token indices where logits
    are taken: each row's last token, or its last ``logit_counts[i]`` tokens for rows that ask
    for per-position logits (draft verification, choice scoring). Single-token rows are attended together (decode_index: their
    token indices, decode_slots: their slots, slot_positions: [n_slots] each slot's decode
    position, 0 for slots not decoding); multi-token rows are listed in ``extends`` as
    (slot, first token index, end token index, start position).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    last_index: torch.Tensor
    n_slots: int
    max_len: int
    decode_index: torch.Tensor | None
    decode_slots: torch.Tensor | None
    slot_positions: torch.Tensor | None
    dense_decode: bool
    extends: list[tuple[int, int, int, int]]
    logit_counts: list[int] | None = None  # None: one logits row per batch row
    lora: LoraGroups | None = None  # tokens grouped by LoRA adapter; None = all on the base model

    @property
    def all_single(self) -> bool:
        """Every row feeds exactly one token (so row i's last token is token i)."""
        return not self.extends

    @staticmethod
    def build(
        rows: list[tuple[int, list[int], int]],
        n_slots: int,
        device: torch.device,
        logit_counts: list[int] | None = None,
        row_adapters: list[int] | None = None,
    ) -> "StepBatch":
        """``rows``: (slot, new tokens, tokens already cached) per row, in output order.

        ``logit_counts`` (optional, per row, 1 <= count <= the row's new tokens): how many of the
        row's last positions get logits; the forward then returns ``sum(logit_counts)`` rows,
        row by row, positions in order. ``row_adapters``: each row's LoRA adapter id (0 = base
        model), None = all base."""
        tokens: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        last_index: list[int] = []
        decode_index: list[int] = []
        decode_slots: list[int] = []
        slot_positions = [0] * n_slots
        extends: list[tuple[int, int, int, int]] = []
        for row, (slot, new, start) in enumerate(rows):
            first = len(tokens)
            tokens.extend(new)
            positions.extend(range(start, start + len(new)))
            token_slots.extend([slot] * len(new))
            count = 1 if logit_counts is None else logit_counts[row]
            last_index.extend(range(len(tokens) - count, len(tokens)))
            if len(new) == 1:
                decode_index.append(first)
                decode_slots.append(slot)
                slot_positions[slot] = start
            else:
                extends.append((slot, first, len(tokens), start))
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        has_decode = bool(decode_index)
        return StepBatch(
            tokens=as_long(tokens),
            positions=as_long(positions),
            token_slots=as_long(token_slots),
            last_index=as_long(last_index),
            n_slots=n_slots,
            max_len=max(slot_positions) + 1,
            decode_index=as_long(decode_index) if has_decode else None,
            decode_slots=as_long(decode_slots) if has_decode else None,
            slot_positions=as_long(slot_positions) if has_decode else None,
            dense_decode=decode_slots == list(range(n_slots)) and decode_index == list(range(n_slots)),
            extends=extends,
            logit_counts=logit_counts,
            lora=_lora_groups(rows, row_adapters, device),
        )


def _lora_groups(rows, row_adapters: list[int] | None, device: torch.device) -> LoraGroups | None:
    if not row_adapters or not any(row_adapters):
        return None
    per_token = [adapter for (_, new, _), adapter in zip(rows, row_adapters, strict=True) for _ in new]
    return LoraGroups.build(per_token, device)


class KVCache:
    """Per-layer key/value tensors ``[slots, kv_heads, max_len, head_dim]``."""

    def __init__(self, shape: ModelShape, max_slots: int, max_len: int, dtype, device) -> None:
        size = (shape.num_layers, max_slots, shape.num_kv_heads, max_len, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_len = max_len

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class ModelRunner:
    """Runs decode steps and extensions of a Llama-family model over a :class:`KVCache`."""

    def __init__(self, hf_model: nn.Module, max_slots: int, max_len: int, lora: LoraBank | None = None) -> None:
        self.hf = hf_model
        self.lora = lora
        self.last_hidden: torch.Tensor | None = None  # [R, D] final-norm hidden states of the last forward
        config = hf_model.config
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.shape = ModelShape(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=hf_model.get_output_embeddings().weight.shape[0],
            max_position=getattr(config, "max_position_embeddings", max_len),
        )
        self.max_len = max_len
        self.cache = KVCache(self.shape, max_slots, max_len, self.dtype, self.device)
        self._inner = hf_model.model
        self._scale = 1.0 / math.sqrt(head_dim)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run every row's new tokens through the model in one pass; returns logits [R, V] at
        each row's last token (or [sum(logit_counts), V], see :meth:`StepBatch.build`). The
        weights are read once per step however many rows extend."""
        hidden = self._inner.embed_tokens(batch.tokens.view(1, -1))  # [1, N, D]
        cos, sin = self._inner.rotary_emb(hidden, batch.positions.view(1, -1))
        decode_bias = self._decode_bias(batch) if batch.decode_index is not None else None
        for index, layer in enumerate(self._inner.layers):
            hidden = self._layer(layer, index, hidden, cos, sin, batch, decode_bias)
        last = hidden[0] if batch.all_single else hidden[0, batch.last_index]
        return self._logits(last)

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of slots ``0..n-1`` at positions ``lengths``; logits [n, V]."""
        rows = [(slot, [int(t)], int(p)) for slot, (t, p) in enumerate(zip(tokens, lengths))]
        return self.forward(StepBatch.build(rows, len(rows), self.device))

    def extend(self, slot: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Append ``tokens`` [T] to ``slot`` whose cache holds ``start`` tokens; logits [V]."""
        batch = StepBatch.build([(slot, tokens.tolist(), start)], slot + 1, self.device)
        return self.forward(batch)[0]

    def _decode_bias(self, batch: StepBatch) -> torch.Tensor:
        """Additive mask [n_slots, 1, 1, L]: slot i sees positions <= its decode position."""
        limit = batch.slot_positions.view(-1, 1)  # [n_slots, 1]
        visible = torch.arange(batch.max_len, device=self.device).view(1, -1) <= limit
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~visible, float("-inf"))
        return bias.view(batch.n_slots, 1, 1, batch.max_len)

    def _layer(self, layer, index, hidden, cos, sin, batch: StepBatch, decode_bias):
        residual = hidden
        q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin, index, batch.lora)  # [1, h, N, d]
        k_cache, v_cache = self.cache.k[index], self.cache.v[index]
        k_cache[batch.token_slots, :, batch.positions] = k[0].transpose(0, 1)  # [N, kv, d]
        v_cache[batch.token_slots, :, batch.positions] = v[0].transpose(0, 1)
        q = q[0].transpose(0, 1)  # [N, h, d]
        out = torch.empty_like(q)
        if batch.dense_decode:  # decode tokens are the first n_slots, in slot order
            out[: batch.n_slots] = self._decode_attention(q, batch, decode_bias, k_cache, v_cache)
        elif batch.decode_index is not None:
            out[batch.decode_index] = self._decode_attention(q, batch, decode_bias, k_cache, v_cache)
        for slot, first, last, start in batch.extends:
            out[first:last] = self._extend_attention(q[first:last], slot, start, k_cache, v_cache)
        out = out.reshape(1, -1, self.shape.num_heads * self.shape.head_dim)
        hidden = residual + self._proj(layer.self_attn.o_proj, out, index, "o_proj", batch.lora)
        normed = layer.post_attention_layernorm(hidden)
        if batch.lora is None:
            return hidden + layer.mlp(normed)
        return hidden + self._lora_mlp(layer.mlp, normed, index, batch.lora)

    def _proj(self, linear: nn.Linear, x: torch.Tensor, index: int, module: str, lora: LoraGroups | None) -> torch.Tensor:
        """``linear(x)`` plus each row group's LoRA delta for ``module`` of layer ``index``; x [1, N, in]."""
        out = linear(x)
        if lora is not None:
            add_lora(out[0], x[0], self.lora, lora, index, module)
        return out

    def _lora_mlp(self, mlp, x: torch.Tensor, index: int, lora: LoraGroups) -> torch.Tensor:
        """The gated MLP (``down(act(gate(x)) * up(x))``) with LoRA deltas on its projections."""
        gate = self._proj(mlp.gate_proj, x, index, "gate_proj", lora)
        up = self._proj(mlp.up_proj, x, index, "up_proj", lora)
        return self._proj(mlp.down_proj, mlp.act_fn(gate) * up, index, "down_proj", lora)

    def _decode_attention(self, q, batch: StepBatch, bias, k_cache, v_cache) -> torch.Tensor:
        """Single-token rows, attended together over slots ``0..n_slots-1``; returns [Rd, h, d]."""
        n, kv, d = batch.n_slots, self.shape.num_kv_heads, self.shape.head_dim
        groups = self.shape.num_heads // kv
        if batch.dense_decode:
            queries = q[:n]
        else:  # some slots extend this step: their query rows are placeholders, results dropped
            queries = q.new_zeros((n, self.shape.num_heads, d))
            queries[batch.decode_slots] = q[batch.decode_index]
        keys = k_cache[:n, :, : batch.max_len]  # [n, kv, L, d]
        values = v_cache[:n, :, : batch.max_len]
        queries = queries.view(n, kv, groups, d)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * self._scale + bias  # [n, kv, g, L]
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).view(n, self.shape.num_heads, d)
        return out if batch.dense_decode else out[batch.decode_slots]

    def _extend_attention(self, q, slot: int, start: int, k_cache, v_cache) -> torch.Tensor:
        """Causal attention of T new tokens of one slot over its cache; q [T, h, d] → [T, h, d]."""
        length = q.shape[0]
        end = start + length
        query = q.transpose(0, 1).unsqueeze(0)  # [1, h, T, d]
        keys = k_cache[slot : slot + 1, :, :end]
        values = v_cache[slot : slot + 1, :, :end]
        if start == 0:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            query_pos = torch.arange(start, end, device=self.device).view(-1, 1)
            mask = torch.arange(end, device=self.device).view(1, -1) <= query_pos  # [T, end]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _qkv(self, attn, x, cos, sin, index: int, lora: LoraGroups | None):
        """Project, (qk-norm for Qwen3), apply rotary embeddings. Returns q, k, v as [b, h, T, d]."""
        b, t, _ = x.shape
        d = self.shape.head_dim
        q = self._proj(attn.q_proj, x, index, "q_proj", lora).view(b, t, self.shape.num_heads, d)
        k = self._proj(attn.k_proj, x, index, "k_proj", lora).view(b, t, self.shape.num_kv_heads, d)
        v = self._proj(attn.v_proj, x, index, "v_proj", lora).view(b, t, self.shape.num_kv_heads, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, T, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[R, D] → [R, V] float32; keeps the final-norm hidden states in :attr:`last_hidden`."""
        self.last_hidden = self._inner.norm(last_hidden)
        return self.hf.lm_head(self.last_hidden).float()

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move_slot(src, dst, length)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
