"""GPU benchmark: Trellis against the hardware's floor, free vs structured, in one command.

Builds random-init Llama models of the 1B and 8B shapes (bf16; no weights travel, the tokenizer
comes from ``--tokenizer``), measures the device's copy bandwidth and from it the HBM floor of
one decode step (every weight byte read once: weight bytes / bandwidth, KV reads not counted),
then for each shape:

- decode: output tok/s and ms/step through the ``Engine`` at batch 1/8/64/256, free text and
  ``json_schema`` with jump-forward off and on (batch kept full, as ``benchmarks/decode.py``); on
  CUDA the note says how many measured steps replayed a full decode graph, piecewise graphs
  (mixed steps: jump-forward continuations, prefill chunks) or ran eagerly
  (``--max-graph-tokens 0`` turns the piecewise graphs off, for a side-by-side run);
- TTFT of a 4,000-token prompt: cold (no cached prefix) and a second request sharing the first
  3,984 tokens (whole 16-token blocks; the prefix cache);
- HTTP: output tok/s through ``trellis serve`` at 1/16/64/256 streaming clients, free and
  ``json_schema`` (``benchmarks/serve.py``'s client);
- FP8 (``--quantization fp8``, or ``none fp8`` for both in one run): after the bf16 parts the
  model's decoder-layer projections are quantized to FP8 in place (per-output-channel scales,
  per-token activations through ``torch._scaled_mm``, :mod:`server.engine.fp8_weights`; on the
  CPU rounded to FP8 and kept in float32) and the decode (and TTFT) rows run again as
  ``decode fp8``; the note gives the speed-up over the bf16 row at the same batch. A failure there
  is printed in its row's note and the other rows go on;
- generate: transformers' own greedy ``generate`` on the same model in the same run, with a static
  cache and torch.compile on CUDA (eager on the CPU), at the decode batches up to 8; ms per decode
  step from two generation lengths (the prefill cancels out); the note gives Trellis's free decode
  speed-up over it at the same batch (``--parts decode generate``).

One table at the end: "x floor" is the measured step time over the floor step time (the
effective step time of an HTTP level is clients / output tok/s), "vs free" is each structured
row's tok/s over the free row's at the same batch. ``--out`` writes everything as JSON.

    python benchmarks/gpu.py --tokenizer /path/to/tokenizer-dir --out gpu.json
    python benchmarks/gpu.py --tokenizer DIR --shapes 8b --parts decode ttft   # split long runs
    python benchmarks/gpu.py --tokenizer DIR --shapes 8b --parts decode --batches 1 64 --quantization none fp8
    python benchmarks/gpu.py --smoke          # tiny shapes on the CPU, under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.decode import PEOPLE, PROMPT, Workload, _snapshot  # noqa: E402
from benchmarks.serve import run_level  # noqa: E402
from constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from kernels.fp8 import row_bucket  # noqa: E402
from sampler import SamplingParams  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.sequence import GenerationRequest  # noqa: E402
from server.model_loader import load_tokenizer  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
PARTS = ("decode", "ttft", "http", "generate")
GENERATE_MAX_BATCH = 8
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE, "strict": True}}
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges", "added_tokens")
PREFIX_BLOCK = 16  # the shared prefix is a whole number of cache blocks
QUANTIZATIONS = ("none", "fp8")
OVERLAP = {"auto": None, "on": True, "off": False}  # --overlap → Engine(overlap=...)


@dataclass
class Plan:
    """What one run measures (full GPU defaults, or tiny ones with ``--smoke``)."""

    device: torch.device
    dtype: torch.dtype
    shapes: list[str]
    parts: list[str]
    batches: list[int]
    clients: list[int]
    steps: int
    warmup: int
    decode_len: int  # context per sequence in the decode runs
    prompt_tokens: int  # the TTFT prompt
    http_tokens: int  # max_tokens of each HTTP request
    enforce_eager: bool
    bandwidth_bytes: int
    max_graph_tokens: int = 512  # piecewise graphs of mixed steps up to this many tokens (0: none)
    server_args: list[str] = field(default_factory=list)  # extra ``trellis serve`` flags
    profile_dir: Path | None = None  # torch.profiler tables of every decode row go here
    quantizations: list[str] = field(default_factory=lambda: ["none"])  # none: bf16 rows; fp8: FP8 rows
    overlap: str = "auto"  # the engine's overlapped loop: auto (on with CUDA), on, off
    batch_invariant: bool = False  # the runner's batch-invariant kernels (--batch-invariant)


@dataclass
class Row:
    shape: str
    what: str
    rows: int
    workload: str
    jump: str
    tok_s: float | None = None
    ms: float | None = None
    x_floor: float | None = None
    vs_free: float | None = None
    note: str = ""


@dataclass
class ShapeReport:
    weight_bytes: int
    floor_ms: float
    rows: list[Row] = field(default_factory=list)
    fp8_weight_bytes: int | None = None  # after --quantization fp8
    fp8_floor_ms: float | None = None


# ---------------------------------------------------------------- engine construction (one place)


def build_engine(hf_model, tokenizer, *, max_batch_size: int, max_model_len: int, jump_forward: bool,
                 enforce_eager: bool, max_graph_tokens: int = 512, overlap: str = "auto",
                 batch_invariant: bool = False) -> Engine:
    """The benchmark's only construction of a runner and an engine: when the engine's
    constructor changes (paged KV cache, block manager), this is the one function to adjust."""
    from server.config import Settings
    from server.engine.cuda_graphs import graph_decode_steps
    from server.engine.model import ModelRunner
    from server.state import kv_cache_blocks

    settings = Settings(max_batch_size=max_batch_size, max_model_len=max_model_len)  # sized as the server does
    device = next(hf_model.parameters()).device
    dtype = next(hf_model.parameters()).dtype
    runner = ModelRunner(hf_model, num_blocks=kv_cache_blocks(settings, ModelRunner.kv_shape(hf_model), dtype, device),
                         block_size=settings.block_size, batch_invariant=batch_invariant)
    if device.type == "cuda":  # decode steps and mixed steps graphed, as the server does
        runner = graph_decode_steps(runner, max_batch_size=max_batch_size, max_model_len=max_model_len,
                                    enforce_eager=enforce_eager, max_graph_tokens=max_graph_tokens)
    return Engine(runner, tokenizer, max_batch_size=max_batch_size, max_model_len=max_model_len,
                  jump_forward=jump_forward, overlap=OVERLAP[overlap])


def retire(engine: Engine) -> None:
    """Stop the engine's helper thread (its constraint-call worker), whose last batch would keep
    the engine, and so its KV cache, alive after the benchmark drops it."""
    engine.shutdown()
    worker = getattr(getattr(engine.bound, "calls", None), "_worker", None)
    if worker is not None:
        worker.thread.join(timeout=10)


def release(engine: Engine) -> None:
    """Abort every running sequence so its KV space is free for the next measurement."""
    engine.flush()  # the overlapped loop's last sampled tokens
    for seq in list(engine.scheduler.running):
        seq.finish("abort")
    engine._report_and_retire()


# ---------------------------------------------------------------- models and the floor


def build_model(shape: str, vocab_size: int, eos: int, dtype: torch.dtype, device: torch.device):
    """A random-init Llama of ``shape``, built directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=8192, eos_token_id=eos, **SHAPES[shape])
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def copy_bandwidth(device: torch.device, nbytes: int, iterations: int = 20) -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(iterations):
        dst.copy_(src)
    synchronize(device)
    return 2 * nbytes * iterations / (time.perf_counter() - started)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- decode through the engine


