"""Vision-language models in the engine: for a tiny random-weight model of each supported family,
greedy tokens from a prompt with one and with two images equal transformers' own ``generate`` on
the same inputs; a prompt re-sent with the same image reuses its cached blocks (and gives the same
tokens), a different image does not; chunked prefill splitting an image span changes nothing."""

from __future__ import annotations

import hashlib

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.sequence import GenerationRequest
from server.engine.vision.expand import Picture, expand_prompt
from server.engine.vision.runner import VisionRunner, load_vision_model
from tests.server.engine.vision.tiny_vlm import write_gemma3, write_idefics3, write_pixtral, write_qwen2_vl
from tests.server.engine.vision.tiny_vlm import write_qwen3_vl

FAMILIES = {"qwen2_vl": write_qwen2_vl, "qwen2_5_vl": lambda d, t: write_qwen2_vl(d, t, "qwen2_5_vl"),
            "idefics3": write_idefics3, "smolvlm": lambda d, t: write_idefics3(d, t, "smolvlm"),
            "mistral3": write_pixtral, "llava_pixtral": lambda d, t: write_pixtral(d, t, "llava"),
            "qwen3_vl": write_qwen3_vl, "gemma3": write_gemma3}
NEW_TOKENS = 8
TOP = 5
REFERENCE_LOGPROBS: dict[tuple[int, ...], list[float]] = {}  # the reference's first-token top logprobs, by prompt


def _picture(width: int, height: int, seed: int) -> Picture:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    image = Image.fromarray(pixels, "RGB")
    return Picture(image=image, digest=hashlib.sha256(pixels.tobytes()).hexdigest())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory, default_tokenizer):
    """(directory, tokenizer, loaded vision model) of one family."""
    from transformers import AutoTokenizer

    directory = FAMILIES[request.param](tmp_path_factory.mktemp(request.param), default_tokenizer)
    return directory, AutoTokenizer.from_pretrained(directory), load_vision_model(directory, torch.float32,
                                                                                  torch.device("cpu"))


def _prompt(runner, tokenizer, directory, pictures, text="Describe the picture."):
    parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    processor = runner.family.load_image_processor(directory)
    return expand_prompt(runner.family, tokenizer, processor, runner.hf.config, rendered, pictures)


def _reference(directory, ids, media) -> list[int]:
    """transformers' own greedy generation (its own attention) over the same ids and pixels."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    inputs = {"input_ids": torch.tensor([ids])}
    inputs.update(PIXEL_INPUTS.get(hf.config.model_type, _qwen_inputs)(hf, inputs["input_ids"], media))
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                      output_logits=True, return_dict_in_generate=True)
    REFERENCE_LOGPROBS[tuple(ids)] = torch.log_softmax(out.logits[0][0].float(), -1).topk(TOP).values.tolist()
    return out.sequences[0, len(ids):].tolist()


def _qwen_inputs(hf, input_ids, media) -> dict:
    """The images' tensors stacked (one row per patch), and which tokens are image tokens."""
    inputs = {key: torch.cat([image.pixels[key] for image in media.images])
              for key in media.images[0].pixels if key != "merge_size"}
    inputs["mm_token_type_ids"] = (input_ids == hf.config.image_token_id).int()
    return inputs


def _tiled_inputs(hf, input_ids, media) -> dict:
    """Idefics3 / SmolVLM: one prompt's tiles of every image in one [1, tiles, ...] batch entry."""
    return {key: torch.cat([image.pixels[key] for image in media.images], dim=1)
            for key in ("pixel_values", "pixel_attention_mask")}


def _padded_inputs(hf, input_ids, media) -> dict:
    """Mistral 3 / Pixtral: the images zero-padded to the largest, stacked, with their sizes."""
    pixels = [image.pixels["pixel_values"] for image in media.images]
    height, width = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pixels]
    sizes = torch.cat([image.pixels["image_sizes"] for image in media.images])
    return {"pixel_values": torch.cat(padded), "image_sizes": sizes}


def _gemma3_inputs(hf, input_ids, media) -> dict:
    """Gemma 3: the images stacked, and token_type_ids (1 on image tokens: each image's tokens
    attend to each other bidirectionally)."""
    return {"pixel_values": torch.cat([image.pixels["pixel_values"] for image in media.images]),
            "token_type_ids": (input_ids == hf.config.image_token_id).long()}


# how transformers takes a prompt's images, where it is not Qwen-VL's way
PIXEL_INPUTS = {"idefics3": _tiled_inputs, "smolvlm": _tiled_inputs, "mistral3": _padded_inputs,
                "llava": _padded_inputs, "gemma3": _gemma3_inputs}


def _engine(hf, tokenizer, prefill_budget=1024) -> Engine:
    runner = VisionRunner(hf, num_blocks=160, block_size=4)
    return Engine(runner, tokenizer, max_batch_size=4, max_model_len=512, prefill_budget=prefill_budget,
                  speculation=False)


