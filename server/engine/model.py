"""Model runner: a Llama-family forward over the paged KV cache.

transformers loads the weights (safetensors or GGUF, any rope scaling it knows), and this module
runs the layers itself: one step is one forward over all rows' new tokens flattened (one token for
decoding rows, several for prefill chunks, jump-forward continuations, drafts and scored choices),
so the weights are read once per step, and one paged-attention call per layer serves every row
(:mod:`kernels.paged_attention`): each row writes its new keys/values into its own blocks and
attends over its whole context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.paged_attention import paged_attention, write_kv
from server.engine.hf_runner import UnsupportedModelError
from server.engine.kv_cache import KVShape, PagedKVCache
from server.engine.lora import LoraBank, LoraGroups, add_lora
from server.engine.step_batch import StepBatch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def runs_hand_written(config) -> bool:
    """This runner serves the config: a Llama-family model type with full attention in every
    layer (other architectures, and sliding windows, run in :mod:`server.engine.hf_runner`)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return False
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    layer_types = getattr(config, "layer_types", None) or ()
    return not window and all(kind == "full_attention" for kind in layer_types)


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


class ModelRunner:
    """Runs steps of a Llama-family model over a :class:`PagedKVCache` of ``num_blocks`` blocks."""

    def __init__(self, hf_model: nn.Module, num_blocks: int, block_size: int, lora: LoraBank | None = None) -> None:
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
            max_position=getattr(config, "max_position_embeddings", 0),
        )
        self.block_size = block_size
        self.kv = PagedKVCache(self.kv_shape(hf_model), num_blocks, block_size, self.dtype, self.device)
        self._inner = hf_model.model
        self._scale = 1.0 / math.sqrt(head_dim)

    @classmethod
    def for_sequences(
        cls, hf_model: nn.Module, max_seqs: int, max_len: int, block_size: int = 16, lora: LoraBank | None = None
    ) -> "ModelRunner":
        """A runner whose cache holds ``max_seqs`` sequences of ``max_len`` tokens (tests, benchmarks)."""
        return cls(hf_model, num_blocks=max_seqs * -(-max_len // block_size) + 1, block_size=block_size, lora=lora)

    @staticmethod
    def kv_shape(hf_model: nn.Module) -> KVShape:
        """What one cached token needs per layer (for sizing the cache before building it)."""
        config = hf_model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run every row's new tokens through the model in one pass; returns logits [R, V] at
        each row's last token (or [sum(logit_counts), V], see :meth:`StepBatch.build`). The
        weights are read once per step however many rows extend.

        The pass is the piece functions below in order (embed, then per layer pre-attention,
        attention, post-attention, then the logits); :mod:`server.engine.piecewise` replays
        everything but :meth:`attend` from CUDA graphs through the same functions."""
        hidden, cos, sin = self.embed(batch.tokens, batch.positions)
        for index in range(self.shape.num_layers):
            q, k, v = self.pre_attention(index, hidden, cos, sin, batch.lora)
            out = self.attend(index, q, k, v, batch.attn)
            hidden = self.post_attention(index, hidden, out, batch.lora)
        return self.logits_at(hidden, batch)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(pairs)

    # ------------------------------------------------------------------ the pieces of a forward

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [1, N, D] and the rotary cos/sin [1, N, rotary dim] of ``positions``."""
        hidden = self._inner.embed_tokens(tokens.view(1, -1))
        cos, sin = self._inner.rotary_emb(hidden, positions.view(1, -1))
        return hidden, cos, sin

    def pre_attention(self, index: int, hidden: torch.Tensor, cos, sin, lora: LoraGroups | None):
        """Layer ``index``'s input norm, q/k/v projections, qk-norm and rope on ``hidden``
        [1, N, D]: q [N, heads, d], k and v [N, kv_heads, d] (views, not necessarily contiguous)."""
        layer = self._inner.layers[index]
        q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin, index, lora)  # [1, h, N, d]
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn) -> torch.Tensor:
        """Write the new keys/values into layer ``index``'s cache and attend: [N, heads * d]."""
        k_cache, v_cache = self.kv.k[index], self.kv.v[index]
        write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, attn, scale=self._scale)  # [N, h, d]
        return out.reshape(-1, self.shape.num_heads * self.shape.head_dim)

    def post_attention(self, index: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                       lora: LoraGroups | None) -> torch.Tensor:
        """Layer ``index`` after attention: o_proj of ``attn_out`` [N, heads * d] plus the
        residual ``hidden`` [1, N, D] (the layer's input), then the MLP block; [1, N, D]."""
        layer = self._inner.layers[index]
        out = attn_out.view(1, -1, self.shape.num_heads * self.shape.head_dim)
        hidden = hidden + self._proj(layer.self_attn.o_proj, out, index, "o_proj", lora)
        normed = layer.post_attention_layernorm(hidden)
        if lora is None:
            return hidden + layer.mlp(normed)
        return hidden + self._lora_mlp(layer.mlp, normed, index, lora)

    def logits_at(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The final norm and lm_head at ``batch.last_index`` of the last layer's ``hidden`` [1, N, D]."""
        last = hidden[0] if batch.all_single and batch.logit_counts is None else hidden[0, batch.last_index]
        return self._logits(last)

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