def measure_decode(hf_model, tokenizer, compiled, plan: Plan, shape: str, floor_ms: float, *,
                   what: str = "decode", baseline: list[Row] | None = None) -> list[Row]:
    """Decode rows per batch: free, json_schema, json_schema + jump-forward. With ``baseline`` (the
    bf16 rows, for the FP8 ones) each row's note gives its speed-up over the same bf16 row, and a
    failing batch becomes a row whose note is the error (the other rows go on)."""
    rows: list[Row] = []
    for batch in plan.batches:
        if baseline is None:
            rows += decode_batch(hf_model, tokenizer, compiled, plan, shape, floor_ms, batch, what)
            continue
        try:
            rows += decode_batch(hf_model, tokenizer, compiled, plan, shape, floor_ms, batch, what, baseline)
        except Exception as exc:  # noqa: BLE001 (one failing row must not end the run)
            rows.append(Row(shape, what, batch, "free", "-", note=error_note(exc)))
            print(format_row(rows[-1]), flush=True)
            free_memory(plan.device)
    return rows


def decode_batch(hf_model, tokenizer, compiled, plan: Plan, shape: str, floor_ms: float, batch: int,
                 what: str, baseline: list[Row] | None = None) -> list[Row]:
    rows: list[Row] = []
    prompt = chat_prompt(tokenizer)
    engine = build_engine(hf_model, tokenizer, max_batch_size=batch, max_model_len=plan.decode_len,
                          jump_forward=False, enforce_eager=plan.enforce_eager,
                          max_graph_tokens=plan.max_graph_tokens, overlap=plan.overlap,
                          batch_invariant=plan.batch_invariant)
    free_rate = None
    for name, matcher_source, jump in (("free", None, False), ("json_schema", compiled, False),
                                       ("json_schema", compiled, True)):
        engine.jump_forward = jump
        paths_before = dict(getattr(engine.runner, "path_counts", {}))
        rate, step_ms = decode_rate(engine, prompt, matcher_source, batch, plan)
        if plan.profile_dir is not None:
            label = f"{shape}-b{batch}-{what.replace(' ', '-')}-{name}" + ("-jf" if jump else "")
            profile_decode(engine, prompt, matcher_source, batch, plan, label)
        free_rate = rate if name == "free" else free_rate
        rows.append(Row(shape, what, batch, name, "on" if jump else ("off" if matcher_source else "-"),
                        tok_s=rate, ms=step_ms, x_floor=step_ms / floor_ms,
                        vs_free=rate / free_rate if free_rate else None))
        rows[-1].note = "; ".join(filter(None, [speedup_note(rows[-1], baseline or []),
                                                f"overlap {'on' if engine.overlap else 'off'}",
                                                path_note(engine, paths_before)]))
        print(format_row(rows[-1]), flush=True)
    for line in fp8_choice_lines(engine, batch):
        print(f"{shape} {what} batch {batch}: {line}", flush=True)
    retire(engine)
    del engine
    free_memory(plan.device)
    return rows


