"""Model runner: a Llama-family forward over a slot-based KV cache.

transformers loads the weights (safetensors or GGUF, any rope scaling it knows), and this module
runs the layers itself so that every sequence of a batch can sit at its own position: the cache
keeps one slot per running sequence, slots ``0..n-1`` are always the live ones (a finished
sequence's slot is refilled by moving the last one), and a decode step attends over a plain view
of the first ``n`` slots with a per-row length mask. Extending one sequence by several tokens
(prefill, jump-forward) is a separate causal forward into its slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

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

    def __init__(self, hf_model: nn.Module, max_slots: int, max_len: int) -> None:
        self.hf = hf_model
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
    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of the first ``n`` slots.

        tokens: [n] next input token per slot; lengths: [n] tokens already cached per slot (the new
        token goes to position ``lengths[i]``). Returns logits [n, V].
        """
        n = tokens.shape[0]
        positions = lengths.view(n, 1)  # [n, 1]
        hidden = self._inner.embed_tokens(tokens.view(n, 1))  # [n, 1, D]
        cos, sin = self._inner.rotary_emb(hidden, positions)
        max_len = int(lengths.max()) + 1
        visible = torch.arange(max_len, device=self.device).view(1, max_len) <= positions  # [n, L]
        attn_bias = torch.zeros(visible.shape, dtype=hidden.dtype, device=self.device)
        attn_bias.masked_fill_(~visible, float("-inf"))
        attn_bias = attn_bias.view(n, 1, 1, max_len)
        rows = torch.arange(n, device=self.device)
        for index, layer in enumerate(self._inner.layers):
            hidden = self._decode_layer(layer, index, hidden, cos, sin, rows, lengths, attn_bias, max_len)
        return self._logits(hidden[:, -1])

    def _decode_layer(self, layer, index, hidden, cos, sin, rows, lengths, attn_bias, max_len):
        n = hidden.shape[0]
        residual = hidden
        q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin)  # [n, h, 1, d]
        k_cache, v_cache = self.cache.k[index], self.cache.v[index]
        k_cache[rows, :, lengths] = k[:, :, 0]
        v_cache[rows, :, lengths] = v[:, :, 0]
        keys = k_cache[:n, :, :max_len]  # [n, kv, L, d]
        values = v_cache[:n, :, :max_len]
        groups = self.shape.num_heads // self.shape.num_kv_heads
        q = q.view(n, self.shape.num_kv_heads, groups, self.shape.head_dim)  # [n, kv, g, d]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self._scale + attn_bias  # [n, kv, g, L]
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [n, kv, g, d]
        out = out.reshape(n, 1, self.shape.num_heads * self.shape.head_dim)
        hidden = residual + layer.self_attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def extend(self, slot: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Append ``tokens`` [T] to slot ``slot`` whose cache holds ``start`` tokens.

        Returns the logits [V] after the last appended token.
        """
        length = tokens.shape[0]
        positions = torch.arange(start, start + length, device=self.device).view(1, length)
        hidden = self._inner.embed_tokens(tokens.view(1, length))  # [1, T, D]
        cos, sin = self._inner.rotary_emb(hidden, positions)
        end = start + length
        for index, layer in enumerate(self._inner.layers):
            hidden = self._extend_layer(layer, index, hidden, cos, sin, slot, start, end)
        return self._logits(hidden[:, -1])[0]

    def _extend_layer(self, layer, index, hidden, cos, sin, slot, start, end):
        residual = hidden
        q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin)  # [1, h, T, d]
        k_cache, v_cache = self.cache.k[index], self.cache.v[index]
        k_cache[slot, :, start:end] = k[0]
        v_cache[slot, :, start:end] = v[0]
        keys = k_cache[slot : slot + 1, :, :end]
        values = v_cache[slot : slot + 1, :, :end]
        if start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            query_pos = torch.arange(start, end, device=self.device).view(-1, 1)
            mask = torch.arange(end, device=self.device).view(1, -1) <= query_pos  # [T, end]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(1, end - start, self.shape.num_heads * self.shape.head_dim)
        hidden = residual + layer.self_attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _qkv(self, attn, x, cos, sin):
        """Project, (qk-norm for Qwen3), apply rotary embeddings. Returns q, k, v as [b, h, T, d]."""
        b, t, _ = x.shape
        d = self.shape.head_dim
        q = attn.q_proj(x).view(b, t, self.shape.num_heads, d)
        k = attn.k_proj(x).view(b, t, self.shape.num_kv_heads, d)
        v = attn.v_proj(x).view(b, t, self.shape.num_kv_heads, d)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, T, d]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] → [n, V] float32."""
        return self.hf.lm_head(self._inner.norm(last_hidden)).float()

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move_slot(src, dst, length)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
