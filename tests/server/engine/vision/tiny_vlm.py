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


def write_qwen3_vl(directory: Path, base_tokenizer) -> Path:
    """A 2-layer Qwen3-VL with a 2-block vision tower whose both blocks feed deepstack features
    (added after language-model layers 0 and 1); 16-pixel patches, 2x2 merged."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(base_tokenizer, QWEN_TOKENS, QWEN_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(QWEN_TOKENS)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, vision_start_token_id=ids[0],
                           vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # Qwen3-VL's processor: 16-pixel patches, 2x2 merged; small images: 4 to 64 merged tokens
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32 * 4,
                             max_pixels=32 * 32 * 64).save_pretrained(directory)
    return directory


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


IDEFICS3_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
# Idefics3's / SmolVLM's own template, cut to what the tests use ("<|begin_of_text|>" / "<|im_start|>"
# there: the tokenizer's BOS here).
IDEFICS3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_idefics3(directory: Path, base_tokenizer, model_type: str = "idefics3") -> Path:
    """A 2-layer Llama under a 1-layer SigLIP tower of 32-pixel tiles (images to 64 pixels: up to
    2x2 tiles plus the global view). Idefics3: 16 tokens a tile (4-pixel patches, pixel shuffle 2);
    SmolVLM: 16 tokens a tile (2-pixel patches, pixel shuffle 4, as SmolVLM's own)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, SmolVLMConfig
    from transformers import SmolVLMForConditionalGeneration
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm import SmolVLMImageProcessorPil

    tokenizer = _tokenizer(base_tokenizer, IDEFICS3_TOKENS, IDEFICS3_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    tile = 32
    if model_type == "idefics3":
        config_class, model_class, processor_class = (Idefics3Config, Idefics3ForConditionalGeneration,
                                                      Idefics3ImageProcessorPil)
        patch, scale = 4, 2
    else:
        config_class, model_class, processor_class = (SmolVLMConfig, SmolVLMForConditionalGeneration,
                                                      SmolVLMImageProcessorPil)
        patch, scale = 2, 4
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  image_size=tile, patch_size=patch)
    config = config_class(text_config=text, vision_config=vision, scale_factor=scale,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor_class(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}).save_pretrained(directory)
    return directory


PIXTRAL_TOKENS = ["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Mistral Small 3.1's own template, cut to what the tests use: an image part as "[IMG]".
PIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def write_pixtral(directory: Path, base_tokenizer, model_type: str = "mistral3") -> Path:
    """A 2-layer Mistral under a 1-layer Pixtral tower of 4-pixel patches, images to 64 pixels.
    Mistral 3: 2x2 patches merged into one token (its patch merger), so up to 8x8 tokens;
    LLaVA (Pixtral 12B's layout): one token a patch, up to 16x16."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, Mistral3Config
    from transformers import Mistral3ForConditionalGeneration
    from transformers.models.pixtral import PixtralImageProcessorPil

    tokenizer = _tokenizer(base_tokenizer, PIXTRAL_TOKENS, PIXTRAL_TEMPLATE)
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=4096, sliding_window=None, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=64, patch_size=4)
    common = dict(text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                  vision_feature_layer=-1, tie_word_embeddings=False)
    if model_type == "mistral3":
        config = Mistral3Config(spatial_merge_size=2, **common)
        model_class = Mistral3ForConditionalGeneration
    else:
        config = LlavaConfig(vision_feature_select_strategy="full", multimodal_projector_bias=True, **common)
        model_class = LlavaForConditionalGeneration
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size={"height": 4, "width": 4}).save_pretrained(directory)
    return directory


GEMMA3_TOKENS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma 3's own template, cut to what the tests use: an image part as "<start_of_image>", text parts trimmed.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_WINDOW = 10  # shorter than an image's 16 tokens and than the prompts


def write_gemma3(directory: Path, base_tokenizer) -> Path:
    """A 2-layer Gemma 3 language model (a sliding-window layer of 10 tokens, then a global one)
    under a 1-layer SigLIP tower of 4-pixel patches on 32-pixel images, pooled to 16 tokens an image."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(base_tokenizer, GEMMA3_TOKENS, GEMMA3_TEMPLATE)
    boi, eoi, soft = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    text = dict(model_type="gemma3_text", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=GEMMA3_WINDOW,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, boi_token_index=boi,
                          eoi_token_index=eoi, image_token_index=soft)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # the projection starts at zero: random, so the picture shows in the logits
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory
