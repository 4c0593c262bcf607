"""Loading image_url parts: data: URLs, allow-listed fetches, and refusals of hostile inputs."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image, ImageFile

from server.errors import APIError
from server.vision import images
from server.vision.images import ImageLoader, LoadedImage, MediaLimits, content_digest

PARAM = "messages[0].content[1].image_url.url"


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def picture(width: int = 48, height: int = 32) -> Image.Image:
    """A small RGB picture with structure (so lossy and lossless encodings differ)."""
    image = Image.new("RGB", (width, height))
    image.putdata([((x * 5) % 256, (y * 7) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    return image


def load(url: str, limits: MediaLimits | None = None, param: str = PARAM) -> LoadedImage:
    async def go() -> LoadedImage:
        loader = ImageLoader(limits or MediaLimits())
        try:
            return await loader.load(url, param=param)
        finally:
            loader.close()

    return asyncio.run(go())


def refused(url: str, limits: MediaLimits | None = None, *, match: str, code: str | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        load(url, limits)
    error = info.value
    assert error.status == 400, error.message
    assert error.param == PARAM
    assert match.lower() in error.message.lower(), error.message
    assert "\n" not in error.message
    if code is not None:
        assert error.code == code
    return error


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bilevel_png(width: int, height: int) -> bytes:
    """A valid all-black 1-bit PNG built row by row: a few KB that decode to width*height pixels."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    def forbidden(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", forbidden)


# ---- valid images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                            ("GIF", "image/gif")])
def test_valid_formats(fmt, media_type):
    data = encode(picture(), fmt)
    loaded = load(data_url(data, media_type))
    assert loaded.image.size == (48, 32)
    assert loaded.image.mode == "RGB"
    assert loaded.num_bytes == len(data)
    assert len(loaded.digest) == 64 and loaded.seconds >= 0
    loaded.image.load()  # usable after the loader closed its file object
    assert loaded.image.getpixel((3, 2)) is not None


def test_same_pixels_same_digest_whatever_the_encoding():
    image = picture()
    png = encode(image, "PNG")
    first, again = load(data_url(png)), load(data_url(png))
    assert first.digest == again.digest
    other_png = encode(image, "PNG", compress_level=0)
    webp_lossless = encode(image, "WEBP", lossless=True)
    assert other_png != png
    assert load(data_url(other_png)).digest == first.digest
    assert load(data_url(webp_lossless, "image/webp")).digest == first.digest
    assert load(data_url(webp_lossless, "image/webp")).image.tobytes() == image.tobytes()
    jpeg = load(data_url(encode(image, "JPEG", quality=50), "image/jpeg"))
    assert jpeg.digest != first.digest
    flipped = load(data_url(encode(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), "PNG")))
    assert flipped.digest != first.digest


def test_content_digest():
    a, b = load(data_url(encode(picture(), "PNG"))), load(data_url(encode(picture(20, 20), "PNG")))
    assert content_digest([]) == 0
    assert content_digest([a, b]) == content_digest([a, b])
    assert content_digest([a, b]) != content_digest([b, a])
    assert 0 <= content_digest([a]) < 2**63


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: stored 40x20, shown 20x40
    data = encode(picture(40, 20), "JPEG", exif=exif)
    assert load(data_url(data, "image/jpeg")).image.size == (20, 40)


def test_transparency_composited_on_white_and_animation_gives_first_frame():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert load(data_url(encode(rgba, "PNG"))).image.getpixel((0, 0)) == (255, 255, 255)
    frames = [Image.new("RGB", (16, 16), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    loaded = load(data_url(gif, "image/gif"))
    assert loaded.image.mode == "RGB"
    assert loaded.image.getpixel((4, 4)) == (255, 0, 0)
    webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50, lossless=True)
    assert load(data_url(webp, "image/webp")).image.getpixel((4, 4)) == (255, 0, 0)


def test_image_jpg_alias_and_mime_line_breaks():
    data = encode(picture(), "JPEG")
    wrapped = "data:image/jpg;base64," + base64.encodebytes(data).decode("ascii")
    assert "\n" in wrapped
    assert load(wrapped).image.size == (48, 32)


# ---- malformed URLs and data -------------------------------------------------------------------------


@pytest.mark.parametrize("url,match", [
    ("", "empty"),
    ("ftp://example.com/a.png", "scheme 'ftp'"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("just some text", "data: URL"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png,iVBORw0KGgo=", "base64-encoded"),
    ("data:;base64,iVBORw0KGgo=", "media type none"),
    ("data:image/svg+xml;base64,PHN2Zy8+", "unsupported image media type 'image/svg+xml'"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image media type"),
    ("data:image/png;base64,", "no data"),
    ("data:image/png;base64,@@not*base64@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
    ("data:image/png;base64,aéb=", "not valid base64"),
])
def test_malformed_urls(url, match):
    refused(url, match=match)


def test_not_an_image():
    refused(data_url(os.urandom(4096)), match="not a PNG, JPEG, WebP or GIF image", code="invalid_image_format")


def test_other_decoders_are_never_tried():
    bmp = encode(picture(), "BMP")  # Pillow reads BMP, but client bytes only reach the four allowed decoders
    refused(data_url(bmp), match="not a PNG, JPEG, WebP or GIF image")
    tiff = encode(picture(), "TIFF")
    refused(data_url(tiff, "image/png"), match="not a PNG, JPEG, WebP or GIF image")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt):
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    data = encode(noise, fmt)
    refused(data_url(data[: len(data) // 2]), match="truncated or corrupt", code="image_parse_error")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_payload_over_the_byte_limit_is_refused_before_base64_decoding():
    limits = MediaLimits(max_image_bytes=1000)
    # Invalid base64 would be reported if it were decoded: the size check must come first.
    refused("data:image/png;base64," + "!" * 2000, limits, match="limit is 1000", code="image_too_large")
    exact = encode(Image.new("RGB", (4, 4)), "PNG")
    assert load(data_url(exact), MediaLimits(max_image_bytes=len(exact))).num_bytes == len(exact)
    refused(data_url(exact), MediaLimits(max_image_bytes=len(exact) - 1), match="limit is")


def test_too_many_pixels_refused_from_the_header(no_pixel_decoding):
    data = bilevel_png(3000, 3000)
    assert len(data) < 50_000
    started = time.perf_counter()
    error = refused(data_url(data), MediaLimits(max_image_pixels=1_000_000),
                    match="3000x3000 = 9000000 pixels; the limit is 1000000", code="image_too_large")
    assert time.perf_counter() - started < 2
    assert error.param == PARAM


def test_decompression_bomb_refused_without_allocating(no_pixel_decoding):
    data = bilevel_png(12000, 12000)  # 144 megapixels in ~20 KB; over Pillow's own warning threshold too
    assert len(data) < 100_000
    started = time.perf_counter()
    refused(data_url(data), match="pixels", code="image_too_large")
    refused(data_url(data), MediaLimits(max_image_pixels=10**12), match="pixels", code="image_too_large")
    assert time.perf_counter() - started < 2


def test_header_only_png_with_huge_size(no_pixel_decoding):
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b""))
            + png_chunk(b"IEND", b""))
    refused(data_url(data), match="pixels", code="image_too_large")


# ---- decoding off the loop -----------------------------------------------------------------------------


def test_decode_timeout(monkeypatch):
    monkeypatch.setattr(images, "_decode", lambda *args: time.sleep(1.0))
    started = time.perf_counter()
    refused(data_url(encode(picture(), "PNG")), MediaLimits(decode_timeout_s=0.05),
            match="longer than 0.05s", code="image_decode_timeout")
    assert time.perf_counter() - started < 0.8


def test_timed_out_decode_keeps_its_slot_until_it_ends(monkeypatch):
    real = images._decode
    calls = []

    def first_slow(*args):
        calls.append(time.perf_counter())
        if len(calls) == 1:
            time.sleep(0.4)
        return real(*args)

    monkeypatch.setattr(images, "_decode", first_slow)
    url = data_url(encode(picture(), "PNG"))

    async def go() -> None:
        loader = ImageLoader(MediaLimits(max_concurrent_decodes=1, decode_timeout_s=0.1))
        with pytest.raises(APIError, match="longer than"):
            await loader.load(url, param=PARAM)
        loaded = await loader.load(url, param=PARAM)  # waits for the runaway decode, then gets its own 0.1 s
        assert loaded.image.size == (48, 32)
        loader.close()

    asyncio.run(go())
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.35


def test_decodes_are_bounded_and_never_block_the_loop(monkeypatch):
    real = images._decode
    active, peak, lock = [0], [0], threading.Lock()

    def slow_decode(*args):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return real(*args)

    monkeypatch.setattr(images, "_decode", slow_decode)
    url = data_url(encode(picture(), "PNG"))

    async def go(limit: int) -> int:
        loader = ImageLoader(MediaLimits(max_concurrent_decodes=limit))
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.005)

        tick = asyncio.create_task(ticker())
        loaded = await asyncio.gather(*(loader.load(url, param=PARAM) for _ in range(6)))
        done = True
        await tick
        loader.close()
        assert len({item.digest for item in loaded}) == 1
        return ticks

    for limit in (1, 2):
        peak[0] = 0
        ticks = asyncio.run(go(limit))
        assert peak[0] == limit
        assert ticks >= 10  # the loop kept running while the threads decoded


def test_limits_are_validated():
    with pytest.raises(ValueError):
        MediaLimits(max_concurrent_decodes=0)
    with pytest.raises(ValueError):
        MediaLimits(decode_timeout_s=0)


# ---- http(s) fetching ------------------------------------------------------------------------------------

PNG_BYTES = encode(picture(), "PNG")


class Handler(BaseHTTPRequestHandler):
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self._send(200, PNG_BYTES)
        elif self.path == "/missing.png":
            self._send(404, b"not here")
        elif self.path == "/redirect-ok":
            self._redirect("/ok.png")
        elif self.path == "/redirect-out":
            self._redirect(f"http://localhost:{port}/ok.png")  # reachable, but not on the allow-list
        elif self.path.startswith("/hop"):
            hops = int(self.path[4:])
            self._redirect(f"/hop{hops - 1}" if hops > 0 else "/ok.png")
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        elif self.path == "/big-streamed":  # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for _ in range(200):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        elif self.path == "/gzip":
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"abcd")
        elif self.path == "/slow":
            Handler.release.wait(3)
            try:
                self._send(200, PNG_BYTES)
            except OSError:
                pass
        else:
            self._send(500, b"?")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def http_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.handle_error = lambda *args: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Handler.release.set()
    server.shutdown()
    server.server_close()


LOCAL = MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=2.0)


def test_fetching_is_off_without_allowed_domains(http_base):
    error = refused(f"{http_base}/ok.png", match="fetching image URLs is disabled")
    assert "--allowed-media-domains" in error.message


def test_host_not_allowed(http_base):
    refused(f"{http_base}/ok.png", MediaLimits(allowed_domains=("example.com",)),
            match="host '127.0.0.1' is not in the allowed media domains")


def test_fetch_ok(http_base):
    loaded = load(f"{http_base}/ok.png", LOCAL)
    assert loaded.image.size == (48, 32) and loaded.num_bytes == len(PNG_BYTES)
    assert loaded.digest == load(data_url(PNG_BYTES)).digest
    assert load(f"{http_base}/redirect-ok", LOCAL).digest == loaded.digest
    assert load(f"{http_base}/hop2", LOCAL).digest == loaded.digest  # 3 redirects: allowed
    dotted = MediaLimits(allowed_domains=("example.com", "127.0.0.1."))  # a trailing dot does not matter
    assert load(f"{http_base}/ok.png", dotted).digest == loaded.digest


def test_fetch_errors(http_base):
    refused(f"{http_base}/missing.png", LOCAL, match="HTTP 404")
    refused(f"{http_base}/hop3", LOCAL, match="over 3 redirects")
    refused(f"{http_base}/redirect-out", LOCAL, match="redirected to host 'localhost'")
    refused(f"{http_base}/gzip", LOCAL, match="compressed bodies")
    refused(f"{http_base}/big-declared", MediaLimits(allowed_domains=("127.0.0.1",), max_image_bytes=100_000),
            match="larger than the 100000 byte limit", code="image_too_large")


def test_fetch_body_cap_while_streaming(http_base):
    started = time.perf_counter()
    refused(f"{http_base}/big-streamed", MediaLimits(allowed_domains=("127.0.0.1",), max_image_bytes=100_000),
            match="larger than the 100000 byte limit", code="image_too_large")
    assert time.perf_counter() - started < 2


def test_fetch_timeout(http_base):
    started = time.perf_counter()
    refused(f"{http_base}/slow", MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.3), match="timed out")
    assert time.perf_counter() - started < 2


def test_connection_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused(f"http://127.0.0.1:{port}/ok.png", LOCAL, match="fetching the image from '127.0.0.1' failed")
