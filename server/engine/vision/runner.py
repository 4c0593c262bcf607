"""The model runner of a vision-language model: transformers' language model over the paged
cache, with image embedding rows written over the placeholder tokens of prefill steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from server.engine.hf_runner import ATTN_IMPLEMENTATION, TransformersRunner, _register_attention
from server.engine.lora import LoraBank
from server.engine.step_batch import StepBatch
from server.engine.vision.families import VisionFamily, family_for


def load_vision_model(directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A vision-language checkpoint with the paged attention in its language model only (the
    vision tower keeps torch's SDPA); an unsupported family is refused before weights are read."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    _register_attention()
    family_for(AutoConfig.from_pretrained(directory))
    model = AutoModelForImageTextToText.from_pretrained(
        directory, dtype=dtype, attn_implementation=_attention_choice(),
    )
    return model.to(device).eval()


def _attention_choice() -> dict[str, str]:
    return {"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa"}


class VisionRunner(TransformersRunner):
    """A :class:`TransformersRunner` over a vision-language model's language model. A step whose
    batch carries :class:`StepMedia` runs from embeddings (the image rows written in); any other
    step is a plain text step (so decode steps replay CUDA graphs like a text model's)."""

    def __init__(self, hf_model: nn.Module, num_blocks: int, block_size: int, lora: LoraBank | None = None) -> None:
        self.family: VisionFamily = family_for(hf_model.config)
        super().__init__(hf_model, num_blocks, block_size, lora)
        self._embed = self._inner.get_input_embeddings()

    def _check(self, hf_model: nn.Module) -> None:
        if hf_model.config.get_text_config()._attn_implementation != ATTN_IMPLEMENTATION:
            hf_model.set_attn_implementation(_attention_choice())

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        media = batch.media
        if media is None:
            return super().forward(batch)
        embeds = self._embed(batch.tokens.clamp(min=0)).unsqueeze(0)
        if media.index is not None:
            embeds[0, media.index] = media.embeds.to(embeds.dtype)
        positions = media.positions.unsqueeze(1) if media.positions is not None else batch.positions.view(1, -1)
        if media.visible_until is not None:  # image tokens that see their whole image (Gemma 3)
            batch = replace(batch, attn=replace(batch.attn, visible_until=media.visible_until))
        return self._run(batch, inputs_embeds=embeds, position_ids=positions, **media.extra)

    @torch.inference_mode()
    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embedding rows [rows, hidden] (the engine calls this once per image)."""
        return self.family.encode(self.hf, pixels).to(self.dtype)
