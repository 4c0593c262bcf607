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
from tests.server.engine.vision.tiny_vlm import write_qwen2_vl

FAMILIES = {"qwen2_vl": write_qwen2_vl, "qwen2_5_vl": lambda d, t: write_qwen2_vl(d, t, "qwen2_5_vl")}
NEW_TOKENS = 8


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
    keys = [k for k in media.images[0].pixels if k != "merge_size"]
    for key in keys:
        inputs[key] = torch.cat([image.pixels[key] for image in media.images])
    image_token = hf.config.image_token_id
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token).int()
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


def _engine(hf, tokenizer, prefill_budget=1024) -> Engine:
    runner = VisionRunner(hf, num_blocks=160, block_size=4)
    return Engine(runner, tokenizer, max_batch_size=4, max_model_len=512, prefill_budget=prefill_budget,
                  speculation=False)


def _generate(engine: Engine, requests: list[tuple[list[int], object]]) -> list[tuple[list[int], int]]:
    """Greedy tokens and cached prompt tokens of each (ids, media), run together."""
    out: dict[int, list] = {i: [] for i in range(len(requests))}
    for i, (ids, media) in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt_token_ids=ids, media=media, ignore_eos=True,
                                        params=SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS,
                                        sink=out[i].append))
    for _ in range(400):
        if all(d and d[-1].finish_reason for d in out.values()):
            break
        engine.step()
    results = []
    for deltas in out.values():
        assert deltas[-1].finish_reason == "length", deltas[-1].error
        results.append(([t for d in deltas for t in d.token_ids], deltas[-1].cached_tokens))
    return results


def test_one_and_two_images_give_transformers_greedy_tokens(family_model):
    directory, tokenizer, hf = family_model
    engine = _engine(hf, tokenizer)
    one = _prompt(engine.runner, tokenizer, directory, [_picture(100, 80, 1)])
    two = _prompt(engine.runner, tokenizer, directory, [_picture(60, 120, 2), _picture(150, 90, 3)],
                  "What differs between the two?")
    got = _generate(engine, [one, two])  # batched together
    assert [tokens for tokens, _ in got] == [_reference(directory, *one), _reference(directory, *two)]
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
