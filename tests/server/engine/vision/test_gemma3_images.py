"""Gemma 3 beyond test_vision_engine.py's shared tests (which it runs too): its prompt expansion
equals Gemma3Processor's ids and token types; its image tokens attend to each other both ways
(without the per-query limits the engine's logprobs leave transformers'); chunked prefill never
ends a step inside an image; a cached prefix that ends inside an image goes on correctly (the
cached blocks were computed with the whole image in one step)."""

from __future__ import annotations

import pytest
import torch

from server.engine.vision.expand import Picture, expand_prompt
from server.engine.vision.families import ConfiguredProcessor, family_for
from server.engine.vision.media import ImageInput, PromptMedia
from tests.server.engine.vision import test_vision_engine as shared
from tests.server.engine.vision.tiny_vlm import GEMMA3_TEMPLATE, GEMMA3_TOKENS, _tokenizer, write_gemma3

BLOCK = 4  # shared._engine's block size


def _media(bidirectional: bool = True) -> PromptMedia:
    images = tuple(ImageInput(runs=(run,), pixels={}, digest=str(i)) for i, run in enumerate([(5, 4), (12, 3)]))
    return PromptMedia(images=images, bidirectional=bidirectional)


def test_a_chunk_keeps_bidirectional_runs_whole():
    media = _media()  # image runs [5, 9) and [12, 15)
    assert media.whole_runs(0, 7) == 5  # it would end inside the first run: cut back to the run's start
    assert media.whole_runs(5, 2) == 4  # it starts the run: carried on to its end, past the budget
    assert media.whole_runs(7, 1) == 2  # it starts inside (a cached prefix ended there): to the run's end
    assert media.whole_runs(9, 4) == 3
    assert [media.whole_runs(0, n) for n in (5, 9, 10, 12, 15, 30)] == [5, 9, 10, 12, 15, 30]
    assert _media(bidirectional=False).whole_runs(0, 7) == 7


def test_an_image_token_sees_to_the_end_of_its_run():
    media = _media()
    assert media.visible_until(3, 14) == [3, 4, 8, 8, 8, 8, 9, 10, 11, 14, 14]
    assert media.visible_until(9, 12) is None  # no image token
    assert media.visible_until(14, 20) is None  # the run's last token sees no further than itself
    assert _media(bidirectional=False).visible_until(3, 14) is None


@pytest.fixture(scope="module")
def processor_tokenizer(default_tokenizer, tmp_path_factory):
    """The tiny Gemma 3 tokenizer with the named tokens Gemma3Processor reads (boi, image, eoi)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("gemma3-tokenizer")
    _tokenizer(default_tokenizer, GEMMA3_TOKENS, GEMMA3_TEMPLATE).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory, extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})


@pytest.mark.parametrize("content", [
    [{"type": "image"}, {"type": "text", "text": "Hi."}],
    [{"type": "image"}, {"type": "image"}],
    [{"type": "text", "text": "Hi."}, {"type": "image"}],
], ids=["image-then-text", "two-images", "text-then-image"])
def test_expansion_is_gemma3_processor_ids(processor_tokenizer, content):
    """The chat template's prompt expanded here equals Gemma3Processor's (its text expansion
    tokenized whole: the newlines beside each image join into one token), token types included."""
    from PIL import Image
    from transformers import AutoConfig, Gemma3Processor
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tokenizer = processor_tokenizer
    images = [Image.new("RGB", (50, 40), (60 * i, 3, 5)) for i, part in enumerate(content) if part["type"] == "image"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    want = Gemma3Processor(image_processor, tokenizer, image_seq_length=4)(
        text=text, images=images, add_special_tokens=False, return_tensors="pt")
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, media = expand_prompt(family_for(AutoConfig.for_model("gemma3")), tokenizer,
                               ConfiguredProcessor(image_processor, image_seq_len=4), None, rendered,
                               [Picture(image, str(i)) for i, image in enumerate(images)])
    assert ids == want["input_ids"][0].tolist()
    types = [0] * len(ids)
    for first, end in media.image_runs():
        types[first:end] = [1] * (end - first)
    assert types == want["token_type_ids"][0].tolist() and media.bidirectional
    assert torch.equal(torch.cat([image.pixels["pixel_values"] for image in media.images]), want["pixel_values"])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, default_tokenizer):
    from transformers import AutoTokenizer

    from server.engine.vision.runner import load_vision_model

    directory = write_gemma3(tmp_path_factory.mktemp("gemma3"), default_tokenizer)
    return directory, AutoTokenizer.from_pretrained(directory), load_vision_model(directory, torch.float32,
                                                                                  torch.device("cpu"))


def _close_to_reference(prompt_ids) -> float:
    """The largest gap between the last run's first-token top logprobs and transformers'."""
    [engine_top] = shared.ENGINE_LOGPROBS
    return max(abs(a - b) for a, b in zip(engine_top, shared.REFERENCE_LOGPROBS[tuple(prompt_ids)], strict=True))


def test_without_the_image_limits_the_logprobs_leave_transformers(gemma3, monkeypatch):
    """The test_vision_engine.py comparison is sensitive to the bidirectional attention: causal
    image tokens move the first token's logprobs far beyond its 2e-4."""
    directory, tokenizer, hf = gemma3
    engine = shared._engine(hf, tokenizer)
    prompt = shared._prompt(engine.runner, tokenizer, directory, [shared._picture(100, 80, 31)])
    want = shared._reference(directory, *prompt)
    assert shared._generate(engine, [prompt])[0][0] == want
    assert _close_to_reference(prompt[0]) < 2e-4
    monkeypatch.setattr(PromptMedia, "visible_until", lambda self, start, stop: None)
    shared._generate(shared._engine(hf, tokenizer), [prompt])  # a fresh engine: nothing cached
    assert _close_to_reference(prompt[0]) > 2e-3


