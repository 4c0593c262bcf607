"""Random peft LoRA adapters for the tiny test model (made by :mod:`benchmarks.lora_adapters`)."""

from benchmarks.lora_adapters import ALL_TARGETS, make_adapter

__all__ = ["ALL_TARGETS", "make_adapter"]
