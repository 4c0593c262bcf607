"""LoRA cost in the batched forward: one decode step of a full batch, all rows on the base model vs
all rows on one adapter vs rows spread over several adapters and the base, back to back in one run.

Adapters are random peft LoRAs (all seven projections) built for the model at start (needs peft,
from the test extra). Prints the median step time per workload (over interleaved rounds) and its ratio to the base-only step.

    python benchmarks/lora_bench.py --batch 8 --rank 16 --adapters 3
    python benchmarks/lora_bench.py --smoke --model DIR   # batch 2, rank 4, one step: checks it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.lora_adapters import make_adapter  # noqa: E402
from benchmarks.smoke import parse_with_smoke  # noqa: E402
from server.engine.lora import LoraBank, load_adapter  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype  # noqa: E402
from server.engine.step_batch import StepBatch  # noqa: E402
from server.model_loader import default_model_dir  # noqa: E402


def step_ms(runner: ModelRunner, batch: int, adapters: list[int], steps: int) -> float:
    """Median ms of a decode step with every sequence at position 128 (after a few warm-up steps)."""
    per_seq = -(-256 // runner.block_size)
    rows = [([1 + slot * per_seq + i for i in range(per_seq)], [100 + slot], 128) for slot in range(batch)]
    step = StepBatch.build(rows, runner.block_size, runner.device, row_adapters=adapters)
    times = []
    for i in range(steps + 3):
        started = time.perf_counter()
        runner.forward(step)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"batch": 2, "rank": 4, "adapters": 2, "steps": 1, "rounds": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes batch 2, rank 4, 2 adapters, one step in one round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a local HF directory")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    args = parse_with_smoke(parser, argv, SMOKE, "batch 2, rank 4, 2 adapters, 1 step: checks it runs")
    return args


def build_runner(directory: Path, args: argparse.Namespace, device: torch.device) -> ModelRunner:
    """The model with ``args.adapters`` random LoRA adapters in its bank."""
    hf = load_hf_model(directory, resolve_dtype("auto", device), device)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [make_adapter(directory, Path(tmp) / f"a{i}", seed=i, rank=args.rank) for i in range(args.adapters)]
        bank = LoraBank([load_adapter(f"a{i}", path, hf) for i, path in enumerate(paths)])
    return ModelRunner.for_sequences(hf, args.batch, 256, lora=bank)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Time every workload; returns the median step ms per workload as printed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    directory = default_model_dir() if args.model == "default" else Path(args.model)
    runner = build_runner(directory, args, device)
    workloads = {
        "base only": [0] * args.batch,
        "one adapter": [1] * args.batch,
        f"{args.adapters} adapters + base": [i % (args.adapters + 1) for i in range(args.batch)],
    }
    samples: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.rounds):  # interleaved rounds, so a busy moment of the machine hits every workload
        for name, adapters in workloads.items():
            samples[name].append(step_ms(runner, args.batch, adapters, args.steps))
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["base only"]
    print(f"| batch | rank | workload | step ms | vs base |\n|---|---|---|---|---|")
    for name, ms in results.items():
        print(f"| {args.batch} | {args.rank} | {name} | {ms:.2f} | {ms / base:.2f}x |")
    return results


if __name__ == "__main__":
    main()
