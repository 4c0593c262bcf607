"""Everything the request handlers share: model, tokenizer, engine and constraint compiler."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from kernels.quantized_linear import supports as kernel_supports
from server.config import Settings
from server.context import request_log
from server.engine.admission import Ticket, WaitAdmission
from server.engine.engine import Engine
from server.engine.kv_cache import KVShape, plan_num_blocks
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype, runs_hand_written
from server.engine.vision.families import vision_model_type
from server.engine.sequence import GenerationRequest
from server.generation import GenerationStream, GenerationTiming, TokenTexts, start_generation
from server.memory import DERIVED_TEXT, IdleTrimmer, libc_malloc_trim
from server.metrics import Metrics
from server.passing_thread import run_in_passing_thread
from server.render import PromptRenderer
from server.model_loader import (ModelLoadError, ModelSource, check_quantization, load_lora_adapters,
                                 load_tokenizer, model_source)

log = logging.getLogger("trellis")

# the request's place let in by the expected-wait limit, given up when its sequences are submitted
_TICKET: ContextVar[Ticket | None] = ContextVar("trellis_queue_ticket", default=None)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


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
    renderer: PromptRenderer | None = None
    device_dfa: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    store: object | None = None  # server.store.Store, opened by the app's lifespan
    lora: object | None = None  # server.engine.lora.LoraBank of the --lora-modules adapters
    trimmer: IdleTrimmer | None = None  # --memory-trim-idle
    queue_wait: WaitAdmission = field(init=False)  # --max-queue-wait
    vision: object | None = None  # server.vision.frontend.VisionFrontend of a vision-language model

    @property
    def provider_aliases(self) -> frozenset[str]:
        """Names besides 'trellis' that ``model@provider`` may use for this server."""
        return frozenset(a.strip() for a in self.settings.provider_aliases.split(",") if a.strip())

    @property
    def system_fingerprint(self) -> str:
        """Changes when the model, its dtype, its quantization or the server version changes."""
        import hashlib

        from server import __version__

        seed = f"{self.model_name}|{self.settings.dtype}|{self.settings.quantization}|{self.vocab_size}|{__version__}"
        return "fp_" + hashlib.sha256(seed.encode()).hexdigest()[:10]

    def __post_init__(self) -> None:
        engine = self.engine
        self.queue_wait = WaitAdmission(engine.admission, self.settings.max_queue_wait, engine.max_batch_size,
                                        lambda: engine.num_running)
        self.metrics.watch_many(self._engine_gauges)

    def enter_queue(self, tier: str | None) -> Ticket:
        """Let a request in by its expected wait (QueueWaitExceeded when over the limit); the
        ticket holds its place until :meth:`start_generation` submits it or it is released."""
        ticket = self.queue_wait.enter(tier)
        _TICKET.set(ticket)
        return ticket

    def start_generation(self, request_id: str, requests: list[GenerationRequest]) -> GenerationStream:
        """Submit a request's sequences (EngineOverloaded when the waiting queue is full)."""
        ticket = _TICKET.get()
        if ticket is not None:  # from here on the engine's own counters hold its place
            ticket.release()
        return start_generation(self.engine, request_id, requests, self._observe)

    def _observe(self, timing: GenerationTiming) -> None:
        self.metrics.generation_tokens.inc(timing.tokens)
        if timing.ttft is not None:
            self.metrics.ttft.observe(timing.ttft)
        if timing.tpot is not None:
            self.metrics.tpot.observe(timing.tpot)
        request_log().update(completion_tokens=timing.tokens, ttft_s=_rounded(timing.ttft))

    def _engine_gauges(self) -> dict[str, tuple[str, float]]:
        engine = self.engine
        stats = engine.stats
        gauges = {
            "trellis_running_sequences": ("sequences in the running batch", engine.num_running),
            "trellis_waiting_sequences": ("sequences waiting for a batch slot", engine.num_waiting),
            "trellis_waiting_prompt_tokens": ("prompt tokens waiting for a batch slot", engine.waiting_tokens),
            "trellis_expected_queue_wait_seconds": ("expected wait before a new request's first token",
                                                    self.queue_wait.expected_wait()),
            "trellis_prefill_tokens_per_second": ("measured prompt tokens/s (queue-wait estimate)",
                                                  engine.admission.rates.prefill_rate),
            "trellis_decode_tokens_per_second": ("measured tokens/s of the decoding batch (queue-wait estimate)",
                                                 engine.admission.rates.decode_rate),
            "trellis_mean_output_tokens": ("mean tokens a sequence generates before it leaves the batch",
                                           engine.admission.rates.output_tokens),
            "trellis_kv_cache_usage": ("fraction of the KV cache holding live tokens", engine.kv_usage),
            "trellis_engine_alive": ("1 while the engine thread is stepping", float(engine.alive)),
            "trellis_engine_steps": ("engine steps run", stats.steps),
            "trellis_forced_tokens": ("tokens appended by jump-forward", stats.forced_tokens),
        }
        for path, count in getattr(engine.runner, "path_counts", {}).items():  # a GraphedRunner (CUDA)
            what = f"forward passes run on the {path.replace('_', ' ')} path"
            gauges[f"trellis_forward_steps_{path}"] = (what, count)
        gauges["trellis_draft_tokens"] = ("draft tokens fed for verification (predictions and prompt lookup)",
                                          stats.draft_tokens)
        gauges["trellis_draft_tokens_accepted"] = ("draft tokens kept in the output", stats.accepted_draft_tokens)
        gauges["trellis_prompt_lookup_draft_tokens"] = ("prompt-lookup draft tokens fed", stats.lookup_draft_tokens)
        gauges["trellis_prompt_lookup_draft_tokens_accepted"] = ("prompt-lookup draft tokens kept",
                                                                 stats.accepted_lookup_draft_tokens)
        gauges["trellis_sampler_passes_in_graph"] = ("sampler passes replayed from CUDA graphs", stats.sampled_in_graph)
        gauges["trellis_sampler_passes_eager"] = ("sampler passes run eagerly", stats.sampled_eagerly)
        gauges["trellis_engine_overlapped_steps"] = (
            "forwards launched before the previous step's tokens were read (overlapped loop)", stats.overlapped_steps)
        policy = engine.policy
        gauges["trellis_forward_device_ms"] = ("moving average of a forward's device time, ms (overlap policy)",
                                               policy.forward_ms or 0.0)
        gauges["trellis_mask_fill_ms"] = ("moving average of a step's mask fill time, ms (overlap policy)", policy.fill_ms)
        if self.compiler is not None:
            cache = self.compiler.cache_stats()
            gauges["trellis_constraint_cache_hits"] = ("compiled-constraint cache hits", cache["hits"])
            gauges["trellis_constraint_cache_misses"] = ("compiled-constraint cache misses", cache["misses"])
            gauges["trellis_constraint_cache_bytes"] = ("compiled-constraint cache size", cache["bytes"])
            gauges["trellis_constraint_disk_hits"] = ("compiled constraints loaded from disk", cache["disk_hits"])
            gauges["trellis_constraint_disk_writes"] = ("compiled constraints written to disk", cache["disk_writes"])
        return gauges

    def close(self) -> None:
        if self.trimmer is not None:
            self.trimmer.close()
        self.engine.shutdown()
        if self.renderer is not None:
            self.renderer.close()
        if self.compiler is not None:
            self.compiler.close()
        if self.vision is not None:
            self.vision.close()


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


