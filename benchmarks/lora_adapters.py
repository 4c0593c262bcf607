"""Random peft LoRA adapters for a local model, and the same adapters merged into its weights (needs
peft, from the test extra): what ``lora_bench.py`` times and the LoRA tests check against."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, adapter_dir: Path, *, seed: int, targets=ALL_TARGETS, rank: int = 4,
                 alpha: float = 8.0, merged_dir: Path | None = None, **extra) -> Path:
    """Save a randomly initialised LoRA adapter (B non-zero, so it changes the output) with peft;
    with ``merged_dir``, also save the base model with the adapter merged in (``merge_and_unload``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():  # peft's random init is small next to these weights: make the change visible
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(adapter_dir)
    if merged_dir is not None:
        merged = model.merge_and_unload()
        merged.save_pretrained(merged_dir)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(merged_dir)
    return adapter_dir
