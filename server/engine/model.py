"""Model runner: a Llama-family forward over the paged KV cache.

transformers loads the weights (safetensors or GGUF, any rope scaling it knows), and this module
runs the layers itself: one step is one forward over all rows' new tokens flattened (one token for
decoding rows, several for prefill chunks, jump-forward continuations, drafts and scored choices),
so the weights are read once per step, and one paged-attention call per layer serves every row
(:mod:`kernels.paged_attention`): each row writes its new keys/values into its own blocks and
attends over its whole context.

A decoder layer is nine kernels on CUDA (ten when attention splits long contexts): the fused
residual add + RMSNorm (:mod:`kernels.rmsnorm`), one GEMM for q/k/v, qk-norm + rotary + KV-cache
write (:mod:`kernels.rotary`), paged attention, the o_proj GEMM, the second add + norm, one GEMM
for gate/up, SiLU·mul (:mod:`kernels.activation`) and the down GEMM. The projections are
concatenated at load (:mod:`server.engine.layer_weights`). On the CPU the same pieces run as
one C++ call each (:mod:`kernels.cpu_fused`) where the matmuls compute each row alone, else
their torch references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.activation import silu_mul
from kernels.cpu_fused import cpu_fused_ops
from kernels.paged_attention import paged_attention
from kernels.rmsnorm import add_rmsnorm
from kernels.rotary import rope_write_kv
from server.engine import fp8_weights
from server.engine.dense_linear import DenseLinears
from server.engine.hf_runner import UnsupportedModelError
from server.engine.kv_cache import KVShape, PagedKVCache
from server.engine.layer_weights import LayerWeights, Norm, fuse_layer
from server.engine.lora import LoraBank, LoraGroups, add_lora
from server.engine.quantized_weights import ALL_OUTPUT, QuantizedLinears, TokenRoutes
from server.engine.quantized_weights import CHOICES as QUANTIZATION_CHOICES
from server.engine.rotary_table import RotaryTable
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
    if fp8_weights.checkpoint_scheme(directory) is not None:  # FP8 stays FP8 where it runs
        return fp8_weights.load_fp8_checkpoint(directory, dtype, device)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.to(device).eval()


class ModelRunner:
    """Runs steps of a Llama-family model over a :class:`PagedKVCache` of ``num_blocks`` blocks."""

    def __init__(self, hf_model: nn.Module, num_blocks: int, block_size: int, lora: LoraBank | None = None,
                 *, use_triton: bool | None = None, quantization: str = "none", batch_invariant: bool = False) -> None:
        """``use_triton``: the fused kernels' backend (:func:`kernels.select_backend`): None runs
        Triton on CUDA and torch on the CPU; True on the CPU runs the CUDA path's kernels in the
        Triton interpreter (``TRITON_INTERPRET=1``, tests and kernel counts). ``quantization``:
        ``int4`` or ``int8`` quantizes the linear layers for the CPU's kernels
        (:mod:`server.engine.quantized_weights`); ``fp8`` the decoder layers' projections to FP8
        (:mod:`server.engine.fp8_weights`); ``none`` keeps the weights as loaded (FP8 weights of an
        FP8 checkpoint multiply as FP8). ``batch_invariant``: on CUDA, kernels whose rows do not
        depend on the batch (:mod:`server.engine.dense_linear`)."""
        self.hf = hf_model
        self.use_triton = use_triton
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
        if quantization == "fp8":
            fp8_weights.quantize_model(hf_model)
        self.layers: list[LayerWeights] = [fuse_layer(layer, config.hidden_act) for layer in self._inner.layers]
        self._final_norm = Norm.of(self._inner.norm)
        self.fp8 = fp8_weights.attach(hf_model, self.layers, use_triton)  # None: no FP8 weights
        self.dense = DenseLinears(self.device, self.dtype, use_triton, batch_invariant=batch_invariant,
                                  fp8=self.fp8 is not None, lora=lora is not None)
        self.gemv = self.dense.gemv  # the per-shape choices prime_linear_choices times
        self.rotary = RotaryTable(self._inner.rotary_emb, num_blocks * block_size, self.dtype, self.device)
        self.quantized = self._quantize(quantization) if quantization not in ("none", "fp8") else None
        self._routes = ALL_OUTPUT  # the current pass's token routes through quantized layers
        self._primed = False  # prime_linear_choices ran
        # a CPU runner's norms, rotary and activation in one C++ call each (kernels.cpu_fused)
        # where its matmuls compute each row alone (quantized, or float32 packed panels): at a few
        # rows, the references' ~1,000 aten calls a step were half of a float32 decode step
        if self.quantized is None:
            self.dense.pack(weight for weight, _ in self.linear_weights())
        self.cpu_fused = (self.quantized is not None or self.dense.packs) and cpu_fused_ops() is not None

    def _quantize(self, kind: str) -> QuantizedLinears:
        if kind not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {kind!r} (choose from {', '.join(QUANTIZATION_CHOICES)})")
        if self.device.type != "cpu":
            raise ValueError(f"quantization {kind} runs on the CPU only (the model is on {self.device.type})")
        quantized = QuantizedLinears(kind)
        self.layers = quantized.quantize_layers(self.layers, list(self._inner.layers))
        tied = self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight
        # int4's output layer stays 8-bit: its errors go straight into the logits (GGUF's Q4 files
        # keep it at Q8_0 too), and int4 there costs 1 point in 10 of top-1 agreement
        quantized.quantize_module(self.hf.lm_head, tied=tied, kind="int8" if kind == "int4" else kind,
                                  prompt_copy=False)
        return quantized

    @classmethod
    def for_sequences(
        cls, hf_model: nn.Module, max_seqs: int, max_len: int, block_size: int = 16, lora: LoraBank | None = None,
        *, use_triton: bool | None = None, quantization: str = "none", batch_invariant: bool = False,
    ) -> ModelRunner:
        """A runner whose cache holds ``max_seqs`` sequences of ``max_len`` tokens (tests, benchmarks)."""
        return cls(hf_model, num_blocks=max_seqs * -(-max_len // block_size) + 1, block_size=block_size, lora=lora,
                   use_triton=use_triton, quantization=quantization, batch_invariant=batch_invariant)

    @staticmethod
    def kv_shape(hf_model: nn.Module) -> KVShape:
        """What one cached token needs per layer (for sizing the cache before building it)."""
        config = hf_model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    @property
    def attends_outputs_alone(self) -> bool:
        """Whether the projections compute each row alone (quantized weights, float32 packed
        panels), so the engine cuts prompts at blocks and has attention take each prompt a cache
        block per call (``PagedAttentionMetadata.prompt_counts``): prompt chunking and the prefix
        cache then change no token's bits (drafts neither, for the quantized runners)."""
        return self.quantized is not None or self.dense.packs

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
        everything but :meth:`attend` from CUDA graphs through the same functions. Between
        layers the state is the residual stream (updated in place) and the last block's output
        not yet added to it, so each residual add rides in the next norm's kernel."""
        if self.quantized is not None:
            self._routes = TokenRoutes.of(batch.prompt_mask)
        residual, cos, sin = self.embed(batch.tokens, batch.positions)
        delta = None
        for index in range(self.shape.num_layers):
            qkv = self.pre_attention(index, residual, delta, batch.lora)
            out = self.attend(index, qkv, cos, sin, batch.attn)
            delta = self.post_attention(index, residual, out, batch.lora)
        return self.logits_at(residual, delta, batch)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(pairs)

    # ------------------------------------------------------------------ the pieces of a forward

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [N, D] (the residual stream's start) and the rotary cos/sin
        [N, head_dim] of ``positions``."""
        cos, sin = self.rotary.lookup(positions)
        return self._inner.embed_tokens(tokens), cos, sin

    def pre_attention(self, index: int, residual: torch.Tensor, delta: torch.Tensor | None,
                      lora: LoraGroups | None) -> torch.Tensor:
        """Layer ``index`` up to attention: ``residual += delta`` (the previous layer's MLP output;
        None for the first layer), the input norm and the q/k/v projection, [N, q + 2 kv columns]."""
        weights = self.layers[index]
        normed = self._add_norm(residual, delta, weights.input_norm)
        qkv = self._linear(normed, weights.qkv_weight, weights.qkv_bias)
        if lora is not None:
            q, kv = weights.q_size, weights.kv_size
            for module, columns in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, None))):
                add_lora(qkv[:, columns], normed, self.lora, lora, index, module)
        return qkv

    def attend(self, index: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """Layer ``index``'s attention from its q/k/v projection ``qkv``: qk-norm, rotary and the
        cache write of the new keys/values in one kernel, then paged attention; [N, heads * d]."""
        weights, shape = self.layers[index], self.shape
        k_cache, v_cache = self.kv.k[index], self.kv.v[index]
        q_norm = k_norm = None
        eps = 1e-6
        if weights.qk_norm is not None:
            q_norm, k_norm, eps = weights.qk_norm[0].weight, weights.qk_norm[1].weight, weights.qk_norm[0].eps
        q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, attn.slot_mapping, shape.num_heads, shape.num_kv_heads,
                          q_norm, k_norm, eps, use_triton=self.use_triton, cpu_fused=self.cpu_fused)
        out = paged_attention(q, k_cache, v_cache, attn, scale=self._scale, use_triton=self.use_triton,
                              num_kv_splits=self.dense.num_kv_splits)  # [N, h, d]
        return out.view(-1, shape.num_heads * shape.head_dim)

    def post_attention(self, index: int, residual: torch.Tensor, attn_out: torch.Tensor,
                       lora: LoraGroups | None) -> torch.Tensor:
        """Layer ``index`` after attention: ``residual += o_proj(attn_out)``, the post-attention
        norm and the MLP; returns the MLP's output [N, D] (added to ``residual`` by the next norm)."""
        weights = self.layers[index]
        out = self._proj(weights.o_proj, attn_out, index, "o_proj", lora)
        normed = add_rmsnorm(out, residual, weights.post_norm.weight, weights.post_norm.eps, use_triton=self.use_triton,
                             cpu_fused=self.cpu_fused)
        gate_up = self._linear(normed, weights.gate_up_weight, weights.gate_up_bias)
        if lora is not None:
            width = gate_up.shape[1] // 2
            add_lora(gate_up[:, :width], normed, self.lora, lora, index, "gate_proj")
            add_lora(gate_up[:, width:], normed, self.lora, lora, index, "up_proj")
        if weights.silu:
            act = silu_mul(gate_up, use_triton=self.use_triton, cpu_fused=self.cpu_fused)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = weights.act_fn(gate) * up
        return self._proj(weights.down_proj, act, index, "down_proj", lora)

    def logits_at(self, residual: torch.Tensor, delta: torch.Tensor | None, batch: StepBatch) -> torch.Tensor:
        """The last layer's residual add, the final norm and lm_head at ``batch.last_index``."""
        if not (batch.all_single and batch.logit_counts is None):
            residual = residual[batch.last_index]
            delta = None if delta is None else delta[batch.last_index]
            if self.quantized is not None and batch.prompt_mask is not None:
                self._routes = TokenRoutes.of(batch.prompt_mask[batch.last_index])
        return self._logits(residual, delta)

    def _proj(self, linear: nn.Linear, x: torch.Tensor, index: int, module: str, lora: LoraGroups | None) -> torch.Tensor:
        """``linear(x)`` plus each row group's LoRA delta for ``module`` of layer ``index``; x [N, in]."""
        out = self._linear(x, linear.weight, linear.bias)
        if lora is not None:
            add_lora(out, x, self.lora, lora, index, module)
        return out

    def _logits(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """[R, D] → [R, V] float32; keeps the final-norm hidden states in :attr:`last_hidden`."""
        self.last_hidden = self._add_norm(residual, delta, self._final_norm)
        head = self.hf.lm_head
        return self._linear(self.last_hidden, head.weight, head.bias).float()

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, norm: Norm) -> torch.Tensor:
        """``norm(residual += delta)``, or ``norm(residual)`` when no block output is pending."""
        if delta is None:
            return add_rmsnorm(residual, None, norm.weight, norm.eps, use_triton=self.use_triton,
                               cpu_fused=self.cpu_fused)
        return add_rmsnorm(delta, residual, norm.weight, norm.eps, use_triton=self.use_triton, cpu_fused=self.cpu_fused)

    def prime_linear_choices(self, max_rows: int = 64) -> None:
        """Time now, before serving, the per-shape kernel choices (:class:`kernels.gemv.GemvChoice`
        at 1-8 rows, the FP8 layers' at up to 64) for every row bucket up to ``max_rows``: a first sight while
        serving (a draft's or a jump-forward's row count) would otherwise compile and time the
        candidates inside a request's step. A no-op where nothing is timed (off CUDA)."""
        if self.device.type != "cuda" or (self.gemv is None and self.fp8 is None) or self._primed:
            return
        self._primed = True  # before the graphs' capture, and again by the engine's warm-up: once
        linears = {}
        for weight, bias in self.linear_weights():
            linears.setdefault((tuple(weight.shape), weight.dtype), (weight, bias))
        generator = torch.Generator(self.device).manual_seed(0)  # the global random streams untouched
        with torch.inference_mode():
            for count in (r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows):
                for weight, bias in linears.values():
                    x = torch.randn(count, weight.shape[1], generator=generator, device=self.device).to(self.dtype)
                    self._linear(x, weight, bias)

    def linear_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every (weight, bias) the forward multiplies by: each layer's q/k/v, o, gate/up and down
        projections, then the output layer."""
        pairs = [pair for layer in self.layers
                 for pair in ((layer.qkv_weight, layer.qkv_bias), (layer.o_proj.weight, layer.o_proj.bias),
                              (layer.gate_up_weight, layer.gate_up_bias),
                              (layer.down_proj.weight, layer.down_proj.bias))]
        head = self.hf.lm_head
        return [*pairs, (head.weight, head.bias)]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A quantized layer by each row's route (:class:`TokenRoutes`); an FP8 layer by
        :mod:`kernels.fp8`; any other by the runner's dense kernels (:mod:`server.engine.dense_linear`)."""
        if self.fp8 is not None and self.fp8.owns(weight):
            return self.fp8.linear(x, weight, bias)
        if self.quantized is not None:
            return self.quantized.linear(x, weight, bias, self._routes)
        return self.dense.linear(x, weight, bias)