def _generate(engine: Engine, requests: list[tuple[list[int], object]]) -> list[tuple[list[int], int]]:
    """Greedy tokens and cached prompt tokens of each (ids, media), run together (the first
    token's top logprobs of each go to :data:`ENGINE_LOGPROBS`, in order)."""
    out: dict[int, list] = {i: [] for i in range(len(requests))}
    for i, (ids, media) in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids, media=media, ignore_eos=True,
                                        params=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=TOP),
                                        max_tokens=NEW_TOKENS,
                                        sink=out[i].append))
    for _ in range(400):
        if all(d and d[-1].finish_reason for d in out.values()):
            break
        engine.step()
    results = []
    ENGINE_LOGPROBS.clear()
    for deltas in out.values():
        assert deltas[-1].finish_reason == "length", deltas[-1].error
        results.append(([t for d in deltas for t in d.token_ids], deltas[-1].cached_tokens))
        first = next(d.logprobs[0] for d in deltas if d.logprobs)
        ENGINE_LOGPROBS.append([value for _, value in first.top])
    return results


ENGINE_LOGPROBS: list[list[float]] = []


def test_one_and_two_images_give_transformers_greedy_tokens(family_model):
    directory, tokenizer, hf = family_model
    engine = _engine(hf, tokenizer)
    one = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 1)])
    two = _prompt(engine.runner, tokenizer, directory, [_picture(60, 120, 2), _picture(150, 90, 3)],
                  "What differs between the two?")
    got = _generate(engine, [one, two])  # batched together
    assert [tokens for tokens, _ in got] == [_reference(directory, *one), _reference(directory, *two)]
    # the logprobs too: the tiny models' tokens hardly depend on the picture, their logprobs do
    # (test_the_picture_decides_the_logprobs), so a wrong or misplaced image row shows here
    for engine_top, prompt in zip(ENGINE_LOGPROBS, (one, two), strict=True):
        assert engine_top == pytest.approx(REFERENCE_LOGPROBS[tuple(prompt[0])], abs=2e-4)
    assert one[1].num_image_tokens > 4 and len(two[1].images) == 2


def test_the_same_image_resent_reuses_its_blocks_and_tokens(family_model):
    directory, tokenizer, hf = family_model
    engine = _engine(hf, tokenizer)
    first = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 5)])
    [(cold, cached_cold)] = _generate(engine, [first])
    encoded = engine.vision.images_encoded
    again = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 5)])  # a new request, same picture
    [(warm, cached_warm)] = _generate(engine, [again])
    assert warm == cold and cached_cold == 0
    assert cached_warm >= again[1].images[0].end - 4  # every full block through the image came from the cache
    assert engine.vision.images_encoded == encoded  # the tower did not run again
    other = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 6)])  # same size, other pixels
    [(_, cached_other)] = _generate(engine, [other])
    assert cached_other <= other[1].images[0].start


def test_chunked_prefill_through_an_image_changes_nothing(family_model):
    directory, tokenizer, hf = family_model
    whole = _generate(_engine(hf, tokenizer), [_prompt_for(hf, tokenizer, directory)])
    chunked = _generate(_engine(hf, tokenizer, prefill_budget=7), [_prompt_for(hf, tokenizer, directory)])
    assert chunked[0][0] == whole[0][0]


def _prompt_for(hf, tokenizer, directory):
    runner_family = VisionRunner.__new__(VisionRunner)
    from server.engine.vision.families import family_for

    runner_family.family, runner_family.hf = family_for(hf.config), hf
    return _prompt(runner_family, tokenizer, directory, [_picture(90, 90, 9)])


def test_the_picture_decides_the_logprobs(family_model):
    """The first token's logprobs depend on the image: other pixels, or the same image's rows in
    reverse order, move them far more than the engine and transformers differ (2e-4 above)."""
    directory, tokenizer, hf = family_model
    engine = _engine(hf, tokenizer)
    ids, media = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 11)])
    _, other = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 12)])
    _generate(engine, [(ids, media), (ids, other)])
    first, second = ENGINE_LOGPROBS
    flipped = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 11)])[1]
    flipped.encoded[0] = engine.runner.encode_image(flipped.images[0].pixels).flip(0)
    _generate(_engine(hf, tokenizer), [(ids, flipped)])
    [reversed_rows] = ENGINE_LOGPROBS
    assert max(abs(a - b) for a, b in zip(first, second)) > 2e-3
    assert max(abs(a - b) for a, b in zip(first, reversed_rows)) > 2e-3


def test_a_resent_picture_skips_the_tower_even_without_the_prefix_cache(family_model):
    directory, tokenizer, hf = family_model
    runner = VisionRunner(hf, num_blocks=160, block_size=4)
    engine = Engine(runner, tokenizer, max_batch_size=4, max_model_len=512, speculation=False,
                    enable_prefix_caching=False)
    [(cold, _)] = _generate(engine, [_prompt(runner, tokenizer, directory, [_picture(100, 80, 21)])])
    assert engine.vision.images_encoded == 1
    [(warm, cached)] = _generate(engine, [_prompt(runner, tokenizer, directory, [_picture(100, 80, 21)])])
    assert warm == cold and cached == 0 and engine.vision.images_encoded == 1 and engine.vision.cache.hits == 1


def test_the_encoder_cache_evicts_the_least_recently_used():
    from server.engine.vision.encoder_cache import EncoderCache

    cache = EncoderCache(max_bytes=3 * 4 * 10)  # three [10] float32 rows
    for key in "abc":
        cache.put(key, torch.zeros(10))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", torch.zeros(10))
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd") and cache.bytes == 120
    cache.put("huge", torch.zeros(100))  # larger than the whole cache: not kept
    assert cache.get("huge") is None and cache.bytes == 120
