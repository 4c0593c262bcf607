"""Bounded HTTP(S) fetching of media URLs.

Only hosts on the allow-list are contacted, checked again on every redirect hop (at most
``max_redirects`` of them); the whole fetch, redirects included, runs under one wall-clock timeout;
the body is streamed and refused as soon as it would pass the byte cap (a ``Content-Length`` over the
cap is refused before reading); nothing is taken from the environment (no proxies, no netrc:
``trust_env=False``). The allow-list names hosts, not addresses: a listed name that resolves to an
internal address is still fetched, so list only hosts you trust.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_ACCEPT = "image/png, image/jpeg, image/webp, image/gif"


class FetchError(Exception):
    """A fetch the client should hear about: ``message`` is one line, fit to show as-is."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


def normalize_host(host: str) -> str:
    """Lower case, no trailing dot, no IPv6 brackets: the form allow-list entries and URLs are compared in."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _url_hosts(url: httpx.URL) -> set[str]:
    """The URL's host as written (Unicode) and in its ASCII (IDNA) form, normalized."""
    hosts = {normalize_host(url.host)}
    try:
        hosts.add(normalize_host(url.raw_host.decode("ascii")))
    except UnicodeDecodeError:
        pass
    return hosts


def _parse(url: str) -> httpx.URL:
    try:
        return httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise FetchError(f"the image URL is not a valid URL: {exc}") from None


def _check_hop(url: httpx.URL, allowed: frozenset[str], *, redirected: bool) -> str:
    where = "the image URL redirected to" if redirected else "the image URL has"
    if url.scheme not in ("http", "https"):
        raise FetchError(f"{where} scheme '{url.scheme}'; only http and https URLs are fetched")
    if not url.host:
        raise FetchError(f"{where} no host")
    hosts = _url_hosts(url)
    host = normalize_host(url.host)
    if not hosts & allowed:
        subject = f"the image URL redirected to host '{host}'" if redirected else f"host '{host}'"
        raise FetchError(f"{subject} is not in the allowed media domains (--allowed-media-domains)")
    return host


async def fetch_bounded(
    url: str,
    *,
    allowed_domains: Iterable[str],
    max_bytes: int,
    timeout_s: float,
    max_redirects: int = 3,
) -> bytes:
    """The body of a ``200`` answer to ``GET url``; :class:`FetchError` for anything else (a host off
    the allow-list at any hop, more than ``max_redirects`` redirects, a non-200 status, a transport
    error, the timeout, a body over ``max_bytes``, a compressed body)."""
    allowed = frozenset(normalize_host(d) for d in allowed_domains if d.strip())
    try:
        async with asyncio.timeout(timeout_s):
            return await _fetch(_parse(url), allowed, max_bytes, timeout_s, max_redirects)
    except TimeoutError:
        raise FetchError(f"fetching the image timed out after {timeout_s:g}s") from None


async def _fetch(
    url: httpx.URL, allowed: frozenset[str], max_bytes: int, timeout_s: float, max_redirects: int
) -> bytes:
    headers = {"Accept": _ACCEPT, "Accept-Encoding": "identity", "User-Agent": "trellis-media-fetch"}
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=httpx.Timeout(timeout_s), headers=headers
    ) as client:
        redirects = 0
        while True:
            host = _check_hop(url, allowed, redirected=redirects > 0)
            try:
                async with client.stream("GET", url) as response:
                    status = response.status_code
                    if status in REDIRECT_STATUSES:
                        location = response.headers.get("location")
                        if not location:
                            raise FetchError(f"fetching the image from '{host}' failed: HTTP {status} without Location")
                        if redirects >= max_redirects:
                            raise FetchError(f"fetching the image from '{host}' failed: over {max_redirects} redirects")
                        try:
                            url = url.join(location)
                        except (httpx.InvalidURL, ValueError) as exc:
                            raise FetchError(f"fetching the image from '{host}' failed: bad redirect ({exc})") from None
                        redirects += 1
                        continue
                    if status != 200:
                        raise FetchError(f"fetching the image from '{host}' failed: HTTP {status}")
                    return await _read_capped(response, host, max_bytes)
            except httpx.TimeoutException:
                raise FetchError(f"fetching the image from '{host}' timed out after {timeout_s:g}s") from None
            except httpx.HTTPError as exc:
                detail = str(exc) or type(exc).__name__
                raise FetchError(f"fetching the image from '{host}' failed: {detail}") from None


async def _read_capped(response: httpx.Response, host: str, max_bytes: int) -> bytes:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise FetchError(f"fetching the image from '{host}' failed: compressed bodies ({encoding}) are not accepted")
    too_large = f"the image from '{host}' is larger than the {max_bytes} byte limit"
    declared = response.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise FetchError(too_large, too_large=True)
    body = bytearray()
    async for chunk in response.aiter_raw():
        if len(body) + len(chunk) > max_bytes:
            raise FetchError(too_large, too_large=True)
        body += chunk
    return bytes(body)
