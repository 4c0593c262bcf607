"""Predicted outputs benchmark: output tokens/s without a prediction, with a correct one and with an
edited one (a few words changed in the middle), side by side in one run.

Drives the engine directly (no HTTP), greedy decoding. The baseline run's own text is the
"correct" prediction (tokenized as the API does); the "edited" prediction replaces a span in its
middle, so verification rejects there and re-aligns after it. Every run checks that the output
equals the baseline's. Prints tokens/s, engine steps, accepted/rejected draft tokens and the speed
ratio to the baseline.

    python benchmarks/prediction.py                    # default model on this machine's device
    python benchmarks/prediction.py --tokens 256 --batch 4
    python benchmarks/prediction.py --smoke            # 16 tokens: checks it runs
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
from sampler import SamplingParams  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype  # noqa: E402
from server.engine.sequence import GenerationRequest  # noqa: E402
from server.model_loader import default_model_dir, load_tokenizer  # noqa: E402

PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries."


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, prediction: list[int] | None):
    """Generate for every prompt at once; returns (token lists, seconds, last deltas)."""
    outputs = [[] for _ in prompts]
    last = [None] * len(prompts)

    def sink_for(i):
        def sink(delta):
            outputs[i] += delta.token_ids
            last[i] = delta
        return sink

    steps_before = engine.stats.steps
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens, sink_for(i),
                                        ignore_eos=True, prediction_token_ids=prediction))
    while not all(d is not None and d.finish_reason for d in last):
        engine.step()
    return outputs, time.perf_counter() - started, last, engine.stats.steps - steps_before


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"tokens": 16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` generates 16 tokens per sequence."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a local HF directory")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences generated together")
    parser.add_argument("--max-draft", type=int, default=32, help="draft tokens verified per step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parse_with_smoke(parser, argv, SMOKE, "16 output tokens per sequence: checks it runs")
    return args


def edited(text: str) -> str:
    """``text`` with a span in its middle replaced (the prediction verification rejects, then re-aligns after)."""
    middle = len(text) // 2
    return text[:middle] + " EDITED SPAN HERE " + text[middle + 20 :]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run without a prediction, then with the correct and the edited one; returns the rows as printed."""
    args = parse_args(argv)
    device = torch.device(args.device)
    directory = default_model_dir(show_progress=False) if args.model == "default" else Path(args.model)
    tokenizer = load_tokenizer(directory)
    hf = load_hf_model(directory, resolve_dtype("auto", device), device)
    engine = Engine(ModelRunner.for_sequences(hf, args.batch, 2048), tokenizer, max_batch_size=args.batch,
                    max_model_len=2048, max_draft_tokens=args.max_draft)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=False)
    prompts = [tokenizer(rendered, add_special_tokens=False).input_ids] * args.batch

    run(engine, prompts, 8, None)  # warm-up
    baseline, base_s, _, base_steps = run(engine, prompts, args.tokens, None)
    text = tokenizer.decode(baseline[0])
    cases = {
        "correct": tokenizer.encode(text, add_special_tokens=False),
        "edited": tokenizer.encode(edited(text), add_special_tokens=False),
    }
    total = args.tokens * args.batch
    rows = [{"prediction": "none", "tok_s": total / base_s, "steps": base_steps, "accepted": 0, "rejected": 0,
             "speedup": 1.0, "same": None}]
    print(f"device={device} batch={args.batch} tokens/seq={args.tokens} max_draft={args.max_draft}")
    print(f"{'prediction':<10} {'tok/s':>9} {'steps':>6} {'accepted':>9} {'rejected':>9} {'speedup':>8} same")
    print(f"{'none':<10} {total / base_s:>9.1f} {base_steps:>6} {0:>9} {0:>9} {1.0:>8.2f} -")
    for name, prediction in cases.items():
        outputs, seconds, last, steps = run(engine, prompts, args.tokens, prediction)
        row = {"prediction": name, "tok_s": total / seconds, "steps": steps,
               "accepted": sum(d.accepted_prediction_tokens for d in last),
               "rejected": sum(d.rejected_prediction_tokens for d in last), "speedup": base_s / seconds,
               "same": outputs == baseline}
        rows.append(row)
        print(f"{name:<10} {row['tok_s']:>9.1f} {steps:>6} {row['accepted']:>9} {row['rejected']:>9} "
              f"{row['speedup']:>8.2f} {row['same']}")
    return rows


if __name__ == "__main__":
    main()
