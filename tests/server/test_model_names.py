"""Models named as people name them: hub ids (with a revision, or one GGUF file of a repository)
read from huggingface_hub's standard cache, `trellis download`, and the refusal of quantized
checkpoint formats the engine does not load. No network: the hub is offline in tests, so every
hub id is resolved from a cache the test writes in the standard layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.cli import build_parser, serve_settings
from server.config import Settings
from server.model_loader import (ModelLoadError, _dequantized_bytes, check_quantization, default_gguf_path,
                                 hub_model, resolve_model)

MAIN = "a" * 40
V2 = "b" * 40
GGUF_COMMIT = "c" * 40


def _add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path], refs: tuple[str, ...]) -> Path:
    """One snapshot in huggingface_hub's layout: models--org--name/snapshots/<commit>/ (files as
    links, as the hub's blobs are) and refs/<ref> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        (snapshot / name).symlink_to(source)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir) -> Path:
    """org/tiny at main (commit MAIN) and at tag v2 (commit V2)."""
    cache = tmp_path / "hub"
    files = {f.name: f for f in tiny_model_dir.iterdir()}
    _add_snapshot(cache, "org/tiny", MAIN, files, ("main",))
    _add_snapshot(cache, "org/tiny", V2, files, ("v2",))
    return cache


def test_hub_id_resolves_from_the_cache_and_is_the_served_name(hub_cache):
    source = resolve_model("org/tiny", download_dir=str(hub_cache))
    assert source.directory == hub_cache / "models--org--tiny" / "snapshots" / MAIN
    assert source.name == "org/tiny"


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_as_a_ref_or_a_commit(hub_cache, revision):
    source = resolve_model("org/tiny", revision=revision, download_dir=str(hub_cache))
    assert source.directory == hub_cache / "models--org--tiny" / "snapshots" / V2


def test_missing_id_or_revision_is_one_line_naming_id_revision_and_cache(hub_cache):
    for spec, revision in (("org/absent", ""), ("org/tiny", "v9")):
        with pytest.raises(ModelLoadError) as error:
            resolve_model(spec, revision=revision, download_dir=str(hub_cache))
        message = str(error.value)
        assert "\n" not in message
        assert spec in message and (revision or "main") in message and str(hub_cache) in message
        assert "offline" in message


def test_gguf_file_of_a_repository(tmp_path, default_dir):
    gguf = default_gguf_path()
    cache = tmp_path / "hub"
    _add_snapshot(cache, "org/smol-gguf", GGUF_COMMIT, {gguf.name: gguf}, ("main",))
    named = resolve_model(f"org/smol-gguf:{gguf.name}", download_dir=str(cache))
    flagged = resolve_model("org/smol-gguf", gguf_file=gguf.name, download_dir=str(cache))
    # The same file (name and size) converts to the same directory as the embedded default model.
    assert named.directory == flagged.directory == default_dir
    assert named.name == "org/smol-gguf"
    with pytest.raises(ModelLoadError, match="org/smol-gguf:other.gguf at revision main"):
        resolve_model("org/smol-gguf:other.gguf", download_dir=str(cache))


def test_hub_id_forms():
    assert hub_model("./org/name") is None and hub_model("/abs/org/name") is None
    assert hub_model("org/name:f.gguf").gguf_file == "f.gguf"
    with pytest.raises(ModelLoadError, match=r"\.gguf"):
        hub_model("org/name:weights.bin")
    with pytest.raises(ModelLoadError, match="two GGUF files"):
        hub_model("org/name:a.gguf", gguf_file="b.gguf")


def test_local_forms_keep_working(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)).directory == tiny_model_dir
    with pytest.raises(ModelLoadError, match="names a hub revision"):
        resolve_model(str(tiny_model_dir), revision="v2")


def _serve_settings(*argv: str) -> Settings:
    return serve_settings(build_parser().parse_args(["serve", *argv]))


