"""Image embedding rows kept by content, so a picture sent again skips the vision tower.

The prefix cache already skips whatever full KV blocks of a re-sent image it holds; but an image
span rarely ends on a block boundary, and the rows of its last, partly filled block still need
the image's embeddings. Without this cache that means the whole tower again for a few rows.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_MAX_BYTES = 256 * 2**20


class EncoderCache:
    """Least-recently-used ``key -> rows`` within ``max_bytes`` (the key names the picture and how
    it was processed: :attr:`ImageInput.digest`)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
            self.hits += 1
        return rows

    def put(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or key in self._rows:
            return
        self._rows[key] = rows
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, evicted = self._rows.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()