def fp8_choice_lines(engine: Engine, batch: int, shown: int = 5) -> list[str]:
    """Per FP8 projection shape timed at ``batch`` rows: the winner and the fastest candidates (µs)."""
    runner = getattr(engine.runner, "runner", engine.runner)
    fp8 = getattr(runner, "fp8", None)
    if fp8 is None:
        return []
    lines = []
    for (bucket, n, k, _dtype), (winner, times) in sorted(fp8.choice.table.items(), key=lambda item: item[0][:3]):
        if bucket != row_bucket(batch):
            continue
        best = sorted(times.items(), key=lambda item: item[1])[:shown]
        listed = ", ".join(f"{name} {us:.1f}" for name, us in best)
        lines.append(f"FP8 [{n} x {k}] -> {winner}; µs: {listed}; rowwise {times.get('rowwise', float('nan')):.1f}")
    return lines


def speedup_note(row: Row, baseline: list[Row]) -> str:
    """``row``'s step time against the bf16 row of the same batch, workload and jump-forward."""
    for base in baseline:
        if (base.rows, base.workload, base.jump) == (row.rows, row.workload, row.jump) and base.ms and row.ms:
            return f"{base.ms / row.ms:.2f}x bf16 speed"
    return ""


def error_note(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"error: {type(exc).__name__}: {first[:300]}"


def measure_fp8(hf_model, tokenizer, compiled, plan: Plan, shape: str, report: ShapeReport) -> list[Row]:
    """The model's projections to FP8 in place, then its decode (and TTFT) rows again."""
    from server.engine.fp8_weights import keeps_fp8, quantize_model

    try:
        quantize_model(hf_model)
    except Exception as exc:  # noqa: BLE001 (the bf16 rows stand)
        row = Row(shape, "decode fp8", 0, "-", "-", note=f"quantization failed: {error_note(exc)}")
        print(format_row(row), flush=True)
        return [row]
    free_memory(plan.device)
    size = weight_bytes(hf_model)
    report.fp8_weight_bytes, report.fp8_floor_ms = size, report.floor_ms * size / report.weight_bytes
    how = "FP8 via torch._scaled_mm" if keeps_fp8(plan.device) else "rounded to FP8, kept in the model's dtype"
    print(f"{shape} fp8 ({how}): {size / 1e9:.2f} GB of weights -> HBM floor {report.fp8_floor_ms:.3f} ms "
          "per decode step", flush=True)
    skipped = [part for part in ("generate", "http") if part in plan.parts]
    if skipped and "none" not in plan.quantizations:
        print(f"{shape} fp8: the {' and '.join(skipped)} part(s) run on the bf16 model only "
              "(--quantization none fp8)", flush=True)
    rows: list[Row] = []
    if "decode" in plan.parts:
        baseline = [row for row in report.rows if row.what == "decode"]
        rows += measure_decode(hf_model, tokenizer, compiled, plan, shape, report.fp8_floor_ms,
                               what="decode fp8", baseline=baseline)
    if "ttft" in plan.parts:
        try:
            rows += measure_ttft(hf_model, tokenizer, plan, shape, what="ttft fp8")
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(shape, "ttft fp8", 1, "-", "-", note=error_note(exc)))
            print(format_row(rows[-1]), flush=True)
    return rows


