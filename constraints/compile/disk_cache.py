"""On-disk cache of compile payloads, shared by processes and restarts.

An entry is exactly what a compile worker returned for the winning attempt (the payload its
backend's ``load()`` takes) plus the backend's name, so a server restarted or a replica beside it
loads a big schema without compiling it again. Entries are pickles: the directory must be the
operator's own (anyone who can write there can run code in the server). Unreadable or corrupt
entries are misses and are removed; writes are atomic (temp file + ``os.replace``), so several
processes may write the same key at once. The directory is bounded in bytes by evicting the
least recently used entries (by mtime, touched on every hit).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

# bump when an entry's layout or a payload class (e.g. DFATables) changes incompatibly
CACHE_FORMAT = 1
_MAGIC = b"TRLSCC1\n"
_SUFFIX = ".entry"
_STALE_TMP_S = 3600.0  # temp files this old were left by a crashed writer
_LIBRARIES = ("xgrammar", "llguidance", "outlines_core")


@functools.cache
def compiler_digest() -> str:
    """A digest of the ``constraints`` package's source, every subpackage included: a payload
    depends on how Trellis rewrote the spec before a backend saw it (a fixed rewrite must not be
    served from an entry made before)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries whose objects payloads hold or are built from, and
    the digest of the Trellis compiler that rewrote the spec."""
    versions = {"trellis-constraints": compiler_digest()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def entry_key(fingerprint: str, spec_key: str, versions: dict[str, str]) -> str:
    """Hex key of a spec's entry for one tokenizer under these library versions and this format."""
    material = [CACHE_FORMAT, versions, fingerprint, spec_key]
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode("utf-8", "surrogatepass")).hexdigest()


class DiskCache:
    """A directory of ``<key>.entry`` files, each ``(key, backend, payload)`` pickled behind a
    checksum; thread-safe and multi-process safe. Never raises on I/O: failures are counted."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.versions = library_versions()  # read once: metadata lookups scan sys.path
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.errors = 0
        self._lock = threading.Lock()  # guards the counters only

    def key(self, fingerprint: str, spec_key: str) -> str:
        """The entry key of a spec (canonical ``spec_key``) for a tokenizer ``fingerprint``."""
        return entry_key(fingerprint, spec_key, self.versions)

    def path(self, key: str) -> Path:
        return self.directory / (key + _SUFFIX)

    def get(self, key: str) -> tuple[str, Any] | None:
        """``(backend, payload)`` stored under ``key``, or None (a corrupt entry is removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._count(misses=1)
            return None
        except OSError:
            self._count(misses=1, errors=1)
            return None
        entry = _decode(data, key)
        if entry is None:
            self.discard(key)
            self._count(misses=1, errors=1)
            return None
        _touch(path)
        self._count(hits=1)
        return entry

    def put(self, key: str, backend: str, payload: Any) -> bool:
        """Store an entry atomically, then evict to the byte bound; False when not written."""
        try:
            body = pickle.dumps((key, backend, payload), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            self._count(errors=1)
            return False
        data = _MAGIC + hashlib.sha256(body).digest() + body
        if len(data) > self.max_bytes:
            return False
        tmp = self.directory / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path(key))
        except OSError:
            self._count(errors=1)
            _unlink(tmp)
            return False
        self._count(writes=1)
        self.evict()
        return True

    def discard(self, key: str) -> None:
        """Remove ``key``'s entry (e.g. one whose payload no longer loads)."""
        _unlink(self.path(key))

    def load_failed(self, key: str) -> None:
        """An entry that read fine did not load: drop it and count the hit as an erroring miss."""
        self.discard(key)
        self._count(hits=-1, misses=1, errors=1)

    def evict(self) -> None:
        """Delete least recently used entries until the directory fits ``max_bytes``."""
        entries, total = [], 0
        now = time.time()
        try:
            paths = list(self.directory.iterdir())
        except OSError:
            self._count(errors=1)
            return
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue  # removed by another process meanwhile
            if path.name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_S:
                    _unlink(path)
                continue
            if path.name.endswith(_SUFFIX):
                entries.append((st.st_mtime, st.st_size, path))
                total += st.st_size
        entries.sort()
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            _unlink(path)
            total -= size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "disk_hits": self.hits,
                "disk_misses": self.misses,
                "disk_writes": self.writes,
                "disk_errors": self.errors,
            }

    def _count(self, hits: int = 0, misses: int = 0, writes: int = 0, errors: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.writes += writes
            self.errors += errors


def _decode(data: bytes, key: str) -> tuple[str, Any] | None:
    """The ``(backend, payload)`` in an entry file's bytes, or None when it is not a valid entry
    for ``key`` (truncated, corrupt, from another format, or unpicklable here)."""
    head = len(_MAGIC) + 32
    if len(data) < head or not data.startswith(_MAGIC):
        return None
    body = data[head:]
    if hashlib.sha256(body).digest() != data[len(_MAGIC) : head]:
        return None
    try:
        stored_key, backend, payload = pickle.loads(body)
    except Exception:
        return None
    if stored_key != key or not isinstance(backend, str):
        return None
    return backend, payload


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # evicted by another process meanwhile: the hit still counts


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
