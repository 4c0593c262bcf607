"""Model runner over transformers' own modelling code, with Trellis's paged attention plugged in.

transformers runs each architecture's layers (embeddings, rotary variants, qk-norm, MoE routing,
per-layer sliding windows, attention sinks); only attention is ours. The runner registers
:func:`paged_attention_forward` under :data:`ATTN_IMPLEMENTATION` in transformers'
``AttentionInterface`` and sets the model's ``config._attn_implementation`` to it, so every
attention module calls it with its projected, rotated query/key/value. One engine step is one
flattened ``[1, N]`` sequence (every row's new tokens back to back, ``position_ids`` = each
token's position in its own sequence); the step's :class:`PagedAttentionMetadata` travels
through the forward's keyword arguments, which transformers hands on to the attention function.
That function writes the layer's new keys/values into the paged cache and attends each row over
its own blocks (:mod:`kernels.paged_attention`).

No dense mask is ever built: the implementation name is deliberately left out of
``AttentionMaskInterface``; transformers' mask factories return ``None`` at once for an attention
implementation they have no mask function for (``masking_utils._preprocess_mask_arguments``),
while a registered one would run the packed-sequence detection, which reads a value back from
the device every step. Row separation, causality and sliding windows live in the metadata.

The final norm runs inside the model; the LM head (and Gemma's final logit soft-capping) runs
only at the step's logit positions (``batch.last_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv
from server.engine.kv_cache import KVShape, PagedKVCache
from server.engine.lora import TARGET_MODULES, LoraBank, LoraGroups, add_lora
from server.engine.step_batch import StepBatch

ATTN_IMPLEMENTATION = "trellis_paged"
STEP_KWARG = "trellis_step"

# model_type -> what people deploy under it. Every entry is exercised by tests/server/engine/test_hf_runner.py.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama 2/3.x (and DeepSeek-R1 Llama distills)",
    "mistral": "Mistral 7B / Mistral Small (dense; per-config sliding window)",
    "mixtral": "Mixtral 8x7B / 8x22B (MoE)",
    "qwen2": "Qwen2 / Qwen2.5 (and DeepSeek-R1 Qwen distills)",
    "qwen3": "Qwen3 dense",
    "qwen3_moe": "Qwen3 MoE",
    "gemma3_text": "Gemma 3 text (1B, or the text model of larger checkpoints saved as Gemma3ForCausalLM)",
    "gpt_oss": "gpt-oss",
    "glm": "GLM-4 (GLM-4-9B-chat-hf)",
    "glm4": "GLM-4-0414",
    "glm4_moe": "GLM-4.5 / GLM-4.6 (MoE; multi-token-prediction layers are not run)",
}

# Refusals with a reason more useful than "not in the list".
_REFUSED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v2": "multi-head latent attention (MLA) keeps a compressed KV, not [kv_heads, head_dim] keys and values",
    "deepseek_v3": "multi-head latent attention (MLA, also Kimi K2) keeps a compressed KV, not [kv_heads, head_dim]",
    "deepseek_v32": "multi-head latent attention with sparse indexing is not implemented",
    "kimi_linear": "linear-attention layers keep a recurrent state, not a paged KV cache",
    "qwen3_next": "linear-attention (gated DeltaNet) layers keep a recurrent state, not a paged KV cache",
    "gemma3": "a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration); serve a text-only gemma3_text export",
}


class UnsupportedModelError(RuntimeError):
    """The checkpoint's architecture cannot run on the paged runner (one-line message)."""


@dataclass(frozen=True)
class PagedStep:
    """What the attention function needs for one step: the metadata and the cache it writes."""

    meta: PagedAttentionMetadata
    cache: PagedKVCache


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, h, N, d], key/value [1, kv, N, d] →
    ([1, N, h, d], no weights). Writes this layer's keys/values, then paged attention."""
    step: PagedStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"the '{ATTN_IMPLEMENTATION}' attention runs only inside TransformersRunner.forward")
    layer = module.layer_idx
    k_cache, v_cache = step.cache.k[layer], step.cache.v[layer]
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), step.meta.slot_mapping)
    out = paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        step.meta,
        scale=module.scaling if scaling is None else scaling,
        sliding_window=sliding_window,
        sinks=s_aux,
        softcap=softcap,
    )
    return out.unsqueeze(0), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def check_config(config) -> None:
    """Raise :class:`UnsupportedModelError` for an architecture the runner cannot serve."""
    model_type = getattr(config, "model_type", None)
    if model_type in _REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"model type '{model_type}' is not supported: {_REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type '{model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModelError(f"model type '{model_type}' uses latent attention (kv_lora_rank), not supported")