def load_runner(settings: Settings, directory, dtype: torch.dtype, device: torch.device):
    """The model runner and its LoRA bank: the hand-written Llama-family forward where it applies,
    else transformers' own modelling code over the paged cache (:mod:`server.engine.hf_runner`);
    an architecture neither can run is refused here in one line."""
    from transformers import AutoConfig

    from server.engine import hf_runner

    config = AutoConfig.from_pretrained(directory)
    hand_written = runs_hand_written(config)
    quantization = resolve_quantization(settings.quantization, device, hand_written)
    if settings.batch_invariant and (not hand_written or vision_model_type(config) is not None):
        raise ModelLoadError("--batch-invariant needs the hand-written Llama-family forward, which this model's "
                             "architecture does not use")
    if vision_model_type(config) is not None:
        from server.engine.vision.runner import VisionRunner, load_vision_model

        hf_model = load_vision_model(directory, dtype, device)
        runner_class, shape, options = VisionRunner, hf_runner.kv_shape(hf_model), {}
    elif hand_written:
        hf_model = load_hf_model(directory, dtype, device)
        shape = ModelRunner.kv_shape(hf_model)
        options = {"quantization": quantization, "batch_invariant": settings.batch_invariant}
        runner_class = ModelRunner
    else:
        hf_model = hf_runner.load_model(directory, dtype, device)
        runner_class, shape, options = hf_runner.TransformersRunner, hf_runner.kv_shape(hf_model), {}
    lora = load_lora_adapters(settings.lora_modules, hf_model)
    blocks = kv_cache_blocks(settings, shape, dtype, device)
    return runner_class(hf_model, num_blocks=blocks, block_size=settings.block_size, lora=lora, **options), lora