def measure_generate(hf_model, plan: Plan, shape: str, floor_ms: float, decode_rows: list[Row]) -> list[Row]:
    """transformers' own greedy ``generate`` (static cache + torch.compile on CUDA) per batch <= 8."""
    rows: list[Row] = []
    trellis = {row.rows: row for row in decode_rows if row.what == "decode" and row.workload == "free"}
    for batch in [b for b in plan.batches if b <= GENERATE_MAX_BATCH]:
        step_ms = generate_step_ms(hf_model, batch, plan)
        ours = trellis.get(batch)
        note = "static cache + torch.compile" if plan.device.type == "cuda" else "eager (CPU)"
        if ours is not None and ours.ms:
            note += f"; Trellis {step_ms / ours.ms:.2f}x faster per step"
        rows.append(Row(shape, "hf generate", batch, "free", "-", tok_s=1000 * batch / step_ms, ms=step_ms,
                        x_floor=step_ms / floor_ms, note=note))
        print(format_row(rows[-1]), flush=True)
    return rows


def generate_step_ms(hf_model, batch: int, plan: Plan) -> float:
    """ms per decode step of ``generate``: (time of long - time of short) / extra tokens, best of 3."""
    prompt = torch.randint(100, 1000, (batch, 32), device=plan.device)
    short, extra = 4, plan.steps

    def timed(new_tokens: int) -> float:
        options = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                   "pad_token_id": 0, "cache_implementation": "static"}
        if plan.device.type != "cuda":
            options["disable_compile"] = True
        synchronize(plan.device)
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        synchronize(plan.device)
        return time.perf_counter() - start

    for _ in range(2):  # compiles (CUDA) and warms both lengths
        timed(short), timed(short + extra)
    best = min(timed(short + extra) - timed(short) for _ in range(3))
    return 1000 * max(best, 1e-9) / extra


def path_note(engine: Engine, before: dict[str, int]) -> str:
    """Forward passes by path since ``before`` (warm-up and measured steps; a GraphedRunner only)."""
    counts = getattr(engine.runner, "path_counts", None)
    if counts is None:
        return ""
    return "forwards: " + ", ".join(f"{path.replace('_', ' ')} {counts[path] - before.get(path, 0)}" for path in counts)


def decode_rate(engine: Engine, prompt: list[int], compiled, batch: int, plan: Plan) -> tuple[float, float]:
    """Output tok/s and ms per step with ``batch`` sequences kept running."""
    workload = Workload(engine, prompt, compiled, max_tokens=plan.decode_len - len(prompt) - 8, seed=1000)
    for _ in range(batch):
        workload.submit()
    for _ in range(plan.warmup):
        engine.step()
    synchronize(plan.device)
    before, tokens = _snapshot(engine.stats), workload.output_tokens
    started = time.perf_counter()
    for _ in range(plan.steps):
        engine.step()
    engine.flush()
    synchronize(plan.device)
    elapsed = time.perf_counter() - started
    steps = max(_snapshot(engine.stats)["steps"] - before["steps"], 1)
    workload.stopped = True
    release(engine)
    return (workload.output_tokens - tokens) / elapsed, 1000 * elapsed / steps