def test_positional_model_and_flag_agree(monkeypatch):
    options = ("--revision", "v2", "--download-dir", "/tmp/hub", "--gguf-file", "m.gguf")
    positional = _serve_settings("org/name", *options)
    assert positional == _serve_settings("--model", "org/name", *options)
    assert (positional.model, positional.revision, positional.download_dir, positional.gguf_file) == (
        "org/name", "v2", "/tmp/hub", "m.gguf")
    assert _serve_settings("--port", "9000", "org/name").model == "org/name"
    with pytest.raises(SystemExit):
        _serve_settings("org/name", "--model", "org/other")
    monkeypatch.setenv("TRELLIS_MODEL", "org/from-env")
    assert _serve_settings("org/name").model == "org/name"
    assert _serve_settings().model == "org/from-env"


def test_serve_resolves_the_hub_id_at_its_revision_in_the_download_dir(tmp_path, hub_cache):
    from server.state import build_state

    awq = _quantized_dir(tmp_path, "awq")
    _add_snapshot(hub_cache, "org/tiny", "d" * 40, {"config.json": awq / "config.json"}, ("awq",))
    # build_state finds the snapshot of that revision in that cache, and refuses the AWQ checkpoint there.
    with pytest.raises(ModelLoadError, match="awq-quantized"):
        build_state(Settings(model="org/tiny", revision="awq", download_dir=str(hub_cache), device="cpu"))


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], check=False, capture_output=True, text=True,
                          timeout=120, env=env)


def test_download_with_the_hub_offline_says_so_in_one_line(hub_cache):
    missing = _cli("download", "org/absent", cache=hub_cache)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "offline" in missing.stderr and "org/absent" in missing.stderr and str(hub_cache) in missing.stderr
    cached = _cli("download", "org/tiny", "--revision", "v2", cache=hub_cache)
    assert cached.returncode == 0 and cached.stderr.count("\n") == 1
    assert "offline" in cached.stderr and V2 in cached.stderr


def test_serve_missing_hub_id_is_one_line_error(hub_cache):
    result = _cli("serve", "org/absent", "--revision", "v3", cache=hub_cache)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "org/absent" in result.stderr and "v3" in result.stderr and str(hub_cache) in result.stderr


def _quantized_dir(tmp_path: Path, method: str, model_type: str = "llama") -> Path:
    directory = tmp_path / f"{model_type}-{method}"
    directory.mkdir()
    config = {"model_type": model_type, "quantization_config": {"quant_method": method}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "hqq", "mxfp4"])  # FP8 loads: test_fp8_weights.py
def test_quantized_checkpoints_are_refused_naming_the_format(tmp_path, method):
    from server.state import build_state

    directory = _quantized_dir(tmp_path, method)
    with pytest.raises(ModelLoadError) as error:
        build_state(Settings(model=str(directory), device="cpu"))
    assert f"{method}-quantized" in str(error.value) and "\n" not in str(error.value)


def test_gpt_oss_mxfp4_is_dequantized_on_the_cpu_with_its_memory_cost(tmp_path, tiny_model_dir):
    from safetensors.torch import save_file

    directory = _quantized_dir(tmp_path, "mxfp4", model_type="gpt_oss")
    save_file({"experts.down_proj_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8),
               "experts.down_proj_scales": torch.zeros(2, 4, 1, dtype=torch.uint8),
               "norm.weight": torch.zeros(16, dtype=torch.bfloat16)}, directory / "model.safetensors")
    # 2 FP4 values per block byte, scales folded in, plain tensors as they are: 256 + 16 values.
    assert _dequantized_bytes(directory, 4) == ((directory / "model.safetensors").stat().st_size, 272 * 4)
    line = check_quantization(directory, torch.device("cpu"), torch.float32)
    assert "dequantized" in line and "GiB in float32" in line
    assert check_quantization(tiny_model_dir, torch.device("cpu"), torch.float32) is None  # not quantized