def resolve_quantization(name: str, device: torch.device, hand_written: bool) -> str:
    """``--quantization``, checked: int4, int8 or bf16 run on the CPU with the hand-written forward
    only; elsewhere they are refused (none is the default: int4 is twice as fast at decode here
    but changes the default model's greedy answers, ``benchmarks/quantization.py``). fp8 runs
    with the hand-written forward anywhere (FP8 matmuls on CUDA sm89+, elsewhere the weights
    rounded to FP8 in the model's dtype: :mod:`server.engine.fp8_weights`)."""
    if name not in ("none", "int4", "int8", "bf16", "fp8"):
        raise ModelLoadError(f"unknown --quantization {name!r} (choose none, int4, int8, bf16 or fp8)")
    if name == "bf16" and not kernel_supports("bf16", torch.empty(1, 1)):
        raise ModelLoadError("--quantization bf16 needs oneDNN's bf16 kernels, which this CPU or torch build lacks")
    if name in ("int4", "int8", "bf16") and device.type != "cpu":
        raise ModelLoadError(f"--quantization {name} runs on the CPU; on {device.type} use --quantization none")
    if name != "none" and not hand_written:
        raise ModelLoadError(f"--quantization {name} needs the hand-written Llama-family forward, which this "
                             "model's architecture does not use; use --quantization none")
    return name