def profile_decode(engine: Engine, prompt: list[int], compiled, batch: int, plan: Plan, label: str) -> None:
    """The same workload again under torch.profiler (``--profile DIR``): ``DIR/label.txt``."""
    from benchmarks.step_profile import profile_steps

    workload = Workload(engine, prompt, compiled, max_tokens=plan.decode_len - len(prompt) - 8, seed=2000)
    for _ in range(batch):
        workload.submit()
    for _ in range(plan.warmup):
        engine.step()
    wall_ms, kernel_ms = profile_steps(engine, plan.steps, plan.device, plan.profile_dir / f"{label}.txt", label)
    print(f"  profile {label}: wall {wall_ms:.2f} ms/step, device kernels {kernel_ms:.2f} ms/step", flush=True)
    workload.stopped = True
    release(engine)


def chat_prompt(tokenizer) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


# ---------------------------------------------------------------- time to first token


def measure_ttft(hf_model, tokenizer, plan: Plan, shape: str, what: str = "ttft") -> list[Row]:
    """A warm-up prompt, then a cold prompt and one sharing all but its last block with it."""
    engine = build_engine(hf_model, tokenizer, max_batch_size=1, max_model_len=plan.prompt_tokens + 64,
                          jump_forward=False, enforce_eager=plan.enforce_eager, overlap=plan.overlap,
                          batch_invariant=plan.batch_invariant)
    generator = torch.Generator().manual_seed(7)

    def random_ids(count: int) -> list[int]:
        return torch.randint(1000, len(tokenizer) - 1000, (count,), generator=generator).tolist()

    shared = (plan.prompt_tokens - PREFIX_BLOCK) // PREFIX_BLOCK * PREFIX_BLOCK
    prefix = random_ids(shared)
    first_token_s(engine, random_ids(plan.prompt_tokens), plan.device)  # kernels warm, nothing shared
    cold = first_token_s(engine, prefix + random_ids(plan.prompt_tokens - shared), plan.device)
    cached = first_token_s(engine, prefix + random_ids(plan.prompt_tokens - shared), plan.device)
    retire(engine)
    del engine
    free_memory(plan.device)
    label = f"{plan.prompt_tokens}-token prompt"
    rows = [Row(shape, what, 1, f"cold {label}", "-", ms=1000 * cold),
            Row(shape, what, 1, f"same {shared}-token prefix again", "-", ms=1000 * cached,
                note=f"{cold / cached:.2f}x sooner than cold")]
    for row in rows:
        print(format_row(row), flush=True)
    return rows


def first_token_s(engine: Engine, prompt: list[int], device: torch.device) -> float:
    """Seconds from submit until the first output token is emitted (the engine stepped inline)."""
    got: list[int] = []
    done: list[bool] = []

    def sink(delta) -> None:
        got.extend(delta.token_ids)
        if delta.finish_reason is not None:
            done.append(True)

    engine.submit(GenerationRequest(request_id=f"ttft{time.monotonic_ns()}", prompt_token_ids=prompt,
                                    params=SamplingParams(temperature=0.0), max_tokens=1, sink=sink, ignore_eos=True))
    started = time.perf_counter()
    while not got and not done:
        engine.step()
    synchronize(device)
    elapsed = time.perf_counter() - started
    while not done:
        engine.step()
    return elapsed


# ---------------------------------------------------------------- HTTP through trellis serve


def measure_http(hf_model, tokenizer, tokenizer_dir: Path, plan: Plan, shape: str, floor_ms: float) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix=f"trellis-gpu-{shape}-") as directory:
        save_model_dir(hf_model, tokenizer_dir, Path(directory))
        with served(Path(directory), plan) as base_url:
            for clients in plan.clients:
                free_rate = None
                for name, extra in (("free", None), ("json_schema", {"response_format": JSON_FORMAT})):
                    requests = max(4, 2 * clients)
                    level = asyncio.run(run_level(base_url, "bench", clients, requests, plan.http_tokens, extra))
                    rate = level["tok_s"]
                    free_rate = rate if name == "free" else free_rate
                    step_ms = 1000 * clients / rate if rate else None
                    rows.append(Row(shape, "http", clients, name, "on", tok_s=rate, ms=step_ms,
                                    x_floor=step_ms / floor_ms if step_ms else None,
                                    vs_free=rate / free_rate if free_rate else None,
                                    note=f"TTFT p50 {level['ttft_p50']:.2f} s, TPOT {level['tpot_ms']:.1f} ms"))
                    print(format_row(rows[-1]), flush=True)
    return rows