def load_model(directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load a causal LM with transformers, refusing an unsupported architecture before any weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _register_attention()
    config = AutoConfig.from_pretrained(directory)
    check_config(config)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return model.to(device).eval()


def text_parts(hf_model: nn.Module) -> tuple[object, nn.Module]:
    """(config, decoder) of the language model: the model itself, or a vision-language model's
    ``language_model`` (``text_model`` in Idefics3 / SmolVLM)."""
    inner = hf_model.model
    for name in ("language_model", "text_model"):
        language = getattr(inner, name, None)
        if language is not None:
            return hf_model.config.get_text_config(), language
    return hf_model.config, inner


def kv_shape(hf_model: nn.Module) -> KVShape:
    """Layers, KV heads and head size read from the attention modules themselves (so a config
    whose numbers do not describe the projections is caught before the cache is sized)."""
    config, inner = text_parts(hf_model)
    layers = inner.layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        k_proj = getattr(attn, "k_proj", None)
        if getattr(attn, "layer_idx", None) != index or not isinstance(k_proj, nn.Linear):
            raise UnsupportedModelError(f"layer {index} of '{config.model_type}' has no plain k_proj attention")
        if k_proj.out_features != kv_heads * head_dim:
            raise UnsupportedModelError(
                f"layer {index} keys are {k_proj.out_features} wide, not {kv_heads} heads x {head_dim}"
            )
    return KVShape(num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim)


class LoraLinear(nn.Module):
    """A targeted projection plus the current step's per-row LoRA deltas."""

    def __init__(self, base: nn.Linear, runner: "TransformersRunner", layer: int, module: str) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.module = module
        self._runner = [runner]  # a list: not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        runner = self._runner[0]
        groups = runner.step_lora
        if groups is not None:
            flat_out, flat_x = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
            add_lora(flat_out, flat_x, runner.lora, groups, self.layer, self.module)
        return out


class TransformersRunner:
    """Runs engine steps (:class:`StepBatch`) through a transformers causal LM over a paged KV cache.

    On CUDA its plain decode steps replay full graphs (:mod:`server.engine.cuda_graphs`), but its
    mixed steps (prefill chunks, jump-forward continuations, drafts) run eagerly: it exposes no
    piece functions, so it gets no piecewise graphs (:mod:`server.engine.piecewise`)."""

    def __init__(self, hf_model: nn.Module, num_blocks: int, block_size: int, lora: LoraBank | None = None) -> None:
        _register_attention()
        self._check(hf_model)
        self.hf = hf_model
        self.lora = lora
        self.step_lora: LoraGroups | None = None  # the running step's adapter groups (read by LoraLinear)
        self.last_hidden: torch.Tensor | None = None  # [R, D] final-norm hidden states of the last forward
        param = next(hf_model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = block_size
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.kv = PagedKVCache(kv_shape(hf_model), num_blocks, block_size, self.dtype, self.device)
        text_config, self._inner = text_parts(hf_model)
        self._final_softcap = getattr(text_config, "final_logit_softcapping", None)
        if lora is not None:
            self._wrap_lora_targets(lora)

    def _check(self, hf_model: nn.Module) -> None:
        check_config(hf_model.config)
        if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
            hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Every row's new tokens in one pass; float32 logits [R, V] at each row's last token (or
        [sum(logit_counts), V]). The final-norm hidden states at those tokens stay in :attr:`last_hidden`."""
        return self._run(batch, input_ids=batch.tokens.view(1, -1), position_ids=batch.positions.view(1, -1))

    def _run(self, batch: StepBatch, **inputs) -> torch.Tensor:
        """The language model over ``inputs`` (ids or embeddings, positions) for ``batch``."""
        if batch.lora is not None and self.lora is None:
            raise ValueError("the step names LoRA adapters but the runner has no LoRA bank")
        self.step_lora = batch.lora
        try:
            out = self._inner(use_cache=False, **inputs, **{STEP_KWARG: PagedStep(batch.attn, self.kv)})
        finally:
            self.step_lora = None
        hidden = out.last_hidden_state[0]
        single = batch.logit_counts is None and batch.all_single
        self.last_hidden = hidden if single else hidden[batch.last_index]
        return self._logits(self.last_hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.lm_head(hidden).float()
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``(src, dst)`` in every layer (copy-on-write of a shared last block)."""
        self.kv.copy_blocks(pairs)

    def _wrap_lora_targets(self, bank: LoraBank) -> None:
        """Replace each projection some adapter targets with a :class:`LoraLinear` around it."""
        targeted = {key for adapter in bank.adapters for key in adapter.weights}
        for layer, module in sorted(targeted):
            if module not in TARGET_MODULES:
                continue
            block = self._inner.layers[layer]
            parent = block.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
            base = getattr(parent, module, None)
            if isinstance(base, LoraLinear):
                continue
            if not isinstance(base, nn.Linear):
                raise UnsupportedModelError(f"LoRA target layers.{layer}.{module} is not a linear layer in this model")
            setattr(parent, module, LoraLinear(base, self, layer, module))