def kv_cache_blocks(settings: Settings, shape: KVShape, dtype: torch.dtype, device: torch.device) -> int:
    """KV-cache blocks for the settings: what the GPU has left, or the CPU byte budget (by
    default room for ``max_batch_size`` sequences of ``max_model_len`` tokens). One sequence of
    ``max_model_len`` tokens must fit, or the server refuses to start."""
    if settings.block_size < 1 or settings.block_size > 1024:
        raise ValueError(f"--block-size must be between 1 and 1024, got {settings.block_size}")
    if not 0.0 < settings.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {settings.gpu_memory_utilization}")
    per_sequence = -(-settings.max_model_len // settings.block_size)
    per_block = shape.bytes_per_block(settings.block_size, dtype)
    cpu_bytes = settings.kv_cache_memory_mb * 2**20 or (settings.max_batch_size * per_sequence + 1) * per_block
    blocks = plan_num_blocks(shape, settings.block_size, dtype, device, cpu_bytes=cpu_bytes,
                             gpu_memory_utilization=settings.gpu_memory_utilization)
    if blocks - 1 < per_sequence:
        raise ValueError(
            f"the KV cache holds {(blocks - 1) * settings.block_size} tokens, less than one sequence of "
            f"--max-model-len {settings.max_model_len}: lower --max-model-len or give the cache more memory "
            "(--kv-cache-memory-mb on the CPU, --gpu-memory-utilization on CUDA)"
        )
    return blocks


def build_state(settings: Settings, source: ModelSource | None = None) -> ServerState:
    """Load the model and start the engine (blocking; seconds on the CPU).

    The loading runs on a thread of its own that ends when it is done (see
    :mod:`server.passing_thread`: the engine thread's OpenMP team stays the only one).
    """
    return run_in_passing_thread(lambda: _build_state(settings, source))


def _build_state(settings: Settings, source: ModelSource | None) -> ServerState:
    source = source or model_source(settings)
    device = pick_device(settings.device)
    if settings.cpu_threads > 0:
        torch.set_num_threads(settings.cpu_threads)
    dtype = resolve_dtype(settings.dtype, device)
    dequantized = check_quantization(source.directory, device, dtype)  # refuses what the engine cannot load
    if dequantized:
        log.info(dequantized)
    tokenizer = load_tokenizer(source.directory)
    runner, lora = load_runner(settings, source.directory, dtype, device)
    if device.type == "cuda" and not settings.enforce_eager:  # decode steps replayed from CUDA graphs
        from server.engine.cuda_graphs import graph_decode_steps

        runner = graph_decode_steps(runner, max_batch_size=settings.max_batch_size,
                                    max_model_len=settings.max_model_len)
    engine = Engine(
        runner,
        tokenizer,
        max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        prefill_budget=settings.prefill_budget,
        jump_forward=settings.jump_forward,
        max_waiting_seqs=settings.max_waiting_seqs,
        max_waiting_tokens=settings.max_waiting_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        mask_fill_threads=settings.mask_fill_threads,
        constraint_call_timeout=settings.constraint_call_timeout,
        overlap=None if settings.overlap == "auto" else settings.overlap == "on",
        speculation=settings.speculation != "off",
    )
    engine.start()
    eos = eos_ids(tokenizer, source.directory)
    renderer = PromptRenderer(
        tokenizer,
        source.directory,
        timeout_s=settings.template_timeout,
        allow_client_templates=settings.allow_client_chat_template,
    )
    DERIVED_TEXT.max_bytes = settings.text_cache_mb << 20  # tool grammars, chat-template facts
    state = ServerState(
        settings=settings,
        model_name=settings.served_model_name or source.name,
        tokenizer=tokenizer,
        engine=engine,
        compiler=_build_compiler(tokenizer, runner.vocab_size, eos, settings),
        renderer=renderer,
        eos_token_ids=eos,
        token_texts=TokenTexts(tokenizer),
        vocab_size=runner.vocab_size,
        lora=lora,
        device_dfa=settings.device_dfa == "on" or (settings.device_dfa == "auto" and device.type == "cuda"),
        trimmer=_start_trimmer(engine, settings),
    )
    state.vision = _vision_frontend(settings, runner, tokenizer, source.directory, state.metrics)
    from server.tools.select import log_format

    log_format(state)  # which tool-call format the model's output is read in
    return state


def _vision_frontend(settings: Settings, runner, tokenizer, directory, metrics):
    """The request side of a vision-language model (None for a text model)."""
    family = getattr(runner, "family", None)
    if family is None:
        return None
    from server.vision.frontend import VisionFrontend, image_limit
    from server.vision.images import MediaLimits

    limits = MediaLimits(
        max_image_bytes=settings.max_image_mb << 20,
        max_image_pixels=settings.max_image_pixels,
        decode_timeout_s=settings.media_timeout,
        fetch_timeout_s=settings.media_timeout,
        allowed_domains=tuple(d.strip() for d in settings.allowed_media_domains.split(",") if d.strip()),
    )
    return VisionFrontend(family, tokenizer, directory, runner.hf.config, limits,
                          image_limit(settings.limit_mm_per_prompt), metrics)


def _start_trimmer(engine: Engine, settings: Settings) -> IdleTrimmer:
    """Freed heap memory returned to the OS once the engine has idled ``--memory-trim-idle`` s."""
    trimmer = IdleTrimmer(lambda: bool(engine.num_running or engine.num_waiting), settings.memory_trim_idle,
                          trim=libc_malloc_trim())
    trimmer.start()
    return trimmer


def sequence_constraint(state: ServerState, compiled) -> tuple[object | None, object | None]:
    """A fresh (matcher, token DFA) pair for one sequence; the DFA only where it runs on the device."""
    if compiled is None:
        return None, None
    token_dfa = compiled.token_dfa() if state.device_dfa else None
    return compiled.new_matcher(), token_dfa


def _constraint_cache_dir(settings: Settings):
    if settings.constraint_cache_dir == "off":
        return None
    if settings.constraint_cache_dir:
        return settings.constraint_cache_dir
    from server.model_loader import cache_root

    return cache_root() / "constraints"


def _build_compiler(tokenizer, vocab_size: int, eos: frozenset[int], settings: Settings):
    from constraints import ConstraintCompiler

    return ConstraintCompiler(
        tokenizer,
        vocab_size,
        stop_token_ids=sorted(eos),
        compile_timeout_s=settings.compile_timeout,
        compile_memory_mb=settings.compile_memory_mb,
        max_workers=settings.compile_workers,
        max_cache_bytes=settings.constraint_cache_mb << 20,
        disk_cache_dir=_constraint_cache_dir(settings),
        disk_cache_bytes=settings.constraint_disk_cache_mb << 20,
    )