def save_model_dir(hf_model, tokenizer_dir: Path, directory: Path) -> None:
    """The random model's weights plus the tokenizer files: a directory ``trellis serve`` loads."""
    hf_model.save_pretrained(directory)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name.startswith(TOKENIZER_FILES):
            shutil.copy(item, directory / item.name)


class served:
    """``trellis serve`` on a free loopback port for the duration of a ``with`` block."""

    def __init__(self, model_dir: Path, plan: Plan) -> None:
        self.model_dir, self.plan = model_dir, plan
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="trellis-serve-", suffix=".log", delete=False)

    def __enter__(self) -> str:
        port = free_port()
        command = [sys.executable, "-m", "server.cli", "serve", "--model", str(self.model_dir),
                   "--served-model-name", "bench", "--port", str(port), "--device", self.plan.device.type,
                   "--max-batch-size", str(max(self.plan.clients)), "--max-model-len", str(self.plan.decode_len),
                   "--log-requests", "off", "--enforce-eager", "on" if self.plan.enforce_eager else "off",
                   "--overlap", self.plan.overlap, "--batch-invariant", "on" if self.plan.batch_invariant else "off",
                   *self.plan.server_args]
        if self.plan.device.type == "cuda":
            command += ["--dtype", "bfloat16" if self.plan.dtype == torch.bfloat16 else "float32"]
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": python_path})
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, self.process, self.log.name)
        for extra in (None, {"response_format": JSON_FORMAT}):  # compile the schema, warm both paths
            asyncio.run(run_level(base_url, "bench", 1, 1, 4, extra))
        return base_url

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_ready(base_url: str, process: subprocess.Popen, log_path: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"trellis serve exited ({process.returncode}):\n{Path(log_path).read_text()[-4000:]}")
        try:
            if httpx.get(base_url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"trellis serve not ready after {timeout_s:.0f} s (log: {log_path})")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the table


HEADER = ("| shape | what | batch / clients | workload | jump-forward | output tok/s | ms (step / TTFT) | "
          "x floor | vs free | note |\n|---|---|---|---|---|---|---|---|---|---|")


def format_row(row: Row) -> str:
    number = lambda value, spec: "-" if value is None else format(value, spec)  # noqa: E731
    return (f"| {row.shape} | {row.what} | {row.rows} | {row.workload} | {row.jump} | {number(row.tok_s, '.1f')} | "
            f"{number(row.ms, '.2f')} | {number(row.x_floor, '.2f')} | {number(row.vs_free, '.2f')} | {row.note} |")


