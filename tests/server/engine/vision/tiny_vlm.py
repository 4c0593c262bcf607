"""Tiny random-weight vision-language checkpoints of each supported family, written in the test
run with the family's real image-processor configuration and the default tokenizer plus the
family's vision tokens (no download)."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's own template, cut to what the tests use: image parts as the vision markers.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(base, extra: list[str], template: str):
    import copy

    tokenizer = copy.deepcopy(base)
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.chat_template = template
    return tokenizer


def write_qwen2_vl(directory: Path, base_tokenizer, model_type: str = "qwen2_vl") -> Path:
    """A 2-layer Qwen2-VL (or Qwen2.5-VL) with a 2-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(base_tokenizer, QWEN_TOKENS, QWEN_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(QWEN_TOKENS)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  in_chans=3)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    else:
        vision.update(intermediate_size=48, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, vision_start_token_id=ids[0],
                          vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # small images: 4 to 64 merged tokens per image
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(directory)
    return directory
