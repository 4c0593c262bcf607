"""A chat request's images, from content parts to the engine's :class:`PromptMedia`.

1. :meth:`VisionFrontend.collect` finds the ``image_url`` parts (others media kinds are a 400
   naming the part) and checks ``--limit-mm-per-prompt``;
2. :meth:`VisionFrontend.load` fetches/decodes them (bounded, off the event loop: :mod:`.images`);
3. the chat template renders each image as the family's placeholder (``server.tools.render``);
4. :meth:`VisionFrontend.expand` runs the image processor and expands the placeholders, off the
   event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.engine.vision.expand import Picture, PlaceholderMismatch, expand_prompt
from server.engine.vision.families import VisionFamily
from server.engine.vision.media import PromptMedia
from server.errors import APIError, bad_request
from server.vision.images import ImageLoader, MediaLimits

IMAGE_PARTS = frozenset({"image_url"})
OTHER_MEDIA = frozenset({"image", "input_image", "input_audio", "audio", "audio_url", "video", "video_url", "file",
                         "input_file"})
DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class ImageRef:
    """An ``image_url`` content part: where it is in the request, its URL and detail."""

    param: str  # messages[i].content[j]
    url: str
    detail: str


class VisionFrontend:
    """The request side of a vision-language model."""

    def __init__(self, family: VisionFamily, tokenizer, directory: Path, config, limits: MediaLimits,
                 max_images: int, metrics=None) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.config = config
        self.image_processor = family.load_image_processor(directory)
        self.loader = ImageLoader(limits)
        self.max_images = max_images
        self.metrics = metrics

    def close(self) -> None:
        self.loader.close()

    def template_takes_parts(self, template_source: str) -> bool:
        """Whether the chat template renders ``{"type": "image"}`` parts itself (else each image is
        written into the message text as the family's placeholder)."""
        return "image" in template_source

    def collect(self, messages) -> list[ImageRef]:
        """The request's image parts in prompt order; a 400 for any other media part, a malformed
        image part or more images than ``--limit-mm-per-prompt`` allows."""
        refs: list[ImageRef] = []
        for i, message in enumerate(messages):
            if isinstance(message.content, str) or message.content is None:
                continue
            for j, part in enumerate(message.content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PARTS:
                    refs.append(_image_ref(f"messages[{i}].content[{j}]", part))
                elif kind in OTHER_MEDIA:
                    raise bad_request(f"content part {j} of 'messages[{i}].content' is {kind!r}, but the loaded "
                                      f"model ({self.family.description}) takes images only: use 'image_url' parts",
                                      f"messages[{i}].content[{j}]", code="unsupported_content")
        if len(refs) > self.max_images:
            raise bad_request(f"the request has {len(refs)} images; this server takes at most {self.max_images} "
                              "per prompt (--limit-mm-per-prompt)", "messages", code="too_many_images")
        return refs

    async def load(self, refs: list[ImageRef], max_tiles: int | None = None) -> list[Picture]:
        """Every image fetched and decoded (concurrently, bounded by the loader); ``max_tiles``:
        SGLang's ``max_dynamic_patch``."""
        loaded = await asyncio.gather(*(self.loader.load(ref.url, param=f"{ref.param}.image_url.url") for ref in refs))
        if self.metrics is not None:
            self.metrics.image_bytes.inc(sum(image.num_bytes for image in loaded))
        return [Picture(image=image.image, digest=image.digest, detail=ref.detail, max_tiles=max_tiles)
                for ref, image in zip(refs, loaded, strict=True)]

    async def expand(self, prompt_ids: list[int], pictures: list[Picture]) -> tuple[list[int], PromptMedia]:
        """The prompt with every placeholder expanded, and its media (image processor off the loop)."""
        started = time.perf_counter()
        try:
            ids, media = await asyncio.to_thread(expand_prompt, self.family, self.tokenizer, self.image_processor,
                                                 self.config, prompt_ids, pictures)
        except PlaceholderMismatch as exc:
            raise APIError(f"the chat template did not place every image: {exc}", status=400, param="messages",
                           code="image_placeholder_mismatch") from None
        except (ValueError, TypeError) as exc:  # the processor refuses an image it cannot resize or tile
            raise bad_request(f"an image could not be processed for {self.family.description}: {exc}",
                              "messages", code="invalid_image") from None
        if self.metrics is not None:
            self.metrics.image_seconds.observe(time.perf_counter() - started)
        return ids, media


def image_limit(text: str) -> int:
    """``--limit-mm-per-prompt``: ``image=N``, ``N`` or vLLM's JSON ``{"image": N}`` → N."""
    import json

    value: Any = text.strip()
    try:
        if value.startswith("{"):
            parsed = json.loads(value)
            unknown = sorted(set(parsed) - {"image"})
            if unknown:
                raise ValueError(f"only images are taken, not {', '.join(unknown)}")
            value = parsed.get("image", 0)
        elif value.startswith("image="):
            value = value.removeprefix("image=")
        count = int(value)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"--limit-mm-per-prompt {text!r}: expected image=N, N or {{\"image\": N}} ({exc})") from None
    if count < 0:
        raise ValueError(f"--limit-mm-per-prompt {text!r}: the count cannot be negative")
    return count


def _image_ref(param: str, part: dict[str, Any]) -> ImageRef:
    image = part.get("image_url")
    if isinstance(image, str):
        return ImageRef(param, image, "auto")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        raise bad_request(f"'{param}.image_url' must be an object with a 'url' string", f"{param}.image_url")
    detail = image.get("detail", "auto")
    if detail not in DETAILS:
        raise bad_request(f"'{param}.image_url.detail' must be one of {', '.join(DETAILS)}, got {detail!r}",
                          f"{param}.image_url.detail")
    unknown = sorted(set(image) - {"url", "detail"})
    if unknown:
        raise bad_request(f"unknown field(s) in '{param}.image_url': {', '.join(unknown)}", f"{param}.image_url")
    return ImageRef(param, image["url"], detail)
