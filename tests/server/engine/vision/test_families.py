"""Each vision family's prompt expansion against transformers' own processor arithmetic (where it
imports without torchvision), its detail "low", and which configs :func:`family_for` serves or
refuses. No model weights: the engine tests (test_vision_engine.py) run the towers."""

from __future__ import annotations

import pytest
import torch

from server.engine.hf_runner import UnsupportedModelError
from server.engine.vision.families import ConfiguredProcessor, family_for
from tests.server.engine.vision.tiny_vlm import IDEFICS3_TEMPLATE, IDEFICS3_TOKENS, PIXTRAL_TEMPLATE, PIXTRAL_TOKENS
from tests.server.engine.vision.tiny_vlm import _tokenizer


def _image(width: int, height: int, seed: int = 0):
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def _family(model_type: str):
    from transformers import AutoConfig

    return family_for(AutoConfig.for_model(model_type))


@pytest.fixture(scope="module")
def idefics3_tokenizer(default_tokenizer):
    return _tokenizer(default_tokenizer, IDEFICS3_TOKENS, IDEFICS3_TEMPLATE)


@pytest.mark.parametrize("size", [(100, 80), (60, 120), (20, 10), (30, 30)])
def test_idefics3_expansion_is_transformers_processor_text(idefics3_tokenizer, size):
    """The expanded prompt equals Idefics3Processor's (tiles, row/col markers, global view)."""
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    processor = Idefics3ImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
    family, image = _family("idefics3"), _image(*size)
    text = "User:<image>Say it.<end_of_utterance>\nAssistant:"
    reference = Idefics3Processor(processor, idefics3_tokenizer, image_seq_len=5)(
        text=text, images=[image], add_special_tokens=False)
    prompt = idefics3_tokenizer(text, add_special_tokens=False)["input_ids"]
    where = prompt.index(idefics3_tokenizer.convert_tokens_to_ids("<image>"))
    pixels = family.process(ConfiguredProcessor(processor, image_seq_len=5), image, "auto")
    ids, takes_row = family.expansion(idefics3_tokenizer, pixels)
    assert prompt[:where] + ids + prompt[where + 1:] == reference["input_ids"][0]
    assert torch.equal(pixels["pixel_values"], torch.as_tensor(reference["pixel_values"]))
    assert sum(takes_row) == 5 * pixels["pixel_values"].shape[1]  # image_seq_len rows a tile, every tile


def test_smolvlm_expansion_is_its_prompt_string(idefics3_tokenizer):
    from transformers.models.smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    processor = SmolVLMImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
    family = _family("smolvlm")
    for detail, split in (("auto", (3, 3)), ("low", (0, 0))):  # "low": the global view alone
        pixels = family.process(ConfiguredProcessor(processor, image_seq_len=4), _image(120, 90), detail)
        ids, takes_row = family.expansion(idefics3_tokenizer, pixels)
        rows, cols = int(pixels["rows"]), int(pixels["cols"])
        text = get_image_prompt_string(rows, cols, 4, "<fake_token_around_image>", "<image>", "<global-img>")
        assert ids == idefics3_tokenizer(text, add_special_tokens=False)["input_ids"]
        tiles = rows * cols + 1 if rows else 1
        assert (rows, cols) == split and pixels["pixel_values"].shape[1] == tiles and sum(takes_row) == 4 * tiles


