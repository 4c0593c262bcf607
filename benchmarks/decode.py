"""Decode-loop benchmark: free vs structured workloads, jump-forward off/on, back to back in one run.

Drives the engine directly (no HTTP). ``json_schema`` uses the default JSON layout;
``json_schema_ws`` lets the model choose (bounded) whitespace, which leaves less to jump forward. Each workload keeps the batch full (a finished sequence is
replaced at once) and is measured over a fixed number of steps after a warm-up, so every workload
sees the same batch size. Prints output tokens/s, decode step time, mask fill, sampler and forward
time per step, and the ratio of each structured workload to the free one.

    python benchmarks/decode.py                      # default model on this machine's device
    python benchmarks/decode.py --model random-1b    # random-init ~1B Llama (GPU speed work)
    python benchmarks/decode.py --smoke --model DIR  # batch 2, 3 steps, free and json_schema: checks it runs
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.smoke import parse_with_smoke  # noqa: E402
from constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from sampler import SamplingParams  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype  # noqa: E402
from server.engine.sequence import GenerationRequest  # noqa: E402
from server.model_loader import default_model_dir, load_tokenizer  # noqa: E402

PEOPLE = {
    "type": "array",
    "minItems": 30,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "member"],
        "additionalProperties": False,
    },
}
WORKLOADS = {
    "free": None,
    "json_schema": ConstraintSpec("json_schema", PEOPLE),
    "json_schema_ws": ConstraintSpec("json_schema", PEOPLE, {"disable_any_whitespace": False}),
    "regex": ConstraintSpec("regex", r"(\(\d{3}\) \d{3}-\d{4}\n)+"),
    "choice": ConstraintSpec("choice", ["positive", "negative", "neutral", "mixed feelings"]),
}
PROMPT = "List people with their name, age, city and membership."


@dataclass
class Result:
    workload: str
    jump: bool
    tok_s: float
    step_ms: float
    fill_us: float
    sample_us: float
    forward_ms: float


def load_model(name: str, device: torch.device, dtype: str):
    """(HF model, tokenizer): the default model, a random ~1B Llama, or a local HF directory."""
    if name not in ("default", "random-1b"):
        directory = Path(name)
        return load_hf_model(directory, resolve_dtype(dtype, device), device), load_tokenizer(directory)
    tokenizer = load_tokenizer(default_model_dir(show_progress=True))
    if name == "default":
        return load_hf_model(default_model_dir(), resolve_dtype(dtype, device), device), tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(resolve_dtype(dtype, device)).to(device).eval()
    return model, tokenizer


class Workload:
    """Keeps ``batch`` sequences of one kind running on ``engine``: a finished sequence is
    replaced at once, until :attr:`stopped` (so the next workload on the same engine starts from
    an empty batch)."""

    def __init__(self, engine: Engine, prompt: list[int], compiled, max_tokens: int, seed: int, *,
                 temperature: float = 0.7, eos: int = 2) -> None:
        self.engine, self.prompt, self.compiled, self.max_tokens = engine, prompt, compiled, max_tokens
        self.seed = seed
        self.temperature, self.eos = temperature, eos
        self.output_tokens = 0
        self.stopped = False

    def submit(self) -> None:
        self.seed += 1
        self.engine.submit(GenerationRequest(
            request_id=f"b{self.seed}", prompt_token_ids=self.prompt,
            params=SamplingParams(temperature=self.temperature, seed=self.seed), max_tokens=self.max_tokens,
            sink=self._sink, eos_token_ids=frozenset({self.eos}), ignore_eos=self.compiled is None,
            matcher=self.compiled.new_matcher() if self.compiled else None,
        ))

    def _sink(self, delta) -> None:
        self.output_tokens += len(delta.token_ids)
        if delta.finish_reason is not None and not self.stopped:
            self.submit()


MAX_LEN = 1024  # each sequence's context in the benchmark's KV cache


def measure(runner, tokenizer, compiled, *, batch: int, jump: bool, steps: int, warmup: int,
            call_timeout: float | None = None) -> tuple:
    bound = {} if call_timeout is None else {"constraint_call_timeout": call_timeout}
    engine = Engine(runner, tokenizer, max_batch_size=batch, max_model_len=MAX_LEN, jump_forward=jump, **bound)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=False)
    workload = Workload(engine, tokenizer(rendered, add_special_tokens=False).input_ids, compiled,
                        max_tokens=MAX_LEN - 200, seed=1000)
    for _ in range(batch):
        workload.submit()
    for _ in range(warmup):
        engine.step()
    _sync(runner.device)
    before, tokens = _snapshot(engine.stats), workload.output_tokens
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.flush()  # the overlapped loop's last step's tokens
    _sync(runner.device)
    elapsed = time.perf_counter() - started
    after = _snapshot(engine.stats)
    delta = {k: after[k] - before[k] for k in after}
    workload.stopped = True  # the aborted sequences are not replaced
    for seq in list(engine.scheduler.running):  # release the KV blocks for the next workload
        seq.finish("abort")
    engine._report_and_retire()
    return (workload.output_tokens - tokens) / elapsed, elapsed, delta


def _snapshot(stats) -> dict:
    return {"steps": stats.steps, "fill": stats.mask_fill_s, "sample": stats.sample_s, "forward": stats.forward_s}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"batch": [2], "steps": 3, "warmup": 1, "workloads": ["free", "json_schema"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` shrinks the run to seconds (batch 2, 3 steps, free and json_schema)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default', 'random-1b' or a local HF directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 8 32 (CPU), 1 8 32 64 128 (GPU)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--quantization", default="none", choices=["none", "int4", "int8", "bf16"],
                        help="the linear layers' weights (--quantization of the server; CPU)")
    parser.add_argument("--constraint-call-timeout", type=float, default=None,
                        help="the engine's per-row call bound in seconds (0: none; default: the engine's)")
    args = parse_with_smoke(parser, argv, SMOKE, "batch 2, 3 steps, free and json_schema: checks it runs")
    return args


def measure_batch(hf, tokenizer, compiled: dict, args: argparse.Namespace, batch: int) -> list[dict]:
    """Every workload (jump-forward off and on where it applies) at one batch size, printed as measured."""
    model = copy.deepcopy(hf) if args.quantization != "none" else hf  # quantizing re-points its modules
    runner = ModelRunner.for_sequences(model, batch, MAX_LEN, quantization=args.quantization)
    free_rate = None
    rows = []
    for name in args.workloads:
        for jump in ([False] if name == "free" else [False, True]):
            rate, elapsed, d = measure(runner, tokenizer, compiled[name], batch=batch, jump=jump,
                                       steps=args.steps, warmup=args.warmup, call_timeout=args.constraint_call_timeout)
            free_rate = rate if name == "free" else free_rate
            steps = max(d["steps"], 1)
            row = {"batch": batch, "workload": name, "jump": jump, "tok_s": rate,
                   "vs_free": rate / free_rate if free_rate else None, "step_ms": 1000 * elapsed / steps,
                   "fill_us": 1e6 * d["fill"] / steps, "sample_us": 1e6 * d["sample"] / steps,
                   "forward_ms": 1000 * d["forward"] / steps, "steps": d["steps"]}
            rows.append(row)
            ratio = f"{row['vs_free']:.2f}x" if row["vs_free"] is not None else "-"
            print(f"| {batch} | {name} | {'on' if jump else 'off'} | {rate:.1f} | {ratio} | "
                  f"{row['step_ms']:.1f} | {row['fill_us']:.0f} | {row['sample_us']:.0f} | "
                  f"{row['forward_ms']:.1f} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns one row per (batch, workload, jump-forward) as printed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    batches = args.batch or ([1, 8, 32, 64, 128] if device.type == "cuda" else [1, 8, 32])
    hf, tokenizer = load_model(args.model, device, args.dtype)
    compiler = ConstraintCompiler(tokenizer, hf.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id])
    try:
        compiled = {name: compiler.compile(WORKLOADS[name]) if WORKLOADS[name] else None for name in args.workloads}
        print(f"device={device} model={args.model} threads={torch.get_num_threads()} steps={args.steps}")
        print("| batch | workload | jump-forward | output tok/s | vs free | step ms | mask fill µs/step | sampler µs/step | forward ms/step |")
        print("|---|---|---|---|---|---|---|---|---|")
        return [row for batch in batches for row in measure_batch(hf, tokenizer, compiled, args, batch)]
    finally:
        compiler.close()


if __name__ == "__main__":
    main()
