"""Loading the images of OpenAI ``image_url`` content parts, safe against hostile inputs.

A part's ``url`` is a ``data:image/...;base64,`` URL or, when the operator allows its host, an
http(s) URL (see :mod:`server.vision.fetch`). Every refusal is a 400 :class:`~server.errors.APIError`
naming the request field. The checks, in order:

* the encoded size, from the base64 length before decoding it (or while streaming a fetched body);
* the media type (PNG, JPEG, WebP, GIF); only those Pillow decoders are ever tried, whatever the
  declared type, so no other (rarer, riskier) decoder sees client bytes;
* the pixel count, from the header alone (``Image.open`` reads no pixel data), so an oversized
  picture or a decompression bomb never has its pixels allocated. Pillow's own bomb check runs in
  ``Image.open`` too, with the process-wide ``Image.MAX_IMAGE_PIXELS``: its warning is turned into an
  error here and both become 400s, but the limit that counts is :attr:`MediaLimits.max_image_pixels`;
* the decode itself, with truncated data refused (``ImageFile.LOAD_TRUNCATED_IMAGES`` is never set),
  in a thread of the loader's own pool, at most ``max_concurrent_decodes`` at once, each bounded by
  ``decode_timeout_s`` of wall-clock time; the event loop never decodes.

Animated images give their first frame; EXIF orientation is applied; images with transparency are
composited on white before the conversion to RGB.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import logging
import re
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import ExifTags, Image, ImageFile, ImageOps

from server.errors import APIError, bad_request
from server.vision.fetch import FetchError, fetch_bounded

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("trellis")

# Declared media types of data: URLs; image/jpg is a common misspelling of image/jpeg.
MEDIA_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"})
# The only Pillow decoders client bytes reach, whatever a data: URL or a server declares.
PIL_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_REDIRECTS = 3

_WHITESPACE = re.compile(r"\s+")
# warnings.catch_warnings changes process-wide state; serialize the (header-only, quick) opens that use it.
_WARNINGS_LOCK = threading.Lock()


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 20 * 1024 * 1024  # encoded size (data: URL payload or fetched body)
    max_image_pixels: int = 40_000_000  # width*height from the header, before decoding
    decode_timeout_s: float = 10.0  # wall-clock bound on one decode
    fetch_timeout_s: float = 10.0  # http(s) fetch bound, redirects included
    allowed_domains: tuple[str, ...] = ()  # http(s) hosts that may be fetched; empty = no URL fetching at all
    max_concurrent_decodes: int = 2  # decode threads at once

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_concurrent_decodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaLimits.{name} must be at least 1")
        for name in ("decode_timeout_s", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MediaLimits.{name} must be positive")


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # fully decoded, RGB, EXIF orientation applied
    digest: str  # sha256 hex of mode, size and pixels: equal pixels give equal digests, whatever the encoding
    num_bytes: int  # encoded bytes received
    seconds: float  # time spent fetching + decoding (not waiting for a decode slot)


class ImageError(Exception):
    """A refusal from the decoding thread, turned into a 400 by :meth:`ImageLoader.load`."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class _Abandoned(Exception):
    """The waiting request gave up (timeout or cancellation): stop at the next step."""


def content_digest(images: Sequence[LoadedImage]) -> int:
    """A stable 63-bit int from the images' digests, in order (for prefix-cache keys); 0 for none."""
    if not images:
        return 0
    h = hashlib.sha256()
    for item in images:
        h.update(item.digest.encode("ascii"))
        h.update(b";")
    return int.from_bytes(h.digest()[:8], "big") >> 1


def pixel_digest(image: Image.Image) -> str:
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode("ascii"))
    h.update(image.tobytes())
    return h.hexdigest()


