"""The model's linear layers quantized for the CPU (``--quantization int4|int8|bf16``).

Each linear weight of the hand-written forward (q/k/v, o, gate/up, down, lm_head) is quantized
once at load (:mod:`kernels.quantized_linear`). A step's tokens then take one of two routes
through the same quantized weights:

- the output's tokens (decode rows, forced and draft tokens: a few rows a step) go through the
  CPU kernel, which reads the 4- or 8-bit weights as they are stored;
- the prompt's tokens (prefill: hundreds of rows) go through the dequantized weights rounded to
  bf16 and packed for oneDNN (AMX where the CPU has it: ~7x a float32 GEMM's rate on this
  project's CPU), or in the model's dtype (float32) where oneDNN has no bf16 kernel: either is
  several times faster than the 4-/8-bit kernel for many rows. The prompt's keys and values are
  then those of a bf16 prompt, as the output tokens' are of bf16 activations (the agreement with
  the float32 model is measured by ``benchmarks/quantization.py``);
- except the prompt's last block (the cache block holding its last token: 1 to ``block_size``
  tokens), whose tokens are taken as output tokens are, through the kernel and attended each on
  its own (:func:`dense_prompt_counts`, which the engine passes as the step's prompt counts). A
  step whose only prompt tokens are that block (a short prompt, or one whose earlier blocks the
  prefix cache held) would otherwise read every layer's bf16 copy for them: the default model's
  212 MB, which doubled the step of 16 rows it joined (37 -> 74 ms; now 38). Requests arriving
  one by one (answers that end when their JSON does) put a prompt in one step of four. The
  route is still the token's own (its position in its prompt), never the batch's.

``bf16`` has one route: oneDNN's packed bf16 kernel computes each row alone at any row count
and is 2.2x float32's prefill, so prompt tokens take it too. Then a prompt's keys and values
must not depend on how it was chunked either: the scheduler cuts a quantized runner's prompts
at block boundaries and attention takes a prompt one block at a time.

The kernel takes bf16 activations, and rounding to bf16 turns an ulp of difference into a
different token now and then; so the kernel's route must compute a token the same way whatever
else is in the step: each output token is attended as a query of its own (the decode rows' in one
padded call, which SDPA computes per query as it would alone) and a row's prompt part on its own
(``PagedAttentionMetadata.prompt_counts``), and the kernels compute each row alone (tested),
which makes drafts, jump-forward and batching change no output token. The prompt's route keeps
the model's dtype, so how a prompt was chunked or batched matters no more than it does
unquantized. The loaded weights are replaced by the dequantized ones (the transformers modules
re-pointed at them; tied embeddings keep their own table).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quantized_linear import (
    KINDS,
    QuantizedWeight,
    quantize,
    quantized_linear,
    quantized_linear_float32,
    supports,
)
from server.engine.layer_weights import LayerWeights

CHOICES = ("none", *KINDS)


@dataclass(frozen=True)
class _Linear:
    quantized: QuantizedWeight
    dense: torch.Tensor  # [out, in] in the model's dtype: the dequantized weight
    key: torch.Tensor  # the tensor the forward passes for this layer (held, so its id stays its own)
    prompt: QuantizedWeight | None = None  # the dequantized weight packed as bf16: prompt rows' route


@dataclass(frozen=True)
class TokenRoutes:
    """Which of a pass's rows are prompt tokens (dense route) and which are output tokens
    (kernel route); ``prompt`` None: none is, ``output`` None: all are."""

    prompt: torch.Tensor | None
    output: torch.Tensor | None

    @staticmethod
    def of(prompt_mask: torch.Tensor | None) -> TokenRoutes:
        if prompt_mask is None:
            return ALL_OUTPUT
        prompt = prompt_mask.nonzero().flatten()
        if len(prompt) == 0:
            return ALL_OUTPUT
        if len(prompt) == len(prompt_mask):
            return TokenRoutes(prompt=None, output=None)
        return TokenRoutes(prompt=prompt, output=(~prompt_mask).nonzero().flatten())

    @property
    def all_prompt(self) -> bool:
        return self.prompt is None and self.output is None


ALL_OUTPUT = TokenRoutes(prompt=None, output=torch.empty(0, dtype=torch.long))


def dense_prompt_counts(starts: list[int], prompt_counts: list[int], prompt_lengths: list[int],
                        block_size: int) -> list[int]:
    """Per row, how many of its first new tokens (from position ``starts[i]``, the first
    ``prompt_counts[i]`` of them prompt tokens) are taken as prompt tokens (the dense route, the
    prompt's attention): those before the block holding the prompt's last token (the prompt is
    ``prompt_lengths[i]`` tokens long); that block's are taken as output tokens (see the module
    docstring)."""
    counts = []
    for start, count, length in zip(starts, prompt_counts, prompt_lengths, strict=True):
        last_block = (length - 1) // block_size * block_size if length > 0 else 0
        counts.append(max(0, min(count, last_block - start)))
    return counts


class QuantizedLinears:
    """The quantized linear layers of a runner, found by their original weight tensor."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._by_weight: dict[int, _Linear] = {}
        self.quantized_bytes = 0
        self.dense_bytes = 0
        self.prompt_bytes = 0  # the prompt route's packed bf16 copies

    def layer(self, weight: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor] | None:
        """(quantized, dense) registered for ``weight``, or None."""
        entry = self._by_weight.get(id(weight))
        return None if entry is None else (entry.quantized, entry.dense)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               routes: TokenRoutes) -> torch.Tensor:
        """``x @ weight^T (+ bias)`` through the quantized layer registered for ``weight``
        (``F.linear`` for any other), each row by its route; in ``x``'s dtype."""
        layer = self._by_weight.get(id(weight))
        if layer is None:
            return F.linear(x, weight, bias)
        if self.kind == "bf16":  # one route: the packed kernel computes each row alone at any row count
            out = self._kernel(x, layer.quantized)
            return out if bias is None else out.add_(bias)
        if routes.all_prompt:
            out = self._prompt_rows(x, layer)
        elif routes.prompt is None:
            out = self._kernel(x, layer.quantized)
        else:
            out = x.new_empty((x.shape[0], layer.dense.shape[0]))
            out[routes.output] = self._kernel(x[routes.output], layer.quantized)
            out[routes.prompt] = self._prompt_rows(x[routes.prompt], layer)
        return out if bias is None else out.add_(bias)

    def _prompt_rows(self, x: torch.Tensor, layer: _Linear) -> torch.Tensor:
        """Prompt rows: the packed bf16 copy where there is one, else the dense weight."""
        if layer.prompt is None:
            return F.linear(x, layer.dense)
        return self._kernel(x, layer.prompt)

    @staticmethod
    def _kernel(x: torch.Tensor, quantized: QuantizedWeight) -> torch.Tensor:
        """Output rows through the kernel, in ``x``'s dtype."""
        if x.dtype == torch.float32:
            return quantized_linear_float32(x, quantized)
        return quantized_linear(x.to(torch.bfloat16), quantized).to(x.dtype)

    def quantize_layers(self, layers: list[LayerWeights], modules: list[nn.Module]) -> list[LayerWeights]:
        """Quantize each layer's projections; returns the layers pointing at the dequantized
        weights, with the transformers decoder layers' (``modules``) projections re-pointed at them."""
        return [self._quantize_layer(layer, module) for layer, module in zip(layers, modules, strict=True)]

    def quantize_module(self, module: nn.Linear, *, tied: bool = False, kind: str | None = None,
                        prompt_copy: bool = True) -> None:
        """Quantize ``module``'s weight (as ``kind``, default this instance's); ``tied``: it is
        the embedding's table too, so the module keeps its float tensor. ``prompt_copy`` False:
        no packed bf16 copy for prompt rows (the output layer: a prompt's logits are one row,
        except for prompt logprobs, which keep the dense weight)."""
        weight, kind = module.weight, kind or self.kind
        if not supports(kind, weight):
            return
        if tied:  # the table stays as loaded: prompt rows' logits read it, no second copy
            quantized = quantize(weight, kind)
            self.quantized_bytes += quantized.nbytes
            self._register(quantized, weight, weight, prompt_copy)
            return
        quantized, dense = self._quantize(weight, kind)
        module.weight = nn.Parameter(dense, requires_grad=False)
        self._register(quantized, dense, module.weight, prompt_copy)

    def _quantize_layer(self, layer: LayerWeights, module: nn.Module) -> LayerWeights:
        attn, mlp = module.self_attn, module.mlp
        qkv = self._fused(layer.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj))
        gate_up = self._fused(layer.gate_up_weight, (mlp.gate_proj, mlp.up_proj))
        for linear in (layer.o_proj, layer.down_proj):
            self.quantize_module(linear)
        return replace(layer, qkv_weight=qkv, gate_up_weight=gate_up)

    def _fused(self, weight: torch.Tensor, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
        """Quantize a fused weight; its parts' modules are re-pointed at slices of the
        dequantized copy, which the layer holds from now on."""
        if not supports(self.kind, weight):
            return weight
        quantized, dense = self._quantize(weight)
        start = 0
        for linear in parts:
            linear.weight = nn.Parameter(dense[start : start + linear.out_features], requires_grad=False)
            start += linear.out_features
        self._register(quantized, dense, dense)
        return dense

    def _quantize(self, weight: torch.Tensor, kind: str | None = None) -> tuple[QuantizedWeight, torch.Tensor]:
        quantized = quantize(weight, kind or self.kind)
        dense = quantized.dequantized(weight.dtype)
        self.quantized_bytes += quantized.nbytes
        self.dense_bytes += dense.numel() * dense.element_size()
        return quantized, dense

    def _register(self, quantized: QuantizedWeight, dense: torch.Tensor, key: torch.Tensor,
                  prompt_copy: bool = True) -> None:
        prompt = None
        if prompt_copy and quantized.kind != "bf16" and supports("bf16", dense):
            prompt = quantize(dense, "bf16")
            self.prompt_bytes += prompt.nbytes
        self._by_weight[id(key)] = _Linear(quantized, dense, key, prompt)
