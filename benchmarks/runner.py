"""Model runners side by side: transformers' own code over the paged KV cache vs the hand-written forward.

``TransformersRunner`` (server/engine/hf_runner.py: the model's own transformers layers, attention
through :mod:`kernels.paged_attention` over a paged cache) against ``ModelRunner``
(server/engine/model.py: a hand-written Llama forward over the same kind of paged cache), on the
same weights in one process. For each batch size both runners prefill the same prompts, then
greedy-decode; the timed decode steps alternate between the runners in short rounds so that both
see the same machine load. Forward only (no sampler, no engine): prints decode tok/s, ms per step,
the ratio, and for the transformers runner the part of each step spent in ``write_kv`` +
``paged_attention`` (the kernel contract, timed around the calls; on CUDA this column needs the
device synchronised, so it is left out there) to tell transformers' own overhead from the
attention kernel's.

    python benchmarks/runner.py                       # SmolLM2-135M (the default model), batch 1 and 16
    python benchmarks/runner.py --batch 1 8 32 --steps 64 --prompt 256
    python benchmarks/runner.py --smoke --model DIR   # batch 2, a few steps: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.smoke import parse_with_smoke  # noqa: E402
from server.engine import hf_runner  # noqa: E402
from server.engine.hf_runner import TransformersRunner, load_model  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype  # noqa: E402
from server.engine.step_batch import StepBatch  # noqa: E402
from server.model_loader import default_model_dir  # noqa: E402


class PagedDriver:
    """Greedy decoding of ``batch`` sequences on a paged runner, each in its own blocks (block 0
    is left out: the engine reserves it for padded rows)."""

    def __init__(self, runner, prompts: list[list[int]], capacity: int) -> None:
        self.runner = runner
        per_seq = -(-capacity // runner.block_size)
        self.tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
        self.lengths = [len(p) for p in prompts]
        self.next = self._run([(table, prompt, 0) for table, prompt in zip(self.tables, prompts)])

    def _run(self, rows) -> list[int]:
        logits = self.runner.forward(StepBatch.build(rows, self.runner.block_size, self.runner.device))
        return logits.argmax(-1).tolist()

    def step(self) -> None:
        """One greedy decode step of every sequence."""
        rows = [(table, [token], length) for table, token, length in zip(self.tables, self.next, self.lengths)]
        self.next = self._run(rows)
        self.lengths = [length + 1 for length in self.lengths]


class AttentionClock:
    """Seconds spent in the paged runner's write_kv + paged_attention calls (CPU: calls are synchronous)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("write_kv", "paged_attention"):
            setattr(hf_runner, name, self._timed(getattr(hf_runner, name)))

    def _timed(self, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def timed_rounds(drivers: dict, steps: int, round_steps: int, device: torch.device) -> dict[str, float]:
    """Seconds each driver spent on ``steps`` decode steps, taken in alternating rounds."""
    spent = dict.fromkeys(drivers, 0.0)
    done = 0
    while done < steps:
        count = min(round_steps, steps - done)
        for name, driver in drivers.items():
            _sync(device)
            started = time.perf_counter()
            for _ in range(count):
                driver.step()
            _sync(device)
            spent[name] += time.perf_counter() - started
        done += count
    return spent


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


HAND_WRITTEN, TRANSFORMERS = "hand-written (model.py)", "transformers + paged"


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"batch": [2], "prompt": 16, "steps": 2, "warmup": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` shrinks every size to a run of seconds."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a local HF directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per runner")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = parse_with_smoke(parser, argv, SMOKE, "batch 2, 16-token prompts, 2 steps: checks it runs")
    return args


def build_drivers(slot_hf, paged_hf, prompts: list[list[int]], capacity: int, block_size: int) -> dict:
    """Both runners over caches of the same size, each already past its prefill."""
    blocks = 1 + len(prompts) * -(-capacity // block_size)
    return {
        HAND_WRITTEN: PagedDriver(ModelRunner(slot_hf, blocks, block_size), prompts, capacity),
        TRANSFORMERS: PagedDriver(TransformersRunner(paged_hf, blocks, block_size), prompts, capacity),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the comparison; returns one row per (batch, runner) as printed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = resolve_dtype(args.dtype, device)
    directory = default_model_dir() if args.model == "default" else Path(args.model)
    slot_hf = load_hf_model(directory, dtype, device)
    paged_hf = load_model(directory, dtype, device)
    vocab = slot_hf.config.vocab_size
    capacity = args.prompt + args.warmup + args.steps + 1
    print(f"device={device} dtype={dtype} model={directory.name} threads={torch.get_num_threads()} "
          f"prompt={args.prompt} steps={args.steps} block_size={args.block_size}", flush=True)
    clock = AttentionClock() if device.type == "cpu" else None
    print("| batch | runner | decode tok/s | ms/step | vs hand-written | attention ms/step |")
    print("|---|---|---|---|---|---|")
    results = []
    for batch in args.batch:
        generator = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(10, vocab, (args.prompt,), generator=generator).tolist() for _ in range(batch)]
        drivers = build_drivers(slot_hf, paged_hf, prompts, capacity, args.block_size)
        timed_rounds(drivers, args.warmup, args.warmup, device)
        if clock:
            clock.seconds = 0.0
        spent = timed_rounds(drivers, args.steps, 4, device)
        base = spent[HAND_WRITTEN]
        for name, seconds in spent.items():
            attention_ms = 1000 * clock.seconds / args.steps if clock and name == TRANSFORMERS else None
            row = {"batch": batch, "runner": name, "tok_s": batch * args.steps / seconds,
                   "ms_per_step": 1000 * seconds / args.steps, "vs_hand_written": base / seconds,
                   "attention_ms": attention_ms}
            results.append(row)
            attention = "-" if attention_ms is None else f"{attention_ms:.2f}"
            print(f"| {batch} | {name} | {row['tok_s']:.1f} | {row['ms_per_step']:.2f} | "
                  f"{row['vs_hand_written']:.2f}x | {attention} |", flush=True)
    return results


if __name__ == "__main__":
    main()
