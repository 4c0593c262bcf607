"""Per engine step: the image embedding rows and rotary positions of the scheduled rows.

An image is encoded the first time a prefill step reaches its placeholder span, once for all the
sequences of its request (the rows are kept on the request's :class:`PromptMedia`); a span the
prefix cache already holds is never encoded, and a picture encoded recently is taken from the
:class:`EncoderCache`. Chunked prefill may split a span: each chunk takes its slice of the rows
(not a bidirectional family's: the scheduler keeps its runs whole, and the step tells attention
how far each image token sees).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from server.engine.step_batch import Row
from server.engine.vision.encoder_cache import EncoderCache
from server.engine.vision.media import PromptMedia, StepMedia


class StepVision:
    """The engine's hook for a :class:`~server.engine.vision.runner.VisionRunner`."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.mrope = runner.family.mrope
        self.bidirectional = runner.family.bidirectional_images
        self.images_encoded = 0
        self.encode_s = 0.0
        self.cache = EncoderCache()

    def position_offsets(self, seqs: list) -> list[int] | None:
        """Per row, the M-RoPE delta of its sequence (None when every row's is 0)."""
        if not self.mrope:
            return None
        offsets = [seq.request.media.rope_delta if seq.request.media is not None else 0 for seq in seqs]
        return offsets if any(offsets) else None

    def step_media(self, seqs: list, rows: list[Row], device: torch.device) -> StepMedia | None:
        """The step's image rows and positions; None when no row reads an image or an M-RoPE prompt
        position (a plain text step)."""
        index: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        limits: list[list[int] | None] = []  # per row, its tokens' last visible positions (None: causal)
        reads_prompt = False
        flat = 0
        for seq, (_, new, start) in zip(seqs, rows, strict=True):
            media: PromptMedia | None = seq.request.media
            prompt_len = len(seq.request.prompt_token_ids)
            row_limits = None
            if media is not None and start < prompt_len:
                reads_prompt = True
                for image, first, row, count in media.pieces_in(start, min(start + len(new), prompt_len)):
                    rows_of_image = self._encoded(media, image)
                    embeds.append(rows_of_image[row : row + count])
                    index.append(torch.arange(count) + (flat + first - start))
                if self.bidirectional:
                    row_limits = media.visible_until(start, start + len(new))
            limits.append(row_limits)
            flat += len(new)
        if not reads_prompt:
            return None
        step = StepMedia()
        if any(row_limits is not None for row_limits in limits):
            step.visible_until = self._visible_until(rows, limits).to(device)
        if index:
            step.index = torch.cat(index).to(device)
            step.embeds, step.extra = self.runner.family.step_inputs(torch.cat(embeds), step.index, flat)
        if self.mrope:
            step.positions = self._positions(seqs, rows).to(device)
        return step

    @staticmethod
    def _visible_until(rows: list[Row], limits: list[list[int] | None]) -> torch.Tensor:
        """[N] int32: each token's last visible key position (its own unless ``limits`` says)."""
        flat: list[int] = []
        for (_, new, start), row_limits in zip(rows, limits, strict=True):
            flat.extend(row_limits if row_limits is not None else range(start, start + len(new)))
        return torch.tensor(flat, dtype=torch.int32)

    def _encoded(self, media: PromptMedia, image: int) -> torch.Tensor:
        rows = media.encoded[image]
        if rows is None:
            picture = media.images[image]
            rows = self.cache.get(picture.digest)
            if rows is None:
                rows = self._encode(picture)
                self.cache.put(picture.digest, rows)
            media.encoded[image] = rows
        return rows

    def _encode(self, picture) -> torch.Tensor:
        started = time.perf_counter()
        rows = self.runner.encode_image(picture.pixels)
        if rows.shape[0] != picture.length:
            raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {picture.length} tokens")
        self.images_encoded += 1
        self.encode_s += time.perf_counter() - started
        return rows

    def _positions(self, seqs: list, rows: list[Row]) -> torch.Tensor:
        """[3, N]: prompt positions from the prompt's M-RoPE table, later ones index + delta."""
        parts = []
        for seq, (_, new, start) in zip(seqs, rows, strict=True):
            media: PromptMedia | None = seq.request.media
            indices = np.arange(start, start + len(new))
            if media is None or media.positions is None:
                parts.append(np.broadcast_to(indices, (3, len(new))))
                continue
            table = media.positions.numpy()
            prompt_len = table.shape[1]
            inside = indices < prompt_len
            row = np.empty((3, len(new)), dtype=np.int64)
            row[:, inside] = table[:, indices[inside]]
            row[:, ~inside] = indices[~inside] + media.rope_delta
            parts.append(row)
        return torch.from_numpy(np.concatenate(parts, axis=1).astype(np.int64))
