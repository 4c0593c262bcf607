"""Load test of a running Trellis (or any OpenAI-compatible) server.

For each concurrency level, keeps that many streamed chat requests in flight and prints
requests/s, output tokens/s, time to first token (p50/p95) and time per output token, plus the
output-tokens/s ratio of every level to concurrency 1 (measured in the same run).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 1 4 16
    python benchmarks/serve.py --concurrency 16 --json-schema   # free and json_schema side by side
    python benchmarks/serve.py --concurrency 16 --speculation-ab  # free text, the engine's drafts off vs auto
    python benchmarks/serve.py --smoke --json-schema  # concurrency 1 and 2, 2 requests of 8 tokens each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "List some tips for learning a new language.",
    "Describe the water cycle to a child.",
    "What are the benefits of regular exercise?",
    "Summarize the history of the printing press.",
    "Give advice for a first job interview.",
    "Why is the sky blue?",
]


PEOPLE = {  # the structured workload: a list of people, as benchmarks/decode.py's
    "type": "object",
    "properties": {"people": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}, "member": {"type": "boolean"}},
        "required": ["name", "age", "city", "member"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
JSON_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}}


@dataclass
class Sample:
    ttft: float
    total: float
    tokens: int


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> Sample:
    """One streamed chat request; ``extra`` adds body fields (e.g. a ``response_format``)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    end = time.perf_counter()
    return Sample(ttft=(first or end) - started, total=end - started, tokens=tokens)


async def run_level(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                    extra: dict | None = None) -> dict:
    """``requests`` streamed requests, ``concurrency`` in flight: throughput, TTFT and TPOT."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        queue = list(range(requests))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                samples.append(await one_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, extra))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = sorted(s.ttft for s in samples)
    tpot = [(s.total - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "req_s": len(samples) / elapsed,
        "tok_s": sum(s.tokens for s in samples) / elapsed,
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p95": _pct(ttfts, 95),
        "tpot_ms": 1000 * statistics.mean(tpot) if tpot else float("nan"),
    }


def _pct(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    index = min(len(values) - 1, round(pct / 100 * (len(values) - 1)))
    return values[index]


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"concurrency": [1, 2], "requests_per_level": 2, "max_tokens": 8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes concurrency 1 and 2, 2 requests per level, 8 tokens each."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model id (default: the server's first model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency (at least 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-schema", action="store_true",
                        help="also run every level with a json_schema response_format (ratio to free printed)")
    parser.add_argument("--speculation-ab", action="store_true",
                        help="run every level's free workload with the request field speculation off, then auto "
                             "(ratio of auto to off printed)")
    parser.add_argument("--smoke", action="store_true", help="concurrency 1 and 2, 2 requests per level, 8 tokens: checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes are defaults: flags given still win (see benchmarks/smoke.py)
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    return args


def measure_levels(args: argparse.Namespace, model: str) -> list[tuple[str, dict]]:
    """(workload name, :func:`run_level` result) for every concurrency level and workload."""
    rows = []
    for level in args.concurrency:
        requests = args.requests_per_level or max(4, 2 * level)
        if args.speculation_ab:
            for mode in ("off", "auto"):
                rows.append((f"free, speculation {mode}", asyncio.run(run_level(
                    args.base_url, model, level, requests, args.max_tokens, {"speculation": mode}))))
        else:
            rows.append(("free", asyncio.run(run_level(args.base_url, model, level, requests, args.max_tokens))))
        if args.json_schema:
            rows.append(("json_schema", asyncio.run(run_level(args.base_url, model, level, requests, args.max_tokens,
                                                              JSON_FORMAT))))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Load the server level by level; returns one row per (level, workload) as printed."""
    args = parse_args(argv)
    model = args.model or httpx.get(args.base_url + "/v1/models").json()["data"][0]["id"]
    rows = measure_levels(args, model)
    base = rows[0][1]["tok_s"]
    free: dict[int, float] = {}
    for name, r in rows:  # each level's first free row (speculation off with --speculation-ab)
        if name.startswith("free"):
            free.setdefault(r["concurrency"], r["tok_s"])
    print(f"model={model} max_tokens={args.max_tokens}")
    print("| concurrency | workload | requests | req/s | output tok/s | vs c=1 | vs free | TTFT p50 s | TTFT p95 s | TPOT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, r in rows:
        results.append({"workload": name, **r, "vs_c1": r["tok_s"] / base,
                        "vs_free": r["tok_s"] / free[r["concurrency"]]})
        print(
            f"| {r['concurrency']} | {name} | {r['requests']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / base:.2f}x | {r['tok_s'] / free[r['concurrency']]:.2f}x | {r['ttft_p50']:.2f} | "
            f"{r['ttft_p95']:.2f} | {r['tpot_ms']:.1f} |"
        )
    return results


if __name__ == "__main__":
    main()