def _open_header(data: bytes) -> Image.Image:
    """``Image.open`` (the header only) with Pillow's bomb warning made an error, restricted to PIL_FORMATS."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data), formats=PIL_FORMATS)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def _decode(data: bytes, limits: MediaLimits, abandoned: threading.Event) -> tuple[Image.Image, str]:
    """Decode ``data`` to an RGB image and its digest, in a worker thread; :class:`ImageError` on refusal."""

    def step() -> None:
        if abandoned.is_set():
            raise _Abandoned

    if ImageFile.LOAD_TRUNCATED_IMAGES:  # set process-wide by someone else: truncated data would pass silently
        raise ImageError("image decoding is misconfigured on this server (truncated images allowed)", "internal_error")
    try:
        image = _open_header(data)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image has too many pixels ({exc})", "image_too_large") from None
    except Image.UnidentifiedImageError:
        raise ImageError("the data is not a PNG, JPEG, WebP or GIF image", "invalid_image_format") from None
    except Exception as exc:  # noqa: BLE001 - malformed headers raise all sorts (SyntaxError, struct.error, ...)
        raise ImageError(f"the image header is malformed ({type(exc).__name__})", "invalid_image_format") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError(f"the image has an empty size ({width}x{height})", "invalid_image_format")
        if width * height > limits.max_image_pixels:
            raise ImageError(
                f"the image is {width}x{height} = {width * height} pixels; the limit is {limits.max_image_pixels}",
                "image_too_large",
            )
        step()
        try:
            image.load()  # the first frame of an animated image
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"the image has too many pixels ({exc})", "image_too_large") from None
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt data: OSError, SyntaxError, ValueError, ...
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ImageError(f"the image data is truncated or corrupt ({detail})", "image_parse_error") from None
        step()
        oriented = image
        try:
            if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
                oriented = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - a malformed EXIF block: keep the picture as stored
            oriented = image
        try:
            rgb = _to_rgb(oriented)
        except Exception as exc:  # noqa: BLE001 - an exotic pixel mode is the client's problem
            raise ImageError(f"the image's pixel mode {oriented.mode} cannot be converted to RGB ({exc})",
                             "invalid_image_format") from None
        if rgb is image:  # detach from the file object closed on leaving the block
            rgb = image.copy()
    step()
    return rgb, pixel_digest(rgb)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class ImageLoader:
    """Loads ``image_url`` parts under :class:`MediaLimits`; owns a small decode thread pool."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self._executor = ThreadPoolExecutor(
            max_workers=limits.max_concurrent_decodes, thread_name_prefix="trellis-image-decode"
        )
        # Held from submission until the decode thread really ends (not when a waiter times out), so
        # runaway decodes count against max_concurrent_decodes and a timer never runs on a queued job.
        self._slots = asyncio.Semaphore(limits.max_concurrent_decodes)
        if ImageFile.LOAD_TRUNCATED_IMAGES:
            log.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set process-wide; image inputs will be refused")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def load(self, url: str, *, param: str) -> LoadedImage:
        """Fetch or decode the ``url`` of an ``image_url`` part; a 400 APIError with ``param`` on refusal."""
        if not isinstance(url, str) or not url.strip():
            raise bad_request("the image URL is empty", param, code="invalid_image_url")
        url = url.strip()
        scheme = url.partition(":")[0].lower() if ":" in url[:16] else ""
        started = time.perf_counter()
        if scheme == "data":
            data = self._data_url_bytes(url, param)
        elif scheme in ("http", "https"):
            data = await self._fetch(url, param)
        else:
            got = f"scheme '{_short(scheme, 16)}'" if scheme else f"'{_short(url)}'"
            raise bad_request(
                f"the image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL; got {got}",
                param, code="invalid_image_url",
            )
        fetch_seconds = time.perf_counter() - started
        image, digest, decode_seconds = await self._decode(data, param)
        return LoadedImage(image=image, digest=digest, num_bytes=len(data), seconds=fetch_seconds + decode_seconds)

    def _data_url_bytes(self, url: str, param: str) -> bytes:
        comma = url.find(",")
        if comma < 0:
            raise bad_request("the image data URL is malformed: no ',' before the data", param,
                              code="invalid_image_url")
        header = url[5:comma].split(";")
        media_type = header[0].strip().lower()
        if media_type not in MEDIA_TYPES:
            shown = f"'{_short(media_type)}'" if media_type else "none"
            raise bad_request(
                f"unsupported image media type {shown}; use image/png, image/jpeg, image/webp or image/gif",
                param, code="invalid_image_format",
            )
        if header[-1].strip().lower() != "base64":
            raise bad_request("the image data URL must be base64-encoded (data:image/png;base64,...)", param,
                              code="invalid_image_url")
        # The size check comes before any decoding: the payload's base64 length bounds the bytes it holds.
        length = len(url) - comma - 1
        padding = (url[-1] == "=") + (url[-2:] == "==") if length else 0
        encoded_bytes = length * 3 // 4 - padding
        if encoded_bytes > self.limits.max_image_bytes:
            raise bad_request(
                f"the image is about {encoded_bytes} bytes; the limit is {self.limits.max_image_bytes}",
                param, code="image_too_large",
            )
        payload = url[comma + 1:]
        if not payload:
            raise bad_request("the image data URL has no data", param, code="invalid_image_url")
        try:
            if not payload.isascii():
                raise ValueError("non-ASCII character")
            if _WHITESPACE.search(payload):  # MIME-style line breaks are tolerated
                payload = _WHITESPACE.sub("", payload)
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(f"the image data URL is not valid base64 ({exc})", param,
                              code="invalid_image_url") from None

    async def _fetch(self, url: str, param: str) -> bytes:
        limits = self.limits
        if not limits.allowed_domains:
            raise bad_request(
                "fetching image URLs is disabled on this server; send the image as a base64 data: URL, "
                "or start the server with --allowed-media-domains HOST to allow fetching from HOST",
                param, code="invalid_image_url",
            )
        try:
            return await fetch_bounded(
                url,
                allowed_domains=limits.allowed_domains,
                max_bytes=limits.max_image_bytes,
                timeout_s=limits.fetch_timeout_s,
                max_redirects=MAX_REDIRECTS,
            )
        except FetchError as exc:
            code = "image_too_large" if exc.too_large else "invalid_image_url"
            raise bad_request(exc.message, param, code=code) from None

    async def _decode(self, data: bytes, param: str) -> tuple[Image.Image, str, float]:
        loop = asyncio.get_running_loop()
        abandoned = threading.Event()
        await self._slots.acquire()
        try:
            job: Future = self._executor.submit(_timed_decode, data, self.limits, abandoned)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: _release_on(loop, self._slots))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.limits.decode_timeout_s)
        except TimeoutError:
            raise bad_request(
                f"decoding the image took longer than {self.limits.decode_timeout_s:g}s", param,
                code="image_decode_timeout",
            ) from None
        except ImageError as exc:
            if exc.code == "internal_error":
                raise APIError(exc.message, status=500, code=exc.code) from None
            raise bad_request(exc.message, param, code=exc.code) from None
        finally:
            abandoned.set()  # a decode still running stops at its next step


def _timed_decode(data: bytes, limits: MediaLimits, abandoned: threading.Event) -> tuple[Image.Image, str, float]:
    started = time.perf_counter()
    image, digest = _decode(data, limits, abandoned)  # looked up at call time (tests replace it)
    return image, digest, time.perf_counter() - started


def _release_on(loop: asyncio.AbstractEventLoop, slots: asyncio.Semaphore) -> None:
    try:
        loop.call_soon_threadsafe(slots.release)
    except RuntimeError:  # the loop is closed: nobody waits on its semaphore any more
        pass
