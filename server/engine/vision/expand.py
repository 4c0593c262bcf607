"""A rendered prompt plus its pictures → the prompt the language model reads, and its media.

The chat template leaves one placeholder token per image (the family's ``prompt_token``); each is
expanded to the family's token run for that image (its size depends on the processed image), and
the runs of image tokens are recorded as the spans the embedding rows go to.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.vision.families import VisionFamily
from server.engine.vision.media import ImageInput, PromptMedia


@dataclass(frozen=True)
class Picture:
    """A decoded image and how the client asked for it."""

    image: object  # PIL.Image.Image, RGB
    digest: str
    detail: str = "auto"
    max_tiles: int | None = None  # SGLang's max_dynamic_patch (tiling families)


class PlaceholderMismatch(ValueError):
    """The rendered prompt does not hold one placeholder per image (the template dropped or
    duplicated one)."""


def expand_prompt(family: VisionFamily, tokenizer, image_processor, config, prompt_ids: list[int],
                  pictures: list[Picture]) -> tuple[list[int], PromptMedia]:
    """(the expanded prompt ids, its :class:`PromptMedia`). CPU work: run it off the event loop."""
    placeholder = tokenizer.convert_tokens_to_ids(family.prompt_token)
    found = [i for i, token in enumerate(prompt_ids) if token == placeholder]
    if len(found) != len(pictures):
        raise PlaceholderMismatch(f"the rendered prompt holds {len(found)} image placeholders for "
                                  f"{len(pictures)} images")
    ids: list[int] = []
    images: list[ImageInput] = []
    cursor = 0
    for where, picture in zip(found, pictures, strict=True):
        family.extend_ids(tokenizer, ids, prompt_ids[cursor:where])
        pixels = family.process(image_processor, picture.image, picture.detail, picture.max_tiles)
        tokens, takes_row = family.expansion(tokenizer, pixels)
        family.extend_ids(tokenizer, ids, tokens)
        # the expansion's tokens end the ids (a merge at the seam may only rewrite leading text tokens)
        runs = _runs(len(ids) - len(tokens), takes_row)
        key = f"{picture.digest}/{picture.detail}/{picture.max_tiles}"  # the picture, and how it was processed
        images.append(ImageInput(runs=runs, pixels=pixels, digest=key))
        cursor = where + 1
    family.extend_ids(tokenizer, ids, prompt_ids[cursor:])
    rope = family.rope_positions(config, ids, images)
    bidirectional = family.bidirectional_images
    if rope is None:
        return ids, PromptMedia(images=tuple(images), bidirectional=bidirectional)
    positions, delta = rope
    return ids, PromptMedia(images=tuple(images), positions=positions, rope_delta=delta, bidirectional=bidirectional)


def _runs(offset: int, takes_row: list[bool]) -> tuple[tuple[int, int], ...]:
    """(start, count) of each run of True in ``takes_row``, shifted by ``offset``."""
    runs: list[tuple[int, int]] = []
    for i, takes in enumerate(takes_row):
        if not takes:
            continue
        if runs and runs[-1][0] + runs[-1][1] == offset + i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset + i, 1))
    return tuple(runs)
