"""FP8 weights: FP8 checkpoints and ``--quantization fp8``.

Checkpoints in the formats transformers and vLLM read are loaded: config.json's
``quantization_config.quant_method`` ``fp8`` (per-tensor weight scales, static or dynamic
activations; block-scaled ``weight_block_size`` too), ``fbgemm_fp8`` (per-channel weight scales,
dynamic per-token activations capped at ``activation_scale_ub``) and ``compressed-tensors`` with
float8 weights (``tensor``/``channel``/``block`` strategies; static, dynamic or no activation
quantization). Which layers are FP8 is read from the tensors themselves (float8_e4m3fn weights
beside a ``weight_scale``), so the formats' ignore lists need no parsing.

Where ``torch._scaled_mm`` runs FP8 (CUDA, compute capability 8.9 and newer) the weights stay FP8:
each linear module holds its FP8 weight and a ``weight_scale`` buffer (float32, one per output
channel), plus ``input_scale`` for static activations; :func:`attach` then hands the runner an
:class:`Fp8Linears` that multiplies the fused q/k/v and gate/up weights (their scales concatenated)
and o/down by :class:`kernels.fp8.Fp8Choice`: ``torch._scaled_mm`` over activations quantized per
token (or by the static scale), or at decode's few rows a kernel that reads the FP8 weight and
keeps the activations unquantized, whichever is faster per shape on the device. Elsewhere (the CPU) the weights are
dequantized once at load into the model's dtype and the forward never sees FP8.

``--quantization fp8`` (:func:`quantize_model`) turns a bf16 model's decoder-layer projections into
the same form at load (per-output-channel scales, dynamic per-token activations); where FP8 does
not run the weights are rounded to FP8 and kept in the model's dtype (the FP8 model's numbers
without its speed). The output layer stays in the model's dtype.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.fp8 import ALIGNMENT, FP8, Fp8Choice, dequantize_weight, quantize_weight
from server.engine.layer_weights import LayerWeights

FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
_SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub", "weight_zero_point",
                 "input_zero_point", "k_scale", "v_scale")
_FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


class Fp8FormatError(RuntimeError):
    """A quantized checkpoint that is not one of the FP8 formats this module loads (one line;
    the model loader reports it as its own load error)."""


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's ``quantization_config`` says about its FP8 layers."""

    method: str
    static_activations: bool  # input_scale tensors beside the weights
    block: tuple[int, int] | None = None  # block-scaled weights: (rows, columns) per scale
    scale_ub: float | None = None  # fbgemm: the cap on a token's activation maximum


def read_scheme(quantization_config: dict | None) -> Fp8Scheme | None:
    """The FP8 scheme of a ``quantization_config``; None for another method (or none). Raises
    :class:`Fp8FormatError` for a ``compressed-tensors`` config whose weights are not float8."""
    config = quantization_config or {}
    method = str(config.get("quant_method", "")).lower()
    if method == "fp8":
        block = config.get("weight_block_size")
        return Fp8Scheme(method, str(config.get("activation_scheme", "dynamic")).lower() == "static",
                         tuple(block) if block else None)
    if method == "fbgemm_fp8":
        ub = config.get("activation_scale_ub")
        return Fp8Scheme(method, False, scale_ub=float(ub) if ub else None)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    return None


def _compressed_tensors_scheme(config: dict) -> Fp8Scheme:
    groups = list((config.get("config_groups") or {}).values())
    fmt = config.get("format")
    if not groups or fmt not in (None, "float-quantized", "naive-quantized"):
        raise Fp8FormatError(f"compressed-tensors format {fmt!r}: only float8 weights (float-quantized) load")
    static, block = False, None
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise Fp8FormatError(f"compressed-tensors {weights.get('type')}{weights.get('num_bits')} weights: "
                                 "only float8 weights load")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise Fp8FormatError(f"compressed-tensors float8 weights by {weights.get('strategy')!r}: "
                                 "only tensor, channel or block scales load")
        if weights.get("strategy") == "block":
            block = tuple(weights.get("block_structure") or (128, 128))
        if inputs and (inputs.get("type") != "float" or inputs.get("num_bits") != 8):
            raise Fp8FormatError("compressed-tensors activations that are not float8")
        static = static or bool(inputs and not inputs.get("dynamic"))
    return Fp8Scheme("compressed-tensors", static, block)


def checkpoint_scheme(directory: Path) -> Fp8Scheme | None:
    """The FP8 scheme of the checkpoint in ``directory`` (None: not an FP8 checkpoint)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return read_scheme(config.get("quantization_config"))


@functools.cache
def fp8_matmul_available(device: torch.device) -> bool:
    """``torch._scaled_mm`` multiplies FP8 on ``device``: CUDA with compute capability 8.9+ (Ada,
    Hopper and newer). Elsewhere FP8 weights are dequantized at load."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def keeps_fp8(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on ``device`` (tests patch this to run the kernel on the CPU)."""
    return fp8_matmul_available(device)


# ---------------------------------------------------------------- loading a checkpoint


