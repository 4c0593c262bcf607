"""A decoder layer's weights as the fused forward reads them.

The q/k/v projections become one ``[(heads + 2 * kv_heads) * head_dim, D]`` weight and the MLP's
gate/up projections one ``[2 * I, D]`` weight, so each is one GEMM reading the input once.
The concatenation is done once at load; the transformers modules' own weights are then
re-pointed at slices of it (views), so the model keeps its memory footprint and transformers'
forward (and LoRA's per-module deltas) still see the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Norm:
    """An RMSNorm's weight [D] and epsilon."""

    weight: torch.Tensor
    eps: float

    @staticmethod
    def of(module: nn.Module) -> Norm:
        return Norm(module.weight, float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))))


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer (Llama, Mistral, Qwen2, Qwen3) for the fused forward.

    ``q_size``/``kv_size``: the query and key (= value) column counts of ``qkv_weight``'s output.
    ``qk_norm``: Qwen3's per-head norms of queries and keys (None elsewhere). ``silu``: the MLP's
    activation is SiLU (the fused ``silu_mul`` kernel applies); otherwise ``act_fn`` runs.
    """

    input_norm: Norm
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_size: int
    kv_size: int
    qk_norm: tuple[Norm, Norm] | None
    o_proj: nn.Linear
    post_norm: Norm
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_proj: nn.Linear
    silu: bool
    act_fn: nn.Module


def fuse_layer(layer: nn.Module, hidden_act: str) -> LayerWeights:
    """The fused weights of a transformers decoder ``layer`` whose MLP activation is the config's
    ``hidden_act`` (its projections re-pointed at them)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _concatenate((attn.q_proj, attn.k_proj, attn.v_proj))
    gate_up_weight, gate_up_bias = _concatenate((mlp.gate_proj, mlp.up_proj))
    qk_norm = (Norm.of(attn.q_norm), Norm.of(attn.k_norm)) if hasattr(attn, "q_norm") else None
    return LayerWeights(
        input_norm=Norm.of(layer.input_layernorm),
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        q_size=attn.q_proj.out_features,
        kv_size=attn.k_proj.out_features,
        qk_norm=qk_norm,
        o_proj=attn.o_proj,
        post_norm=Norm.of(layer.post_attention_layernorm),
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_proj=mlp.down_proj,
        silu=hidden_act in ("silu", "swish"),
        act_fn=mlp.act_fn,
    )


@torch.no_grad()
def _concatenate(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias, zeros standing in for a missing one) for ``linears`` stacked by
    output row; each linear's parameters become views of it."""
    weight = torch.cat([linear.weight for linear in linears])
    has_bias = any(linear.bias is not None for linear in linears)
    bias = None
    if has_bias:
        bias = torch.cat([
            linear.bias if linear.bias is not None else weight.new_zeros(linear.out_features) for linear in linears
        ])
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += linear.out_features
    return weight, bias