def run(plan: Plan, tokenizer_dir: Path) -> dict:
    tokenizer = load_tokenizer(tokenizer_dir)
    bandwidth = copy_bandwidth(plan.device, plan.bandwidth_bytes)
    print(f"device={describe(plan.device)} dtype={plan.dtype} copy bandwidth={bandwidth / 1e9:.1f} GB/s "
          f"(read + written) overlap={plan.overlap} batch_invariant={plan.batch_invariant} "
          f"quantization={' '.join(plan.quantizations)}", flush=True)
    compiler = ConstraintCompiler(tokenizer, len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    reports: dict[str, ShapeReport] = {}
    try:
        for shape in plan.shapes:
            hf_model = build_model(shape, len(tokenizer), tokenizer.eos_token_id, plan.dtype, plan.device)
            size = weight_bytes(hf_model)
            report = reports[shape] = ShapeReport(weight_bytes=size, floor_ms=1000 * size / bandwidth)
            print(f"{shape}: {size / 1e9:.2f} GB of weights -> HBM floor {report.floor_ms:.3f} ms per decode step "
                  f"({1000 / report.floor_ms:.0f} tok/s at batch 1)", flush=True)
            print(HEADER, flush=True)
            compiled = compiler.compile(ConstraintSpec("json_schema", PEOPLE))
            if "none" in plan.quantizations:
                hf_model = measure_bf16(hf_model, tokenizer, tokenizer_dir, compiled, plan, shape, report)
            if "fp8" in plan.quantizations:
                hf_model = hf_model.to(plan.device)  # back from the CPU after the HTTP part
                report.rows += measure_fp8(hf_model, tokenizer, compiled, plan, shape, report)
            del hf_model
            free_memory(plan.device)
    finally:
        compiler.close()
    print(f"\ndevice={describe(plan.device)} copy bandwidth={bandwidth / 1e9:.1f} GB/s; floors: "
          + ", ".join(f"{shape} {r.floor_ms:.3f} ms" for shape, r in reports.items()))
    print(HEADER)
    for report in reports.values():
        for row in report.rows:
            print(format_row(row))
    return {"device": describe(plan.device), "dtype": str(plan.dtype), "bandwidth_bytes_per_s": bandwidth,
            "enforce_eager": plan.enforce_eager, "max_graph_tokens": plan.max_graph_tokens,
            "overlap": plan.overlap, "quantizations": plan.quantizations,
            "shapes": {shape: {"weight_bytes": r.weight_bytes, "floor_ms": r.floor_ms,
                               "fp8_weight_bytes": r.fp8_weight_bytes, "fp8_floor_ms": r.fp8_floor_ms,
                               "rows": [asdict(row) for row in r.rows]} for shape, r in reports.items()}}


def measure_bf16(hf_model, tokenizer, tokenizer_dir: Path, compiled, plan: Plan, shape: str, report: ShapeReport):
    """The parts on the model as built; returns the model (moved to the CPU by the HTTP part)."""
    if "decode" in plan.parts:
        report.rows += measure_decode(hf_model, tokenizer, compiled, plan, shape, report.floor_ms)
    if "generate" in plan.parts:
        report.rows += measure_generate(hf_model, plan, shape, report.floor_ms, report.rows)
    if "ttft" in plan.parts:
        report.rows += measure_ttft(hf_model, tokenizer, plan, shape)
    if "http" in plan.parts:
        hf_model = hf_model.cpu() if plan.device.type == "cuda" else hf_model  # room for the server's copy
        free_memory(plan.device)
        report.rows += measure_http(hf_model, tokenizer, tokenizer_dir, plan, shape, report.floor_ms)
    return hf_model


def describe(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def make_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return Plan(device=torch.device("cpu"), dtype=torch.float32, shapes=["tiny"], parts=args.parts,
                    batches=args.batches or [2], clients=args.clients or [2], steps=args.steps or 3,
                    warmup=2, decode_len=256, prompt_tokens=args.prompt_tokens or 200, http_tokens=8,
                    enforce_eager=args.enforce_eager, bandwidth_bytes=16 << 20,
                    max_graph_tokens=args.max_graph_tokens, server_args=["--compile-workers", "1"],
                    profile_dir=args.profile, quantizations=args.quantization, overlap=args.overlap,
                    batch_invariant=args.batch_invariant)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    return Plan(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                shapes=args.shapes, parts=args.parts, batches=args.batches or [1, 8, 64, 256],
                clients=args.clients or [1, 16, 64, 256], steps=args.steps or 32, warmup=8, decode_len=1024,
                prompt_tokens=args.prompt_tokens or 4000, http_tokens=128, enforce_eager=args.enforce_eager,
                bandwidth_bytes=1 << 30 if device.type == "cuda" else 256 << 20,
                max_graph_tokens=args.max_graph_tokens, profile_dir=args.profile,
                quantizations=args.quantization, overlap=args.overlap, batch_invariant=args.batch_invariant)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the tokenizer files (default: the converted default model's)")
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode batches (default 1 8 64 256)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="HTTP clients (default 1 16 64 256)")
    parser.add_argument("--steps", type=int, default=None, help="measured decode steps per row (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="TTFT prompt length (default 4000)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (compare with graphed)")
    parser.add_argument("--max-graph-tokens", type=int, default=512,
                        help="piecewise graphs of mixed steps up to this many tokens; 0: mixed steps eager")
    parser.add_argument("--quantization", nargs="+", default=["none"], choices=QUANTIZATIONS,
                        help="none: the bf16 model's rows; fp8: its projections in FP8, decode (and TTFT) rows "
                             "with the speed-up over bf16 where none ran too (default: none)")
    parser.add_argument("--overlap", default="auto", choices=list(OVERLAP),
                        help="the engine's overlapped loop (Engine overlap=None/True/False): auto (on with CUDA)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the runner's batch-invariant kernels (serve --batch-invariant on): their cost")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="also profile every decode row (torch.profiler tables, one file per row, in DIR)")
    args = parser.parse_args(argv)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from server.model_loader import default_model_dir

        tokenizer_dir = default_model_dir(show_progress=True)
    result = run(make_plan(args), tokenizer_dir)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
