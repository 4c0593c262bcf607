"""What a request carries about its images, and what one engine step hands the runner."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

# Prompt positions inside an image span hold *virtual* token ids in the engine's KV bookkeeping:
# negative, distinct per image content and offset, so prefix-cache keys follow the image, not the
# placeholder token every image shares. -1 is the engine's "sampled, still on the device" marker.
_VIRTUAL_BASE = 2
_VIRTUAL_SPAN = 2**62


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: where its embedding rows go, and the processor's tensors for it alone.

    ``runs``: (first prompt index, count) of each run of placeholder tokens, in embedding-row
    order (one run for most families; one per tile row where the expansion interleaves markers)."""

    runs: tuple[tuple[int, int], ...]
    pixels: dict[str, torch.Tensor]  # the image processor's outputs for this image
    digest: str  # the decoded picture's content hash and how it was processed (its cache key)

    @property
    def length(self) -> int:
        return sum(count for _, count in self.runs)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """A prompt's images (shared by the ``n`` sequences of one request)."""

    images: tuple[ImageInput, ...]
    positions: torch.Tensor | None = None  # [3, P] M-RoPE positions of the prompt; None: 1-D positions
    rope_delta: int = 0  # M-RoPE: a text position after the prompt is its index plus this
    # each run of image tokens attends bidirectionally within itself (Gemma 3): a prompt token of a
    # run sees the run's last key, so a step must hold whole runs (:meth:`whole_runs`)
    bidirectional: bool = False
    # one embedding tensor per image once encoded (written by the engine thread only)
    encoded: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.encoded:
            self.encoded.extend([None] * len(self.images))

    @property
    def num_image_tokens(self) -> int:
        return sum(image.length for image in self.images)

    def cache_ids(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` with every image position replaced by its virtual id (prefix-cache keys)."""
        ids = list(prompt_ids)
        for image in self.images:
            seed = int(hashlib.sha256(image.digest.encode()).hexdigest()[:15], 16)
            row = 0
            for first, count in image.runs:
                for offset in range(count):
                    ids[first + offset] = -(_VIRTUAL_BASE + (seed + row) % _VIRTUAL_SPAN)
                    row += 1
        return ids

    def image_runs(self) -> list[tuple[int, int]]:
        """[first, end) of every run of image tokens, in prompt order."""
        return [(first, first + count) for image in self.images for first, count in image.runs]

    def whole_runs(self, start: int, take: int) -> int:
        """How many prompt tokens from ``start`` a prefill chunk of ``take`` tokens takes so that it
        does not end inside a bidirectional run: cut back to the run's first token, or (a run that
        began before or at ``start``) carried on to its end. ``take`` itself without
        :attr:`bidirectional`."""
        if not self.bidirectional:
            return take
        stop = start + take
        for first, end in self.image_runs():
            if first < stop < end:
                return first - start if first > start else end - start
        return take

    def visible_until(self, start: int, stop: int) -> list[int] | None:
        """Per token of the range [start, stop): the last position it sees (its own, or for a
        token of a bidirectional run, the run's last); None when no token of it sees further."""
        if not self.bidirectional:
            return None
        limits = None
        for first, end in self.image_runs():
            lo, hi = max(start, first), min(stop, end)
            if hi - lo > 0 and lo < end - 1:  # some token of the run sees past itself
                if limits is None:
                    limits = list(range(start, stop))
                limits[lo - start : hi - start] = [end - 1] * (hi - lo)
        return limits

    def pieces_in(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """(image index, first prompt index, first embedding row, count) of every placeholder run
        piece inside the prompt range [start, stop)."""
        out = []
        for index, image in enumerate(self.images):
            if image.end <= start or image.start >= stop:
                continue
            row = 0
            for first, count in image.runs:
                lo, hi = max(start, first), min(stop, first + count)
                if lo < hi:
                    out.append((index, lo, row + lo - first, hi - lo))
                row += count
        return out


@dataclass
class StepMedia:
    """One step's image inputs: embedding rows to write over the step's tokens, and the step's
    M-RoPE positions where a row reads prompt positions that are not 1-D, and (a bidirectional
    family) how far each of the step's tokens sees."""

    index: torch.Tensor | None = None  # [M] flat token indices of the step that take an embedding
    embeds: torch.Tensor | None = None  # [M, D]
    positions: torch.Tensor | None = None  # [3, N]
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific language-model inputs
    # [N] int32: each token's last visible key position (PagedAttentionMetadata.visible_until); None: causal
    visible_until: torch.Tensor | None = None
