"""The vision-language families Trellis serves: how each one's images become embedding rows.

A family knows its placeholder token, how the image processor's output for one image expands
that token in the prompt, how its vision tower turns the pixels into rows of the language
model's width, (Qwen-VL) the prompt's 3-D rotary positions, and (Gemma 3) whether an image's
tokens attend to each other bidirectionally. transformers runs the towers and
the processors (their PIL back end: torchvision does not load against the CPU torch build);
the language model runs in the engine over the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.engine.hf_runner import UnsupportedModelError


class VisionFamily:
    """One family of vision-language checkpoints (see :data:`FAMILIES`)."""

    model_types: tuple[str, ...] = ()
    description = ""
    image_token = ""  # the token every embedding row is written over
    placeholder = ""  # what a text-only chat template gets, once per image, in the message text
    tiles = False  # cuts an image into tiles (SGLang's max_dynamic_patch caps how many)
    mrope = False  # 3-D rotary positions (the prompt's are computed here; later tokens' are 1-D plus a delta)
    # each run of image tokens attends bidirectionally within itself during prefill (Gemma 3)
    bidirectional_images = False

    @property
    def prompt_token(self) -> str:
        """The token the rendered prompt holds once per image (expanded by :meth:`expansion`)."""
        return self.image_token

    def serves(self, config) -> bool:
        """Whether this family serves ``config`` (of one of its model types)."""
        return True

    def load_image_processor(self, directory: Path):
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(directory, backend="pil")

    def extend_ids(self, tokenizer, ids: list[int], more: list[int]) -> None:
        """Append ``more`` to the prompt ids being expanded (a family whose processor expands the
        prompt as text may re-tokenize the seam; never the tokens that take embedding rows)."""
        ids.extend(more)

    def process(self, image_processor, image, detail: str, max_tiles: int | None = None) -> dict[str, torch.Tensor]:
        """The processor's tensors for one image (``detail``: OpenAI's low / high / auto;
        ``max_tiles``: a tiling family's most tiles)."""
        return dict(image_processor(images=[image], return_tensors="pt"))

    def expansion(self, tokenizer, pixels: dict[str, torch.Tensor]) -> tuple[list[int], list[bool]]:
        """The token ids one placeholder token becomes, and which of them take an embedding row."""
        raise NotImplementedError

    def _tokenized(self, tokenizer, text: str) -> tuple[list[int], list[bool]]:
        """An expansion written as text: its ids, and which are the image token."""
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        image = tokenizer.convert_tokens_to_ids(self.image_token)
        return ids, [token == image for token in ids]

    def encode(self, hf_model: nn.Module, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """The image's embedding rows [rows, hidden] (or [rows, k, hidden] for a family whose
        :meth:`step_inputs` reads more than one vector per image token)."""
        raise NotImplementedError

    def step_inputs(self, rows: torch.Tensor, index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, dict]:
        """(the embedding rows [M, hidden] written at ``index`` of a step of ``num_tokens`` tokens,
        extra language-model inputs) from the slices of :meth:`encode`'s rows the step takes.
        ``index`` ascends (the step's image positions in order)."""
        return rows, {}

    def rope_positions(self, config, prompt_ids: list[int], images: list[Any]) -> tuple[torch.Tensor, int] | None:
        """([3, P] positions, delta) for an M-RoPE family; None for 1-D positions."""
        return None

    def language_model(self, hf_model: nn.Module) -> nn.Module:
        return hf_model.model.language_model

    def text_config(self, hf_model: nn.Module):
        return hf_model.config.get_text_config()


class QwenVL(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: a run of ``<|image_pad|>`` per image (one per 2x2 merged patch),
    M-RoPE over (time, height, width)."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
    description = "Qwen2-VL / Qwen2.5-VL"
    image_token = "<|image_pad|>"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    mrope = True
    _LOW_DETAIL_TOKENS = 256  # detail "low": at most 256 image tokens

    def process(self, image_processor, image, detail: str, max_tiles: int | None = None) -> dict[str, torch.Tensor]:
        options: dict[str, Any] = {}
        if detail == "low":
            size = dict(image_processor.size)
            low = self._LOW_DETAIL_TOKENS * (image_processor.patch_size * image_processor.merge_size) ** 2  # pixels
            size["longest_edge"] = min(size.get("longest_edge", low), low)
            size["shortest_edge"] = min(size.get("shortest_edge", 0), size["longest_edge"])
            options["size"] = size
        pixels = dict(image_processor(images=[image], return_tensors="pt", **options))
        pixels["merge_size"] = torch.tensor(image_processor.merge_size)
        return pixels

    def expansion(self, tokenizer, pixels):
        merge = _merge_size(pixels)
        count = int(pixels["image_grid_thw"][0].prod()) // (merge * merge)
        token = tokenizer.convert_tokens_to_ids(self.image_token)
        return [token] * count, [True] * count

    def encode(self, hf_model, pixels):
        inner = hf_model.model
        device = next(inner.visual.parameters()).device
        out = inner.get_image_features(pixels["pixel_values"].to(device), pixels["image_grid_thw"].to(device))
        rows = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(rows), dim=0)

    def rope_positions(self, config, prompt_ids, images):
        merge = config.vision_config.spatial_merge_size
        pieces, cursor, position = [], 0, 0
        for image in images:
            text = image.start - cursor
            pieces.append(torch.arange(text).expand(3, -1) + position)
            position += text
            _, height, width = (int(v) for v in image.pixels["image_grid_thw"][0])
            h, w = height // merge, width // merge
            rows = torch.arange(h).view(-1, 1).expand(h, w).reshape(-1)
            cols = torch.arange(w).view(1, -1).expand(h, w).reshape(-1)
            pieces.append(torch.stack([torch.zeros_like(rows), rows, cols]) + position)
            position += max(h, w)
            cursor = image.end
        pieces.append(torch.arange(len(prompt_ids) - cursor).expand(3, -1) + position)
        positions = torch.cat(pieces, dim=1)
        return positions, int(positions.max()) + 1 - len(prompt_ids)


class Idefics3(VisionFamily):
    """Idefics3 and SmolVLM: the image is cut into tiles plus a downscaled global view; each tile
    becomes ``<fake_token_around_image><row_R_col_C>`` and ``image_seq_len`` ``<image>`` tokens,
    the global view ``<fake_token_around_image><global-img>`` and its tokens (the whole image when
    it is not split). 1-D positions (a Llama language model). Detail "low": no tiles, the global
    view alone (``image_seq_len`` tokens)."""

    model_types = ("idefics3", "smolvlm")
    description = "Idefics3 / SmolVLM"
    tiles = True
    image_token = "<image>"
    placeholder = "<image>"
    _AROUND = "<fake_token_around_image>"
    _GLOBAL = "<global-img>"

    def load_image_processor(self, directory: Path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory)
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        return ConfiguredProcessor(super().load_image_processor(directory),
                                   image_seq_len=side * side // config.scale_factor**2)

    def process(self, image_processor, image, detail: str, max_tiles: int | None = None) -> dict[str, torch.Tensor]:
        options: dict[str, Any] = {"return_row_col_info": True}
        if detail == "low" or max_tiles == 1:
            options["do_image_splitting"] = False
        elif max_tiles is not None:  # k tiles a side at most, k*k <= max_tiles
            processor = image_processor.processor
            side = math.isqrt(max_tiles) * processor.max_image_size["longest_edge"]
            options["size"] = {"longest_edge": min(processor.size["longest_edge"], side)}
        out = image_processor.processor(images=[image], return_tensors="pt", **options)
        return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"],
                "rows": torch.tensor(out["rows"][0][0]), "cols": torch.tensor(out["cols"][0][0]),
                "image_seq_len": torch.tensor(image_processor.image_seq_len)}

    def expansion(self, tokenizer, pixels):
        rows, cols, length = int(pixels["rows"]), int(pixels["cols"]), int(pixels["image_seq_len"])
        tokens = self.image_token * length
        text = ""
        if rows or cols:
            for row in range(rows):
                text += "".join(f"{self._AROUND}<row_{row + 1}_col_{col + 1}>{tokens}" for col in range(cols)) + "\n"
            text += "\n"
        text += f"{self._AROUND}{self._GLOBAL}{tokens}{self._AROUND}"
        return self._tokenized(tokenizer, text)

    def encode(self, hf_model, pixels):
        inner = hf_model.model
        device = next(inner.vision_model.parameters()).device
        out = inner.get_image_features(pixels["pixel_values"].to(device), pixels["pixel_attention_mask"].to(device))
        return torch.cat(list(out.pooler_output), dim=0)

    def language_model(self, hf_model):
        return hf_model.model.text_model


class Pixtral(VisionFamily):
    """Mistral 3 (Mistral Small 3.1 / 3.2) and LLaVA with a Pixtral tower (Pixtral 12B): one
    ``[IMG]`` per token-sized square of the resized image (patch size x spatial merge: 28 pixels for
    Mistral 3, 16 for Pixtral 12B), each row ended by ``[IMG_BREAK]``, the last by ``[IMG_END]``;
    1-D positions. Detail "low": the longest edge at most 16 tokens (at most 256 image tokens)."""

    model_types = ("mistral3", "llava")
    description = "Mistral 3 / Pixtral"
    image_token = "[IMG]"
    placeholder = "[IMG]"
    _BREAK = "[IMG_BREAK]"
    _END = "[IMG_END]"
    _LOW_DETAIL_SIDE = 16  # tokens

    def serves(self, config) -> bool:
        return config.model_type == "mistral3" or config.vision_config.model_type == "pixtral"

    def load_image_processor(self, directory: Path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory)
        merge = getattr(config, "spatial_merge_size", 1) if config.model_type == "mistral3" else 1
        return ConfiguredProcessor(super().load_image_processor(directory),
                                   patch=config.vision_config.patch_size * merge)

    def process(self, image_processor, image, detail: str, max_tiles: int | None = None) -> dict[str, torch.Tensor]:
        patch = image_processor.patch
        options: dict[str, Any] = {"patch_size": {"height": patch, "width": patch}}
        if detail == "low":
            longest = image_processor.processor.size["longest_edge"]
            options["size"] = {"longest_edge": min(longest, self._LOW_DETAIL_SIDE * patch)}
        pixels = dict(image_processor.processor(images=[image], return_tensors="pt", **options))
        pixels["patch"] = torch.tensor(patch)
        return pixels

    def expansion(self, tokenizer, pixels):
        patch = int(pixels["patch"])
        height, width = (int(v) // patch for v in pixels["image_sizes"][0])
        image, row_break, end = tokenizer.convert_tokens_to_ids([self.image_token, self._BREAK, self._END])
        ids = ([image] * width + [row_break]) * height
        ids[-1] = end
        return ids, [token == image for token in ids]

    def encode(self, hf_model, pixels):
        inner = hf_model.model
        device = next(inner.vision_tower.parameters()).device
        out = inner.get_image_features(pixel_values=pixels["pixel_values"].to(device),
                                       image_sizes=pixels["image_sizes"].to(device))
        return torch.cat(list(out.pooler_output), dim=0)


@dataclass(frozen=True)
class ConfiguredProcessor:
    """A family's image processor and what the model's config adds to it for the processing and
    the prompt expansion (values that the image processor's own config does not hold)."""

    processor: Any
    image_seq_len: int = 0  # Idefics3 / SmolVLM: <image> tokens of one tile
    patch: int = 0  # Pixtral: pixels a side of one image token (patch size x spatial merge)


class Qwen3VL(QwenVL):
    """Qwen3-VL: Qwen2.5-VL's prompt layout and M-RoPE positions, and "deepstack": features of a
    few vision-tower layers are added to the hidden states of the image tokens after the language
    model's first layers. Its rows are [rows, 1 + layers, hidden]: the embedding row, then one
    deepstack row per layer (:meth:`step_inputs` splits them for the language model)."""

    model_types = ("qwen3_vl",)
    description = "Qwen3-VL"

    def encode(self, hf_model, pixels):
        inner = hf_model.model
        device = next(inner.visual.parameters()).device
        out = inner.get_image_features(pixels["pixel_values"].to(device), pixels["image_grid_thw"].to(device))
        rows = [torch.cat(list(out.pooler_output), dim=0)]
        rows += [torch.cat(list(layer), dim=0) for layer in out.deepstack_features]
        return torch.stack(rows, dim=1)

    def step_inputs(self, rows, index, num_tokens):
        mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=index.device)
        mask[0, index] = True
        deepstack = [rows[:, layer] for layer in range(1, rows.shape[1])]
        return rows[:, 0], {"visual_pos_masks": mask, "deepstack_visual_embeds": deepstack}


def _merge_size(pixels: dict[str, torch.Tensor]) -> int:
    return int(pixels["merge_size"])


class Gemma3(VisionFamily):
    """Gemma 3 (4B / 12B / 27B): the prompt holds ``<start_of_image>`` once per image, which
    becomes two newlines, ``<start_of_image>``, ``mm_tokens_per_image`` (256) ``<image_soft_token>``,
    ``<end_of_image>`` and two newlines (Gemma3Processor's ``full_image_sequence``); SigLIP at a fixed size,
    pooled and projected (the rows are not scaled by the embedding scale: transformers writes them
    over the scaled text embeddings as they are). The soft tokens of one image attend to each other
    bidirectionally (transformers' ``token_type_ids``); 1-D positions, sliding-window layers.
    Pan-and-scan crops are not taken (the processor's default); detail is ignored (one size).

    Gemma3Processor expands the prompt as text, so the expansion's newlines join the newlines
    beside the placeholder (the newline after the chat template's ``user``) into one token, as
    Gemma's tokenizer reads a run of newlines: :meth:`extend_ids` re-tokenizes the newline-only
    tokens across each seam (with the token after them)."""

    model_types = ("gemma3",)
    description = "Gemma 3"
    image_token = "<image_soft_token>"
    prompt_token = "<start_of_image>"
    placeholder = "<start_of_image>"
    bidirectional_images = True
    _END = "<end_of_image>"

    def load_image_processor(self, directory: Path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory)
        return ConfiguredProcessor(super().load_image_processor(directory), image_seq_len=config.mm_tokens_per_image)

    def process(self, image_processor, image, detail: str, max_tiles: int | None = None) -> dict[str, torch.Tensor]:
        out = image_processor.processor(images=[image], return_tensors="pt", do_pan_and_scan=False)
        return {"pixel_values": out["pixel_values"], "image_seq_len": torch.tensor(image_processor.image_seq_len)}

    def expansion(self, tokenizer, pixels):
        text = f"\n\n{self.prompt_token}{self.image_token * int(pixels['image_seq_len'])}{self._END}\n\n"
        return self._tokenized(tokenizer, text)

    def encode(self, hf_model, pixels):
        inner = hf_model.model
        device = next(inner.vision_tower.parameters()).device
        out = inner.get_image_features(pixels["pixel_values"].to(device))
        return torch.cat(list(out.pooler_output), dim=0)

    def extend_ids(self, tokenizer, ids, more):
        tail, tail_newlines = _newline_run(tokenizer, reversed(ids))
        if not tail or not more:
            ids.extend(more)
            return
        head, head_newlines = _newline_run(tokenizer, more)
        newlines = "\n" * (tail_newlines + head_newlines)
        context = more[head : head + 1]  # the token after the seam's newlines, read with them (none at the end)
        merged = tokenizer(newlines + tokenizer.decode(context), add_special_tokens=False)["input_ids"]
        joined = merged[: len(merged) - len(context)]
        # only the newline tokens change; anything else (a space prefixed, the next token re-split) is left alone
        if merged[len(joined) :] == context and tokenizer.decode(joined) == newlines:
            del ids[len(ids) - tail :]
            ids.extend(joined)
            ids.extend(more[head:])
        else:
            ids.extend(more)


def _newline_run(tokenizer, ids) -> tuple[int, int]:
    """(tokens, newlines) of the newline-only tokens that ``ids`` starts with."""
    tokens = newlines = 0
    for token in ids:
        text = tokenizer.decode([token])
        if not text or text.strip("\n"):
            break
        tokens, newlines = tokens + 1, newlines + len(text)
    return tokens, newlines


FAMILIES: tuple[VisionFamily, ...] = (QwenVL(), Qwen3VL(), Idefics3(), Pixtral(), Gemma3())

# Vision-language model types refused at start-up, with the reason.
_REFUSED: dict[str, str] = {
    "mllama": "Llama 3.2 Vision attends to the image through cross-attention layers, which the paged cache does not hold",
    "llama4": "Llama 4 (chunked attention, MoE, early-fusion vision) is not implemented",
}


def vision_model_type(config) -> str | None:
    """The checkpoint's model type when it is a vision-language model (it has a vision config)."""
    if getattr(config, "vision_config", None) is None:
        return None
    return getattr(config, "model_type", None)


def family_for(config) -> VisionFamily:
    """The family serving a vision-language config; :class:`UnsupportedModelError` (one line) when
    none does."""
    model_type = vision_model_type(config)
    for family in FAMILIES:
        if model_type in family.model_types:
            if family.serves(config):
                return family
            tower = getattr(config.vision_config, "model_type", None)
            raise UnsupportedModelError(f"vision-language model type '{model_type}' with a '{tower}' vision tower "
                                        f"is not supported (only {family.description})")
    if model_type in _REFUSED:
        raise UnsupportedModelError(f"vision-language model type '{model_type}' is not supported: "
                                    f"{_REFUSED[model_type]}")
    supported = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise UnsupportedModelError(f"vision-language model type '{model_type}' is not supported "
                                f"(supported: {supported})")
