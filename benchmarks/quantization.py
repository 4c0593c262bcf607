"""Quantized weights on the CPU: what they cost in agreement, what they buy in speed.

For each ``--quantization`` (none = the weights as loaded, float32 on the CPU; int8; int4), on
the default model (or ``--model DIR``), in one run:

- size of the linear layers' weights as the decode step reads them, and load time;
- prefill tok/s (one ``--prefill``-token prompt) and decode tok/s at 1 client (free text,
  greedy, ``--max-tokens`` tokens after a short prompt), through the engine;
- agreement with ``none`` on a fixed set of chat prompts, greedy: the share of outputs that are
  identical, the share of tokens before the first difference, and the top-1 agreement when the
  quantized model is fed the unquantized model's own outputs (each position compared on the
  same context: the number that does not compound).

    python benchmarks/quantization.py                 # none, int8, int4 on the default model
    python benchmarks/quantization.py --smoke         # a few prompts and tokens (the test suite runs it)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sampler import SamplingParams  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model  # noqa: E402
from server.engine.sequence import GenerationRequest  # noqa: E402
from server.engine.step_batch import StepBatch  # noqa: E402
from server.model_loader import default_model_dir, load_tokenizer  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.", "How do I reverse a list in Python?", "What causes the seasons on Earth?",
    "Give me a name for a bakery.", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?", "Suggest a healthy breakfast.",
    "Describe a cat to someone who has never seen one.", "What is a prime number?",
    "Write a short apology email for a late reply.", "How many legs does a spider have?",
    "What is the difference between weather and climate?", "Name three planets in the solar system.",
    "Give a tip for learning a new language.", "What does a CPU do?", "Write one sentence about autumn.",
    "How do vaccines work?", "What is the boiling point of water?", "Recommend a book for a long flight.",
]


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def weight_megabytes(runner: ModelRunner) -> float:
    """The linear layers' weights as the decode step reads them, MB."""
    if runner.quantized is not None:
        return runner.quantized.quantized_bytes / 1e6
    if runner.dense.packs:  # float32 panels, or the GGUF grids the weights lie on
        return runner.dense.packed_bytes / 1e6
    tensors = [t for layer in runner.layers for t in (layer.qkv_weight, layer.o_proj.weight, layer.gate_up_weight,
                                                      layer.down_proj.weight)] + [runner.hf.lm_head.weight]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def generate(runner, tokenizer, prompts: list[list[int]], max_tokens: int, slots: int) -> tuple[list[list[int]], dict]:
    """Greedy outputs, ``slots`` at a time; with the time to first token and per output token."""
    engine = Engine(runner, tokenizer, max_batch_size=slots, max_model_len=max(map(len, prompts)) + max_tokens + 8,
                    speculation=False)
    outputs: list[list[int]] = [[] for _ in prompts]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    for i, prompt in enumerate(prompts):
        def sink(delta, i=i) -> None:
            if delta.token_ids and i not in first:
                first[i] = time.perf_counter()
            outputs[i] += delta.token_ids
            if delta.finish_reason is not None:
                done[i] = time.perf_counter()
        engine.submit(GenerationRequest(request_id=f"q{i}", prompt_token_ids=prompt, sink=sink,
                                        params=SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                        eos_token_ids=frozenset({tokenizer.eos_token_id})))
    started = time.perf_counter()
    while len(done) < len(prompts):
        engine.step()
    engine.flush()
    ttft = min(first.values()) - started if first else 0.0
    decode = [(done[i] - first[i], len(out) - 1) for i, out in enumerate(outputs) if len(out) > 1 and i in first]
    per_token = sum(s for s, _ in decode) / max(sum(n for _, n in decode), 1)
    return outputs, {"ttft_s": ttft, "tpot_s": per_token}


def teacher_forced_agreement(runner: ModelRunner, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Share of the reference outputs' tokens that ``runner`` also ranks first, fed the reference's
    context at every position (one forward per prompt, logits at every output position)."""
    agree = total = 0
    block = runner.block_size
    for prompt, output in zip(prompts, outputs, strict=True):
        if not output:
            continue
        tokens = prompt + output[:-1]
        table = list(range(1, 1 + -(-len(tokens) // block)))
        batch = StepBatch.build([(table, tokens, 0)], block, runner.device, logit_counts=[len(output)],
                                prompt_counts=[len(prompt)])
        predicted = runner.forward(batch).argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(predicted, output, strict=True))
        total += len(output)
    return agree / max(total, 1)


def prefix_share(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the reference's tokens before the first difference, over all outputs."""
    same = total = 0
    for a, b in zip(ours, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
        total += len(b)
    return same / max(total, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["none", "int8", "int4"],
                        help="none is always measured first: the others' agreement is with it")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the prefill measurement")
    parser.add_argument("--smoke", action="store_true", help="4 prompts, 8 tokens, a 64-token prefill")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_tokens, args.prefill = 4, 8, 64
    args.kinds = ["none"] + [kind for kind in args.kinds if kind != "none"]  # the reference, first
    directory = args.model or default_model_dir(show_progress=True)
    tokenizer = load_tokenizer(directory)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS[: args.prompts]]
    long_prompt = (tokenizer.encode(" ".join(QUESTIONS) * 40, add_special_tokens=False))[: args.prefill]
    print(f"cpu threads={torch.get_num_threads()} greedy, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"prefill {len(long_prompt)} tokens")
    print("| quantization | linear weights MB | load s | prefill tok/s | decode tok/s (1 client) | "
          "identical outputs | tokens before first difference | top-1 agreement (teacher-forced) |")
    print("|---|---|---|---|---|---|---|---|")
    base_hf = load_hf_model(directory, torch.float32, torch.device("cpu"))
    reference: list[list[int]] | None = None
    rows = []
    for kind in args.kinds:
        hf = copy.deepcopy(base_hf)
        started = time.perf_counter()
        runner = ModelRunner.for_sequences(hf, len(prompts), max(map(len, prompts)) + args.max_tokens + args.prefill,
                                           quantization=kind)
        load_s = time.perf_counter() - started
        outputs, _ = generate(runner, tokenizer, prompts, args.max_tokens, slots=len(prompts))
        _, prefill = generate(runner, tokenizer, [long_prompt], 2, slots=1)
        _, decode = generate(runner, tokenizer, prompts[:1], args.max_tokens * 2, slots=1)
        if reference is None:
            reference = outputs
        row = {"kind": kind, "weights_mb": weight_megabytes(runner), "load_s": load_s,
               "prefill_tok_s": len(long_prompt) / max(prefill["ttft_s"], 1e-9),
               "decode_tok_s": 1 / max(decode["tpot_s"], 1e-9),
               "identical": sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(outputs),
               "prefix": prefix_share(outputs, reference),
               "agreement": teacher_forced_agreement(runner, prompts, reference)}
        rows.append(row)
        print(f"| {kind} | {row['weights_mb']:.0f} | {row['load_s']:.1f} | {row['prefill_tok_s']:.0f} | "
              f"{row['decode_tok_s']:.1f} | {100 * row['identical']:.0f}% | {100 * row['prefix']:.0f}% | "
              f"{100 * row['agreement']:.1f}% |", flush=True)
        del runner, hf
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return {"rows": rows}


if __name__ == "__main__":
    main()
