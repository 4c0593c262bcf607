"""Everything the request handlers share: model, tokenizer, engine and constraint compiler."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from server.config import Settings
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype
from server.generation import TokenTexts
from server.model_loader import ModelSource, load_tokenizer, resolve_model

log = logging.getLogger("trellis")


@dataclass
class ServerState:
    settings: Settings
    model_name: str
    tokenizer: object
    engine: Engine
    compiler: object | None  # constraints.ConstraintCompiler
    eos_token_ids: frozenset[int]
    token_texts: TokenTexts
    vocab_size: int
    device_dfa: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def close(self) -> None:
        self.engine.shutdown()
        if self.compiler is not None:
            self.compiler.close()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def eos_ids(tokenizer, directory) -> frozenset[int]:
    """EOS ids from the tokenizer and generation_config (models may have several)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        configured = GenerationConfig.from_pretrained(directory).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's EOS is all we know
        configured = None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return frozenset(ids)


def build_state(settings: Settings, source: ModelSource | None = None) -> ServerState:
    """Load the model and start the engine (blocking; seconds on the CPU)."""
    source = source or resolve_model(settings.model)
    device = pick_device(settings.device)
    if settings.cpu_threads > 0:
        torch.set_num_threads(settings.cpu_threads)
    dtype = resolve_dtype(settings.dtype, device)
    tokenizer = load_tokenizer(source.directory)
    hf_model = load_hf_model(source.directory, dtype, device)
    runner = ModelRunner(hf_model, max_slots=settings.max_batch_size, max_len=settings.max_model_len)
    engine = Engine(
        runner,
        tokenizer,
        max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        prefill_budget=settings.prefill_budget,
        jump_forward=settings.jump_forward,
    )
    engine.start()
    eos = eos_ids(tokenizer, source.directory)
    return ServerState(
        settings=settings,
        model_name=settings.served_model_name or source.name,
        tokenizer=tokenizer,
        engine=engine,
        compiler=_build_compiler(tokenizer, runner.vocab_size, eos, settings.compile_timeout),
        eos_token_ids=eos,
        token_texts=TokenTexts(tokenizer),
        vocab_size=runner.vocab_size,
        device_dfa=settings.device_dfa == "on" or (settings.device_dfa == "auto" and device.type == "cuda"),
    )


def sequence_constraint(state: ServerState, compiled) -> tuple[object | None, object | None]:
    """A fresh (matcher, token DFA) pair for one sequence; the DFA only where it runs on the device."""
    if compiled is None:
        return None, None
    token_dfa = compiled.token_dfa() if state.device_dfa else None
    return compiled.new_matcher(), token_dfa


def _build_compiler(tokenizer, vocab_size: int, eos: frozenset[int], timeout: float):
    from constraints import ConstraintCompiler

    return ConstraintCompiler(
        tokenizer, vocab_size, stop_token_ids=sorted(eos), compile_timeout_s=timeout
    )