@pytest.mark.parametrize(("model_type", "patch"), [("mistral3", 28), ("llava", 16)])
def test_pixtral_expansion_rows_of_img_tokens(default_tokenizer, model_type, patch):
    """One [IMG] per patch x merge square, [IMG_BREAK] after each row, [IMG_END] after the last;
    detail "low" caps the longest edge at 16 tokens."""
    from transformers import AutoConfig
    from transformers.models.pixtral import PixtralImageProcessorPil

    tokenizer = _tokenizer(default_tokenizer, PIXTRAL_TOKENS, PIXTRAL_TEMPLATE)
    img, row_break, end = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    config = AutoConfig.for_model(model_type, vision_config={"model_type": "pixtral", "patch_size": patch // 2}
                                  if model_type == "mistral3" else {"model_type": "pixtral", "patch_size": patch})
    family = family_for(config)
    processor = ConfiguredProcessor(PixtralImageProcessorPil(size={"longest_edge": 1024}), patch=patch)
    pixels = family.process(processor, _image(700, 300), "auto")
    height, width = (int(v) for v in pixels["image_sizes"][0])
    assert height % patch == 0 and width % patch == 0 and max(height, width) <= 1024
    ids, takes_row = family.expansion(tokenizer, pixels)
    rows, cols = height // patch, width // patch
    assert ids == ([img] * cols + [row_break]) * (rows - 1) + [img] * cols + [end]
    assert sum(takes_row) == rows * cols
    low = family.process(processor, _image(700, 300), "low")
    assert max(int(v) for v in low["image_sizes"][0]) <= 16 * patch < max(height, width)


def test_qwen_low_detail_is_at_most_256_tokens_for_either_patch_size():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    for family, patch in ((_family("qwen2_vl"), 14), (_family("qwen3_vl"), 16)):
        processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2)
        high = family.process(processor, _image(1200, 900), "auto")["image_grid_thw"][0]
        low = family.process(processor, _image(1200, 900), "low")["image_grid_thw"][0]
        assert int(low.prod()) // 4 <= 256 < int(high.prod()) // 4


def test_qwen3_vl_step_inputs_split_deepstack_rows():
    family = _family("qwen3_vl")
    rows = torch.arange(5 * 3 * 2, dtype=torch.float32).view(5, 3, 2)  # 5 tokens, embedding + 2 deepstack rows
    index = torch.tensor([1, 2, 4, 6, 7])
    embeds, extra = family.step_inputs(rows, index, 9)
    assert torch.equal(embeds, rows[:, 0])
    assert extra["visual_pos_masks"].tolist() == [[i in index.tolist() for i in range(9)]]
    assert [torch.equal(a, rows[:, k]) for k, a in enumerate(extra["deepstack_visual_embeds"], 1)] == [True, True]
    plain, none = _family("qwen2_5_vl").step_inputs(rows[:, 0], index, 9)
    assert none == {} and plain is not None


@pytest.mark.parametrize(("model_type", "description"), [
    ("qwen2_vl", "Qwen2-VL"), ("qwen3_vl", "Qwen3-VL"), ("idefics3", "Idefics3"), ("smolvlm", "SmolVLM"),
    ("mistral3", "Mistral 3"),
])
def test_family_for_serves(model_type, description):
    assert description in _family(model_type).description


def test_llava_is_served_with_a_pixtral_tower_only():
    from transformers import LlavaConfig

    assert family_for(LlavaConfig(vision_config={"model_type": "pixtral"})).description == "Mistral 3 / Pixtral"
    with pytest.raises(UnsupportedModelError, match="'llava' with a 'clip_vision_model' vision tower is not"):
        family_for(LlavaConfig())


def test_gemma3_is_served_with_bidirectional_images():
    """Gemma 3's image tokens attend to each other both ways: the paged attention's per-query
    limits serve it (test_gemma3_images.py)."""
    family = _family("gemma3")
    assert family.description == "Gemma 3" and family.bidirectional_images
    assert (family.prompt_token, family.image_token) == ("<start_of_image>", "<image_soft_token>")
    assert _family("qwen2_vl").prompt_token == "<|image_pad|>"  # the image token, where a family names no other


@pytest.mark.parametrize(("max_tiles", "grid"), [(None, (3, 3)), (9, (3, 3)), (8, (2, 2)), (4, (2, 2)), (3, (0, 0)),
                                                 (1, (0, 0))])
def test_max_dynamic_patch_caps_the_tiles(max_tiles, grid):
    """SGLang's max_dynamic_patch on a tiling family: at most that many tiles (k x k with k*k <= N,
    the image fitting one tile then gives the global view alone), besides the global view."""
    from transformers.models.smolvlm import SmolVLMImageProcessorPil

    processor = ConfiguredProcessor(SmolVLMImageProcessorPil(size={"longest_edge": 96},
                                                             max_image_size={"longest_edge": 32}), image_seq_len=4)
    pixels = _family("smolvlm").process(processor, _image(120, 90), "auto", max_tiles)
    rows, cols = int(pixels["rows"]), int(pixels["cols"])
    assert (rows, cols) == grid and rows * cols <= (max_tiles or 9)