@pytest.fixture(scope="module")
def two_images(gemma3):
    """A two-image prompt and transformers' greedy tokens for it."""
    directory, tokenizer, hf = gemma3
    runner = shared._engine(hf, tokenizer).runner
    prompt = shared._prompt(runner, tokenizer, directory, [shared._picture(60, 120, 32), shared._picture(90, 90, 33)],
                            "Compare them.")
    return prompt, shared._reference(directory, *prompt)


@pytest.mark.parametrize("budget", [3, 7, 13, 20, 40])
def test_chunked_prefill_never_ends_a_step_inside_an_image(gemma3, two_images, budget):
    """Whatever the prefill budget, no step ends inside an image (an image longer than the budget
    takes a step of its own), and the tokens and logprobs are transformers'."""
    _, tokenizer, hf = gemma3
    (ids, media), want = two_images
    engine = shared._engine(hf, tokenizer, prefill_budget=budget)
    spans: list[tuple[int, int]] = []  # [start, end) of every row of every step
    forward = engine.runner.forward

    def recording(batch):
        spans.extend((ctx - q, ctx) for q, ctx in zip(batch.attn.query_lens_host, batch.attn.context_lens_host))
        return forward(batch)

    engine.runner.forward = recording
    [(tokens, _)] = shared._generate(engine, [(ids, media)])
    runs = media.image_runs()
    assert len(runs) == 2 and all(end - first == 16 for first, end in runs)
    assert not [(start, end) for start, end in spans for first, last in runs if first < end < last]
    assert tokens == want and _close_to_reference(ids) < 2e-4
    longest = max(end - start for start, end in spans)
    assert longest >= 16 if budget < 16 else longest <= budget


def test_a_cached_prefix_ending_inside_an_image_goes_on_right(gemma3):
    """A prompt that shares another's image but not the token after it: the prefix cache gives it
    the whole blocks, ending inside the image; its remaining image tokens still see the whole
    image (the cached keys, computed with the whole image in view, and this step's)."""
    from transformers import AutoTokenizer

    directory, tokenizer, hf = gemma3
    engine = shared._engine(hf, tokenizer)
    family = engine.runner.family
    processor = family.load_image_processor(directory)
    picture = shared._picture(100, 80, 34)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    for before in ("", "Hi.", "Look at this.", "Here is a picture for you:", "One more."):
        content = ([{"type": "text", "text": before}] if before else []) + [{"type": "image"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content + [{"type": "text", "text": "Go."}]}],
                                             add_generation_prompt=True, tokenize=False)
        ids, media = expand_prompt(family, tokenizer, processor, hf.config,
                                   tokenizer(text, add_special_tokens=False)["input_ids"], [picture])
        first, end = media.image_runs()[0]
        if end % BLOCK >= 2:  # the last whole block inside the image leaves 2+ image tokens to compute
            break
    else:
        pytest.fail("no prompt puts the image's end two tokens past a block boundary")
    shared._generate(engine, [(ids, media)])  # its blocks stay in the prefix cache
    other = tokenizer("<end_of_turn>\n<start_of_turn>model\nA picture of", add_special_tokens=False)["input_ids"]
    cut = ids[:end] + other  # the same image, then at once other tokens than the first prompt's
    cut_media = PromptMedia(images=media.images, bidirectional=True)
    want = shared._reference(directory, cut, cut_media)
    [(tokens, cached)] = shared._generate(engine, [(cut, cut_media)])
    assert first < cached <= end - 2 and cached % BLOCK == 0
    assert tokens == want and _close_to_reference(cut) < 2e-4
