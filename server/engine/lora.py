"""LoRA adapters applied per row inside the batched forward.

An adapter is a peft-format directory (``adapter_config.json`` + ``adapter_model.safetensors``,
as peft's ``save_pretrained`` writes it). For a targeted linear layer ``y = x W^T`` the adapter adds
``scale * (x A^T) B^T`` with ``A`` [r, in], ``B`` [out, r] and ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), which is what merging ``W + scale * B A`` gives.

Every row of a step names an adapter (0 = the base model); the tokens of each adapter present in the
step form one group, and each targeted projection adds its group's delta with two small matmuls
(a segmented matmul over the step's groups), so rows of different adapters and of the base model run
in one forward with the base weights read once.

What is not implemented is refused when the adapter loads, with a one-line error: DoRA, adapters on
embeddings or ``lm_head``, ``modules_to_save``, LoRA biases, per-module rank/alpha patterns,
``fan_in_fan_out``, weights for modules other than the attention and dense MLP projections, and
adapters on the experts or router of a mixture-of-experts layer (peft's ``target_parameters``,
per-expert ``experts.N.*`` weights, or a dense-MLP target the model's MoE layer does not have).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGET_MODULES) + r")\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_MOE_KEY = re.compile(r"\.(?:experts|shared_experts?|gate|router|block_sparse_moe)(?:\.|$)")
_VISION_KEY = re.compile(r"(?:^|\.)(?:visual|vision_tower|vision_model|vision_encoder|multi_modal_projector)\.")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LoraError(RuntimeError):
    """An adapter cannot be loaded (one-line message naming the adapter and the reason)."""


@dataclass
class LoraAdapter:
    """One adapter's weights, ready to apply: per (layer, module) ``(A^T [in, r], scale * B^T [r, out])``."""

    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def parse_lora_modules(text: str) -> list[tuple[str, Path]]:
    """``name=path`` entries separated by commas or white space (``--lora-modules``)."""
    entries = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    modules: list[tuple[str, Path]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise LoraError(f"--lora-modules entry {entry!r} is not name=path")
        if not _ADAPTER_NAME.match(name) or ":" in name:
            raise LoraError(f"LoRA adapter name {name!r}: use letters, digits, '.', '_' or '-'")
        if any(name == known for known, _ in modules):
            raise LoraError(f"LoRA adapter name {name!r} is given twice")
        modules.append((name, Path(path).expanduser()))
    return modules


def load_adapter(name: str, directory: Path, model: torch.nn.Module) -> LoraAdapter:
    """Read a peft LoRA directory and check it against ``model`` (a transformers causal LM)."""
    config = _read_config(name, directory)
    _refuse_unsupported(name, config)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraError(f"LoRA adapter '{name}': {weights_file} not found (only safetensors adapters are read)")
    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    pairs = _pair_weights(name, tensors)
    rank = int(config.get("r") or 0)
    if rank <= 0:
        raise LoraError(f"LoRA adapter '{name}': adapter_config.json has no positive 'r'")
    alpha = float(config.get("lora_alpha") or rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name=name, path=directory, rank=rank, scale=scale)
    param = next(model.parameters())
    layers = _decoder(model.model).layers
    for (layer, module), (a, b) in sorted(pairs.items()):
        if layer >= len(layers):
            raise LoraError(f"LoRA adapter '{name}': layer {layer} does not exist (the model has {len(layers)})")
        base = _projection(name, layers[layer], layer, module)
        if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
            raise LoraError(
                f"LoRA adapter '{name}': layers.{layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"expected ({rank}, {base.in_features}) and ({base.out_features}, {rank}) for this model"
            )
        a_t = a.t().contiguous().to(device=param.device, dtype=param.dtype)
        b_t = (b.t().float() * scale).contiguous().to(device=param.device, dtype=param.dtype)
        adapter.weights[(layer, module)] = (a_t, b_t)
    if not adapter.weights:
        raise LoraError(f"LoRA adapter '{name}': no LoRA weights in {weights_file}")
    return adapter


def _decoder(inner: torch.nn.Module) -> torch.nn.Module:
    """The decoder whose layers adapters target: a vision-language model's language model."""
    for name in ("language_model", "text_model"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    return inner


def _read_config(name: str, directory: Path) -> dict:
    path = directory / "adapter_config.json"
    if not directory.is_dir():
        raise LoraError(f"LoRA adapter '{name}': {directory} is not a directory")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter '{name}': {path} not found (expected a peft adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter '{name}': cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA adapter '{name}': {path} is not a JSON object")
    return config


def _refuse_unsupported(name: str, config: dict) -> None:
    """One-line refusals for adapter features the forward does not implement."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    problems = []
    if peft_type != "LORA":
        problems.append(f"peft_type {peft_type} (only LORA)")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") not in ("none", None) or config.get("lora_bias"):
        problems.append("LoRA biases")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        problems.append("per-module rank_pattern/alpha_pattern")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out")
    if config.get("target_parameters"):
        problems.append(f"target_parameters {config['target_parameters']} (LoRA on mixture-of-experts expert weights)")
    targets = config.get("target_modules")
    named = [targets] if isinstance(targets, str) else list(targets or [])
    outside = [t for t in named if t in ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")]
    if outside:
        problems.append(f"adapters on {', '.join(outside)} (only attention/MLP projections)")
    if problems:
        raise LoraError(f"LoRA adapter '{name}' uses what this server does not support: {'; '.join(problems)}")


def _pair_weights(name: str, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.search(key)
        if _VISION_KEY.search(key):
            raise LoraError(f"LoRA adapter '{name}': weight {key} targets the vision tower, which this server does "
                            "not adapt (only the language model's attention and dense MLP projections)")
        if match is None and _MOE_KEY.search(key):
            raise LoraError(
                f"LoRA adapter '{name}': weight {key} targets the experts or router of a mixture-of-experts "
                "layer, which this server does not support (only attention and dense MLP projections)"
            )
        if match is None:
            raise LoraError(
                f"LoRA adapter '{name}': weight {key} is not a LoRA A/B matrix of "
                f"{'/'.join(TARGET_MODULES)} (embeddings, lm_head, DoRA and biases are not supported)"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, module), {})[half] = tensor
    pairs = {}
    for (layer, module), found in halves.items():
        if set(found) != {"A", "B"}:
            raise LoraError(f"LoRA adapter '{name}': layers.{layer}.{module} lacks its lora_A or lora_B weight")
        pairs[(layer, module)] = (found["A"], found["B"])
    return pairs


def _projection(name: str, layer: torch.nn.Module, index: int, module: str) -> torch.nn.Linear:
    """The model's linear layer ``module`` of layer ``index``; a one-line refusal when the model has
    none there (a mixture-of-experts layer has experts and a router instead of a dense MLP)."""
    in_attention = module in ("q_proj", "k_proj", "v_proj", "o_proj")
    parent = getattr(layer, "self_attn" if in_attention else "mlp", None)
    base = getattr(parent, module, None) if parent is not None else None
    if isinstance(base, torch.nn.Linear):
        return base
    where = f"layers.{index}.{'self_attn' if in_attention else 'mlp'}.{module}"
    if parent is not None and hasattr(parent, "experts"):
        raise LoraError(
            f"LoRA adapter '{name}': {where} is a mixture-of-experts layer in this model (experts and a router, "
            "no dense projection); LoRA on expert projections is not supported"
        )
    raise LoraError(f"LoRA adapter '{name}': {where} is not a linear layer of this model")


class LoraBank:
    """The configured adapters, numbered 1..n in the order given (0 is the base model)."""

    def __init__(self, adapters: list[LoraAdapter]) -> None:
        self.adapters = adapters
        self.ids = {adapter.name: i + 1 for i, adapter in enumerate(adapters)}

    def pair(self, adapter_id: int, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.adapters[adapter_id - 1].weights.get((layer, module))


@dataclass(frozen=True)
class LoraGroups:
    """A step's tokens grouped by adapter: (adapter id, token positions as a slice or index tensor)."""

    groups: tuple[tuple[int, slice | torch.Tensor], ...]

    @staticmethod
    def build(token_adapters: list[int], device: torch.device) -> "LoraGroups | None":
        """None when every token runs on the base model (the forward then has no LoRA work)."""
        plan = LoraGroups.plan(token_adapters)
        if plan is None:
            return None
        return LoraGroups(tuple(
            (adapter_id, where if isinstance(where, slice) else torch.tensor(where, dtype=torch.long, device=device))
            for adapter_id, where in plan
        ))

    @staticmethod
    def plan(token_adapters: list[int]) -> list[tuple[int, slice | list[int]]] | None:
        """The groups with host positions: a slice for a contiguous run (a view, no gather),
        else the token positions as a list; None when every token runs on the base model."""
        present = sorted(set(token_adapters) - {0})
        if not present:
            return None
        groups: list[tuple[int, slice | list[int]]] = []
        for adapter_id in present:
            where = [i for i, a in enumerate(token_adapters) if a == adapter_id]
            if where[-1] - where[0] + 1 == len(where):
                groups.append((adapter_id, slice(where[0], where[-1] + 1)))
            else:
                groups.append((adapter_id, where))
        return groups


def add_lora(out: torch.Tensor, x: torch.Tensor, bank: LoraBank, groups: LoraGroups, layer: int, module: str) -> torch.Tensor:
    """``out`` [N, out] += each group's ``(x A^T) (scale B^T)`` for ``module`` of ``layer``; x [N, in].

    The reference (and CPU) implementation of the segmented LoRA matmul: one pair of matmuls per
    adapter present in the step."""
    for adapter_id, where in groups.groups:
        pair = bank.pair(adapter_id, layer, module)
        if pair is None:
            continue
        a_t, b_t = pair
        if isinstance(where, slice):
            out[where] += (x[where] @ a_t) @ b_t
        else:
            out.index_add_(0, where, (x.index_select(0, where) @ a_t) @ b_t)
    return out