def load_fp8_checkpoint(directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A causal LM from an FP8 checkpoint: every other tensor in ``dtype``; the FP8 linear layers
    kept FP8 with their scales (:func:`keeps_fp8`) or dequantized into ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    scheme = checkpoint_scheme(directory)
    if scheme is None:
        raise Fp8FormatError(f"{directory} is not an FP8 checkpoint")
    config = copy.deepcopy(AutoConfig.from_pretrained(directory))
    del config.quantization_config
    with torch.device("meta"):  # no memory for weights that are about to be replaced
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _CheckpointReader(directory, scheme, dtype, device, keeps_fp8(device)).load_into(model)
    _unify_fused_groups(model, dtype)
    return model.eval()


class _CheckpointReader:
    """Reads a checkpoint's safetensors into a model built on the meta device."""

    def __init__(self, directory: Path, scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device,
                 keep_fp8: bool) -> None:
        self.scheme, self.dtype, self.device, self.keep_fp8 = scheme, dtype, device, keep_fp8
        self.files = {name: file for file in sorted(directory.glob("*.safetensors")) for name in _keys(file)}
        if not self.files:
            raise Fp8FormatError(f"{directory} has no .safetensors files")

    def load_into(self, model: nn.Module) -> None:
        wanted = dict(model.named_parameters(remove_duplicate=False))
        for name in self.files:
            prefix, _, leaf = name.rpartition(".")
            if leaf in _SCALE_LEAVES or name not in wanted:
                continue  # scales are read with their weight; unknown keys (rotary tables) are left
            tensor = self._read(name)
            module = model.get_submodule(prefix)
            if tensor.dtype == FP8 and isinstance(module, nn.Linear):
                self._install_linear(module, prefix, tensor)
            else:
                cast = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                setattr(module, leaf, nn.Parameter(cast.to(self.device), requires_grad=False))
        _tie_and_check(model, self.device)

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def _optional(self, name: str) -> torch.Tensor | None:
        return self._read(name) if name in self.files else None

    def _install_linear(self, module: nn.Linear, prefix: str, weight: torch.Tensor) -> None:
        scale = self._optional(f"{prefix}.weight_scale")
        if scale is None:
            scale = self._optional(f"{prefix}.weight_scale_inv")
        if scale is None:
            raise Fp8FormatError(f"{prefix}.weight is FP8 but the checkpoint has no {prefix}.weight_scale")
        input_scale = self._optional(f"{prefix}.input_scale")
        if self.scheme.static_activations and input_scale is None:
            raise Fp8FormatError(f"static activation scales declared but {prefix}.input_scale is missing")
        rows = _row_scales(weight, scale, self.scheme.block)
        if rows is None:  # block scales: no block-scaled kernel here, so per-channel FP8 again
            dense = _dequantize_blocks(weight, scale, self.scheme.block)
            weight, rows = quantize_weight(dense) if self.keep_fp8 else (dense, None)
        if not self.keep_fp8 or not _aligned(weight):
            dense = weight if rows is None else dequantize_weight(weight, rows, self.dtype)
            module.weight = nn.Parameter(dense.to(device=self.device, dtype=self.dtype), requires_grad=False)
            return
        install_fp8(module, weight.to(self.device), rows.to(self.device),
                    None if input_scale is None else input_scale.float().reshape(1).to(self.device),
                    self.scheme.scale_ub)


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as handle:
        return list(handle.keys())


def _row_scales(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor | None:
    """The weight's scales as one float32 per output row [N] (a per-tensor scale repeated), or None
    for block scales."""
    flat = scale.float().reshape(-1)
    rows = weight.shape[0]
    if flat.numel() == 1:
        return flat.expand(rows).contiguous()
    if flat.numel() == rows and (scale.dim() < 2 or scale.shape[-1] == 1):
        return flat
    if block is None and scale.dim() != 2:
        raise Fp8FormatError(f"a weight scale of shape {tuple(scale.shape)} for a weight {tuple(weight.shape)}")
    return None


def _dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """A block-scaled FP8 weight in float32: scale[i, j] covers rows i*b0.. and columns j*b1.."""
    rows, cols = weight.shape
    b0, b1 = block or (-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
    grid = scale.float().repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return weight.float() * grid


def _aligned(weight: torch.Tensor) -> bool:
    return weight.shape[0] % ALIGNMENT == 0 and weight.shape[1] % ALIGNMENT == 0


def _tie_and_check(model: nn.Module, device: torch.device) -> None:
    """Tie the output layer to the embedding where the config says so, rebuild the rotary tables
    (computed, not stored) on ``device``, and refuse a checkpoint that left weights unread."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and output.weight.is_meta and getattr(model.config, "tie_word_embeddings", False):
        output.weight = inputs.weight
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, type(module)(module.config).to(device))
    missing = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if missing:
        raise Fp8FormatError(f"the checkpoint lacks {len(missing)} weights the model needs (first: {missing[0]})")


def _unify_fused_groups(model: nn.Module, dtype: torch.dtype) -> None:
    """q/k/v and gate/up are concatenated into one weight each (:mod:`server.engine.layer_weights`):
    where only some of a group are FP8 (an ignored or unaligned layer), dequantize the others."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for block, names in _FUSED_GROUPS:
            parts = [getattr(getattr(layer, block), name) for name in names]
            if len({p.weight.dtype == FP8 for p in parts}) > 1:
                for part in parts:
                    if part.weight.dtype == FP8:
                        dense = dequantize_weight(part.weight, part.weight_scale, dtype)
                        part.weight = nn.Parameter(dense, requires_grad=False)


# ---------------------------------------------------------------- --quantization fp8


def install_fp8(module: nn.Linear, weight: torch.Tensor, row_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, scale_ub: float | None = None) -> None:
    """Make ``module`` an FP8 linear layer: its weight the FP8 ``weight`` [N, K], with buffers
    ``weight_scale`` (float32 [N]) and ``input_scale`` (float32 [1], or None: dynamic per token)."""
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.register_buffer("weight_scale", row_scale.float().contiguous(), persistent=False)
    module.register_buffer("input_scale", input_scale, persistent=False)
    module.activation_scale_ub = scale_ub


@torch.no_grad()
def quantize_model(hf_model: nn.Module) -> int:
    """``--quantization fp8``: each decoder layer's projections to FP8 with per-output-channel
    scales (dynamic per-token activations), in place; where FP8 does not run on the model's device,
    rounded to FP8 and kept in the model's dtype. Layers already FP8 are left. Returns the bytes
    the linear weights take now."""
    param = next(hf_model.parameters())
    keep = keeps_fp8(param.device)
    total = 0
    for layer in hf_model.model.layers:
        for block, names in _PROJECTIONS:
            for name in names:
                module = getattr(getattr(layer, block), name)
                if module.weight.dtype != FP8:
                    _quantize_module(module, keep)
                total += module.weight.numel() * module.weight.element_size()
    return total


def _quantize_module(module: nn.Linear, keep: bool) -> None:
    weight, scale = quantize_weight(module.weight)
    if keep and _aligned(weight):
        install_fp8(module, weight, scale)
    else:
        module.weight.copy_(dequantize_weight(weight, scale, module.weight.dtype))


# ---------------------------------------------------------------- the runner's FP8 layers


@dataclass(frozen=True)
class Fp8Linear:
    """One FP8 layer as the forward multiplies it."""

    weight: torch.Tensor  # FP8 [N, K], row-major: the tensor the forward passes (its key)
    scale: torch.Tensor  # float32 [1, N]
    input_scale: torch.Tensor | None  # float32 [1]: static activations; None: per token
    scale_ub: float | None


class Fp8Linears:
    """The runner's FP8 linear layers, found by the weight tensor the forward passes."""

    def __init__(self, use_triton: bool | None = None) -> None:
        self.use_triton = use_triton
        self.choice = Fp8Choice()
        self._by_weight: dict[int, Fp8Linear] = {}

    def __len__(self) -> int:
        return len(self._by_weight)

    def owns(self, weight: torch.Tensor) -> bool:
        """``weight`` is an FP8 layer's (the forward must call :meth:`linear` for it)."""
        return id(weight) in self._by_weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ weight^T (+ bias)`` for the FP8 layer of ``weight``, in x's dtype."""
        layer = self._by_weight[id(weight)]
        return self.choice.linear(x, layer.weight, layer.scale, bias, input_scale=layer.input_scale,
                                  scale_ub=layer.scale_ub, use_triton=self.use_triton)

    def register(self, weight: torch.Tensor, modules: list[nn.Linear]) -> None:
        """``weight``: the FP8 rows of ``modules`` stacked (one module: its own weight)."""
        scale = torch.cat([m.weight_scale for m in modules]).reshape(1, -1).contiguous()
        inputs = [m.input_scale for m in modules]
        # one activation quantization feeds every part: static only if all are, at the largest scale
        input_scale = None if any(s is None for s in inputs) else torch.stack(inputs).amax().reshape(1)
        ubs = [m.activation_scale_ub for m in modules if getattr(m, "activation_scale_ub", None)]
        self._by_weight[id(weight)] = Fp8Linear(weight, scale, input_scale, max(ubs) if ubs else None)


def attach(hf_model: nn.Module, layers: list[LayerWeights], use_triton: bool | None = None) -> Fp8Linears | None:
    """The runner's FP8 layers, from the transformers modules' FP8 weights and scales (a loaded
    FP8 checkpoint or :func:`quantize_model`) and the fused weights ``layers``
    (:func:`server.engine.layer_weights.fuse_layer`); None when the model has none."""
    fp8 = Fp8Linears(use_triton)
    for fused, module in zip(layers, hf_model.model.layers, strict=True):
        attn, mlp = module.self_attn, module.mlp
        for weight, parts in ((fused.qkv_weight, [attn.q_proj, attn.k_proj, attn.v_proj]),
                              (fused.gate_up_weight, [mlp.gate_proj, mlp.up_proj]),
                              (fused.o_proj.weight, [fused.o_proj]), (fused.down_proj.weight, [fused.down_proj])):
            if weight.dtype == FP8:
                fp8.register(weight, parts)
    head = hf_model.get_output_embeddings()
    if head is not None and head.weight.dtype == FP8:
        fp8.register(head.weight, [head])
    return fp8 if len(fp8) else None
