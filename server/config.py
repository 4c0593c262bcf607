"""Server settings: command-line flags, each also settable through a ``TRELLIS_`` variable."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields


@dataclass
class Settings:
    """Everything ``trellis serve`` can be told."""

    model: str = "default"
    revision: str = ""
    download_dir: str = ""
    gguf_file: str = ""
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 16
    max_model_len: int = 2048
    dtype: str = "auto"
    quantization: str = "none"
    device: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False
    cpu_threads: int = 0
    prefill_budget: int = 1024
    block_size: int = 16
    kv_cache_memory_mb: int = 0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    jump_forward: bool = True
    overlap: str = "auto"
    speculation: str = "auto"
    close_on_length: bool = False
    device_dfa: str = "auto"
    mask_fill_threads: int = 0
    constraint_call_timeout: float = 5.0
    compile_timeout: float = 5.0
    compile_memory_mb: int = 4096
    compile_workers: int = 2
    constraint_cache_dir: str = ""
    constraint_cache_mb: int = 128
    constraint_disk_cache_mb: int = 1024
    memory_trim_idle: float = 10.0
    text_cache_mb: int = 32
    tool_call_format: str = ""
    max_waiting_seqs: int = 256
    max_waiting_tokens: int = 262144
    max_queue_wait: float = 20.0
    request_timeout: float = 600.0
    drain_timeout: float = 30.0
    max_body_bytes: int = 8 * 1024 * 1024
    limit_mm_per_prompt: str = "image=8"
    allowed_media_domains: str = ""
    max_image_mb: int = 20
    max_image_pixels: int = 40_000_000
    media_timeout: float = 10.0
    template_timeout: float = 2.0
    allow_client_chat_template: bool = True
    max_tokens_overflow: str = "error"
    enable_custom_logit_processor: bool = False
    log_requests: bool = True
    api_keys: str = ""
    api_keys_file: str = ""
    jwt_secret: str = ""
    jwt_public_key: str = ""
    jwt_jwks_file: str = ""
    jwt_algorithms: str = ""
    jwt_issuer: str = ""
    jwt_audience: str = ""
    jwt_leeway: float = 0.0
    database_url: str = ""
    provider_aliases: str = ""
    log_bodies: bool = False
    log_level: str = "info"
    lora_modules: str = ""  # name=path entries, comma-separated (the flag may be repeated)
    ray: bool = False
    replicas: int = 1
    ray_address: str = ""
    ray_routing: str = "cache"
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    autoscale_min: int = 0
    autoscale_max: int = 0


_HELP = {
    "model": "'default' (embedded SmolLM2-135M-Instruct), a hub id org/name (or org/name:file.gguf), a local Hugging Face model directory, or a .gguf file; also the positional MODEL",
    "revision": "with a hub id: the branch, tag or commit to serve ('' = main)",
    "download_dir": "with a hub id: the cache folder to read and download into ('' = huggingface_hub's cache: HF_HUB_CACHE, else HF_HOME/hub)",
    "gguf_file": "with a hub id (or a local directory): the .gguf file in it to serve, as org/name:file.gguf",
    "served_model_name": "model id clients send and /v1/models lists (default: the model's name; a hub id for a hub model)",
    "host": "address to listen on",
    "port": "port to listen on",
    "max_batch_size": "most sequences decoded together in one step",
    "max_model_len": "context length: prompt + completion tokens per sequence",
    "dtype": "weights dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16",
    "quantization": "quantize the linear layers at load: none (the weights as loaded; an FP8 checkpoint stays FP8 on CUDA), int4 (groups of 32, as GGUF's Q4_1; the output layer int8), int8 (per row): the CPU's kernels for decode tokens, the prompt in the model's dtype; bf16 (oneDNN's packed bf16, AMX): every token, prompts cut and attended per block; these three CPU only; fp8 (per output channel, per-token activations, torch._scaled_mm on CUDA sm89+; elsewhere rounded to FP8 in the model's dtype); the Llama-family forward only",
    "device": "auto (CUDA when available), cpu or cuda",
    "enforce_eager": "run every step eagerly: no CUDA graphs for decode steps (on|off)",
    "batch_invariant": "CUDA: linear layers and attention in kernels whose per-row arithmetic does not depend on the batch, so drafts, jump-forward, graph padding and other requests never change a sequence's tokens (on|off; costs speed: README 'Batch-invariant kernels'; the Llama-family forward without FP8 or LoRA)",
    "cpu_threads": "torch CPU threads for the forward (0 = torch's default: one per core)",
    "prefill_budget": "most prompt tokens processed per engine step (chunked prefill)",
    "block_size": "tokens per KV-cache block (the unit of allocation and of prefix sharing)",
    "kv_cache_memory_mb": "KV cache size on the CPU in MiB (0 = room for --max-batch-size sequences of --max-model-len tokens)",
    "gpu_memory_utilization": "on CUDA: fraction of the GPU's memory the weights, activations and KV cache may use (the cache gets what is left)",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before: shared system prompts, tools, re-sent conversations (on|off)",
    "jump_forward": "append tokens a constraint forces without sampling them (on|off)",
    "overlap": "overlapped engine loop: the next step's forward is launched before the host reads the sampled tokens (same output): auto (on with CUDA), on, off",
    "speculation": "the engine's own drafts, verified in the batched step (same output): prompt lookup for constrained sequences, composed with their grammar, fed while the measured step cost says they pay: auto, off (a request may send speculation: off)",
    "close_on_length": "constrained outputs close (parse and validate) before max_tokens ends, unless a request sets structured_outputs.close_on_length false (on|off)",
    "device_dfa": "regex/choice constraints as a device-resident DFA masked by a kernel: auto (on with CUDA), on, off",
    "mask_fill_threads": "threads filling the constraint masks of one step, in xgrammar's and llguidance's batched fills (0 = with CUDA one per masked row up to one per core, on the CPU 1)",
    "constraint_call_timeout": "seconds one call into a sequence's constraint (mask fill, accepting a token, forced tokens, drafts) or its custom logit processor may take; over it the call is abandoned and only that sequence ends with an error (0 = no limit)",
    "compile_timeout": "seconds a constraint (schema, regex, grammar) may take to compile",
    "compile_memory_mb": "memory a constraint compile may add to its worker process, in MiB (0 = no cap)",
    "constraint_cache_dir": "compiled constraints on disk, shared by processes and restarts ('' = 'constraints' in the cache directory, 'off' = none)",
    "constraint_cache_mb": "compiled constraints kept in memory, in MiB (least recently used evicted first; failures kept 30 s)",
    "constraint_disk_cache_mb": "compiled constraints kept on disk (--constraint-cache-dir), in MiB (least recently used evicted first)",
    "memory_trim_idle": "seconds the engine must be idle before the heap memory freed since the last time is given back to the OS (glibc malloc_trim; 0 = never)",
    "text_cache_mb": "grammars and template facts derived from request text (tool schemas, client chat templates) kept in memory, in MiB (least recently used evicted first)",
    "tool_call_format": "how the model writes tool calls: '' = detected from its chat template (unknown: qwen3-hermes), or one of qwen3-hermes, qwen3-xml, llama, mistral, deepseek, kimi, glm, gpt-oss, gemma4",
    "compile_workers": "constraint-compile worker processes (each ~0.5 GB resident)",
    "max_waiting_seqs": "most sequences waiting for a batch slot; more -> 429 with Retry-After",
    "max_waiting_tokens": "most prompt tokens waiting for a batch slot; more -> 429 with Retry-After",
    "max_queue_wait": "most seconds a request may expect to wait for its first token (service_tier priority: twice, flex: half); more -> 429 with Retry-After, before rendering (0 = no limit)",
    "request_timeout": "seconds a request may take from arrival to its last token (0 = no limit)",
    "drain_timeout": "seconds running requests may finish after SIGTERM before the server exits",
    "max_body_bytes": "largest request body in bytes (larger -> 413)",
    "limit_mm_per_prompt": "vision-language models: most images in one request, as image=N, N or vLLM's JSON {\"image\": N} (more -> 400)",
    "allowed_media_domains": "comma-separated hosts whose http(s) image URLs the server may fetch (empty: only data: URLs; a server that fetches URLs for clients must be told where)",
    "max_image_mb": "largest encoded image in MiB (a data: URL's payload or a fetched body; larger -> 400)",
    "max_image_pixels": "largest image in pixels, read from its header before decoding (larger -> 400)",
    "media_timeout": "seconds one image may take to fetch, and to decode (then 400)",
    "template_timeout": "seconds a chat template may take to render (then 400)",
    "allow_client_chat_template": "accept a request's own 'chat_template' (rendered sandboxed in a worker process)",
    "max_tokens_overflow": "max_tokens beyond the context on /v1: 'error' (OpenAI's 400) or 'clamp' to what fits (always clamped on /v0)",
    "enable_custom_logit_processor": "let requests carry SGLang's 'custom_logit_processor' (client code; without this flag: 400)",
    "log_requests": "one structured log line per request (on|off)",
    "api_keys": "comma-separated API keys, sent as 'Authorization: Bearer KEY' or 'Api-Key KEY' (prefer --api-keys-file: flags show in ps)",
    "api_keys_file": "file with one API key per line, optionally 'KEY USER' to name its user; '#' starts a comment",
    "jwt_secret": "HS256 secret verifying JWT bearer tokens (the 'sub' claim is the user)",
    "jwt_public_key": "PEM public key verifying JWTs (RSA -> RS256, EC -> ES256, Ed25519 -> EdDSA)",
    "jwt_jwks_file": "local JWKS file verifying JWTs by 'kid' (no network)",
    "jwt_algorithms": "comma-separated accepted JWT algorithms (default: from the key)",
    "jwt_issuer": "required JWT 'iss' claim (empty: not checked)",
    "jwt_audience": "required JWT 'aud' claim (empty: not checked)",
    "jwt_leeway": "seconds of clock skew allowed for JWT exp/nbf",
    "provider_aliases": "comma-separated provider names besides 'trellis' accepted in model@provider",
    "log_bodies": "log request and response bodies in the request log line (a request's log_query_body / log_response_body override it)",
    "database_url": "stored completions and conversations: a SQLite file, or postgresql://user:pass@host:port/db (default: store.sqlite3 in the cache directory)",
    "log_level": "debug, info, warning or error",
    "lora_modules": "LoRA adapters (peft directories) as name=path; repeatable, or comma-separated in the env",
    "ray": "scale out on Ray Serve: --replicas engine replicas behind one entry point (needs the 'ray' extra) (on|off)",
    "replicas": "with --ray: engine replicas (each one model + engine + compiler)",
    "ray_address": "with --ray: the Ray cluster to join ('auto' = the local node's; '' = start a local Ray instance)",
    "ray_routing": "with --ray: cache (prompt-prefix/constraint affinity, else least loaded), round-robin, or pow2 (Ray's default)",
    "gpus_per_replica": "with --ray: GPUs each replica reserves",
    "cpus_per_replica": "with --ray: CPUs each replica reserves",
    "autoscale_min": "with --ray and --autoscale-max: fewest replicas Ray Serve's autoscaler keeps",
    "autoscale_max": "with --ray: most replicas; > 0 turns on autoscaling on queue depth (a full batch per replica)",
}
_LISTS = {"lora_modules"}  # flags that take several values and may be repeated
_CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "quantization": ["none", "int4", "int8", "bf16", "fp8"],
    "device": ["auto", "cpu", "cuda"],
    "log_level": ["debug", "info", "warning", "error"],
    "device_dfa": ["auto", "on", "off"],
    "overlap": ["auto", "on", "off"],
    "speculation": ["auto", "off"],
    "max_tokens_overflow": ["error", "clamp"],
    "ray_routing": ["cache", "round-robin", "pow2"],
    "tool_call_format": ["", "qwen3-hermes", "qwen3-xml", "llama", "mistral", "deepseek", "kimi", "glm", "gpt-oss", "gemma4"],
}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, got {text!r}")


def _converter(field_type: str):
    return {"int": int, "float": float, "bool": _parse_bool}.get(field_type.split(" ")[0], str)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; the default comes from ``TRELLIS_<NAME>`` when set."""
    defaults = Settings()
    for field in fields(Settings):
        env = f"TRELLIS_{field.name.upper()}"
        convert = _converter(str(field.type))
        default = getattr(defaults, field.name)
        if env in os.environ:
            default = convert(os.environ[env])
        if field.name in _LISTS:
            parser.add_argument("--" + field.name.replace("_", "-"), nargs="+", action="extend",
                                default=[default] if default else [], metavar="NAME=PATH",
                                help=f"{_HELP[field.name]} [env {env}]")
            continue
        flag_only = {"nargs": "?", "const": True} if convert is _parse_bool else {}  # `--ray` alone = on
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            **flag_only,
            type=convert,
            default=default,
            choices=_CHOICES.get(field.name),
            metavar=None if field.name in _CHOICES else field.name.upper(),
            help=f"{_HELP[field.name]} [env {env}; default: {_shown(field.name, default)}]",
        )
    parser.add_argument("--api-key", action="append", metavar="KEY",
                        help="one API key (repeatable; adds to --api-keys)")


_SECRETS = {"api_keys", "jwt_secret"}


def _shown(name: str, value) -> str:
    """Defaults as --help shows them; secrets from the environment are never printed."""
    return "(set)" if name in _SECRETS and value else str(value)


def settings_from_args(args: argparse.Namespace) -> Settings:
    values = {f.name: getattr(args, f.name) for f in fields(Settings)}
    for name in _LISTS:
        if isinstance(values[name], list):
            values[name] = ",".join(values[name])
    settings = Settings(**values)
    extra_keys = getattr(args, "api_key", None) or []
    if extra_keys:  # --api-key may be repeated; it adds to --api-keys
        settings.api_keys = ",".join(filter(None, [settings.api_keys, *extra_keys]))
    return settings
