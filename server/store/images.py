"""Image parts of stored messages and items, kept once each by content hash.

A stored chat completion's messages and a conversation's items keep every image part, but never a
``data:`` URL's payload inline: the payload is decoded, its bytes go to the ``images`` table under
their sha256 (once, however many turns or users send them), and the part's URL becomes the reference
``trellis-image:sha256:<64 hex>`` (``detail`` and every other field of the part stay as sent).
http(s) URLs are references already and stay as sent, as does a ``data:`` URL this module cannot read
(no ``type/subtype`` media type, or a payload that is not valid base64): nothing is dropped.

Replaying a conversation into a prompt resolves each reference back into a
``data:<media type>;base64,<payload>`` URL (see ``server.store.store.Tx.all_messages``); the GET
endpoints that list stored messages and items return the reference URLs as stored.

Image parts are ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "<url>"``)
in chat messages and ``{"type": "input_image", "image_url": "<url>"}`` in items, in a message's
content list or in a ``function_call_output``'s output list.

Images are content-addressed and shared, so deleting a completion or a conversation leaves its images
in the table (no collection of unreferenced images yet).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

REFERENCE_PREFIX = "trellis-image:sha256:"
"""An image reference URL is this prefix and the lowercase hex sha256 of the image's bytes."""

THREAD_THRESHOLD = 1 << 20
"""Image payloads (characters or bytes) above which encoding or decoding runs in a worker thread."""

_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,62}/[a-z0-9][a-z0-9!#$&^_.+-]{0,62}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class StoredImage:
    """An image's bytes and the media type its data URL declared."""

    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode('ascii')}"


def reference(digest: str) -> str:
    """The reference URL of the image with sha256 ``digest``."""
    return REFERENCE_PREFIX + digest


def referenced_digest(url: Any) -> str | None:
    """The digest a reference URL names (None for any other value)."""
    if isinstance(url, str) and url.startswith(REFERENCE_PREFIX):
        digest = url[len(REFERENCE_PREFIX):]
        if _DIGEST.fullmatch(digest):
            return digest
    return None


def parse_data_url(url: Any) -> StoredImage | None:
    """The image a ``data:`` URL holds (base64 or percent-encoded payload), or None where ``url`` is
    not such a URL or cannot be read (it is then stored as sent)."""
    if not isinstance(url, str):
        return None
    text = url.strip()
    if text[:5].lower() != "data:":
        return None
    comma = text.find(",")
    if comma < 0:
        return None
    header = text[5:comma].split(";")
    media_type = header[0].strip().lower()
    if not _MEDIA_TYPE.fullmatch(media_type):
        return None
    payload = text[comma + 1:]
    if len(header) > 1 and header[-1].strip().lower() == "base64":
        if not payload.isascii():
            return None
        try:
            data = base64.b64decode(_WHITESPACE.sub("", payload), validate=True)
        except (binascii.Error, ValueError):
            return None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    return StoredImage(media_type, data) if data else None


# --------------------------------------------------------------------------- walking image parts


def _map_part(part: Any, fn: Callable[[str], str]) -> Any:
    if not isinstance(part, dict):
        return part
    kind, image = part.get("type"), part.get("image_url")
    if kind == "image_url" and isinstance(image, dict) and isinstance(image.get("url"), str):
        url = fn(image["url"])
        return part if url is image["url"] else {**part, "image_url": {**image, "url": url}}
    if kind in ("image_url", "input_image") and isinstance(image, str):
        url = fn(image)
        return part if url is image else {**part, "image_url": url}
    return part


def map_content(content: Any, fn: Callable[[str], str]) -> Any:
    """``content`` (a part list, or a ``function_call_output``'s fields) with ``fn`` applied to every
    image part's URL; parts ``fn`` leaves alone are the same objects."""
    if isinstance(content, list):
        return [_map_part(part, fn) for part in content]
    if isinstance(content, dict) and isinstance(content.get("output"), list):
        return {**content, "output": [_map_part(part, fn) for part in content["output"]]}
    return content


def map_message(message: Mapping[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A chat message with ``fn`` applied to every image part's URL in its content."""
    message = dict(message)
    if isinstance(message.get("content"), list):
        message["content"] = map_content(message["content"], fn)
    return message


class Externalizer:
    """Replaces data URLs by references (call it on a URL) and collects their images by digest."""

    def __init__(self) -> None:
        self.images: dict[str, StoredImage] = {}

    def __call__(self, url: str) -> str:
        image = parse_data_url(url)
        if image is None:
            return url
        digest = image.digest
        self.images.setdefault(digest, image)
        return reference(digest)


def inline_size(contents: list[Any], mapper: Callable[[Any, Callable[[str], str]], Any] = map_content) -> int:
    """How many characters of data URLs ``contents`` hold (to choose whether to decode off the loop)."""
    total = 0

    def count(url: str) -> str:
        nonlocal total
        if url[:16].lstrip()[:5].lower() == "data:":
            total += len(url)
        return url

    for content in contents:
        mapper(content, count)
    return total


def digests_in(contents: list[Any], mapper: Callable[[Any, Callable[[str], str]], Any] = map_message) -> set[str]:
    """The digests the reference URLs in ``contents`` name."""
    found: set[str] = set()

    def note(url: str) -> str:
        digest = referenced_digest(url)
        if digest is not None:
            found.add(digest)
        return url

    for content in contents:
        mapper(content, note)
    return found
