"""Load test of a running Trellis (or any OpenAI-compatible) server.

For each concurrency level, keeps that many streamed chat requests in flight and prints
requests/s, output tokens/s, time to first token (p50/p95) and time per output token, plus the
output-tokens/s ratio of every level to concurrency 1 (measured in the same run).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 1 4 16
    python benchmarks/serve.py --concurrency 16 --json-schema   # free and json_schema side by side
    python benchmarks/serve.py --concurrency 16 --speculation-ab  # free text, the engine's drafts off vs auto
    python benchmarks/serve.py --smoke --json-schema  # concurrency 1 and 2, 2 requests of 8 tokens each
    python benchmarks/serve.py --concurrency 1 16 --json-schema --peer http://127.0.0.1:8081
        # the same workload against another server (llama.cpp's: benchmarks/peer_llamacpp.sh), in turn

With ``--peer``, every level and workload runs against the server, then the peer, and the table
gets one row for each with the server's tok/s over the peer's. json_schema rows count the answers
that parse as JSON and satisfy the schema (``valid``).

``output tok/s`` counts every token over the whole level, the tail included: once the last
request is sent, fewer clients are busy, and answers of unequal length (json_schema's end with
their JSON; free answers with ``ignore_eos`` all take ``--max-tokens``) leave some idle for longer.
``steady tok/s`` is the pace while all ``concurrency`` clients had a request in flight.
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
    text: str = ""
    failed: bool = False  # an error status, an error event in the stream, or the connection dropped
    first_at: float = 0.0  # perf_counter() of the first content and of the end
    end_at: float = 0.0


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
    tokens = content_chunks = 0
    pieces: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(chunk["error"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                content = "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
                if content:
                    first = first or time.perf_counter()
                    content_chunks += 1
                    pieces.append(content)
    except (httpx.HTTPError, ValueError):  # counted, not fatal: a peer's grammar sampler may throw mid-stream
        return Sample(ttft=0.0, total=time.perf_counter() - started, tokens=0, failed=True)
    end = time.perf_counter()
    # a server that reports no usage streams a token per chunk (llama.cpp's does)
    return Sample(ttft=(first or end) - started, total=end - started, tokens=tokens or content_chunks,
                  text="".join(pieces), first_at=first or end, end_at=end)


async def run_level(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                    extra: dict | None = None) -> dict:
    """``requests`` streamed requests, ``concurrency`` in flight: throughput, TTFT and TPOT."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        queue = list(range(requests))
        samples: list[Sample] = []
        drained = []  # when the last request was sent: from then on fewer than `concurrency` are in flight

        async def worker() -> None:
            while queue:
                i = queue.pop()
                if not queue:
                    drained.append(time.perf_counter())
                samples.append(await one_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, extra))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    failed = sum(s.failed for s in samples)
    samples = [s for s in samples if not s.failed]
    ttfts = sorted(s.ttft for s in samples)
    tpot = [(s.total - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "failed": failed,
        "req_s": len(samples) / elapsed,
        "tok_s": sum(s.tokens for s in samples) / elapsed,
        "steady_tok_s": _steady_tok_s(samples, started, drained[0] if drained else started + elapsed),
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p95": _pct(ttfts, 95),
        "tpot_ms": 1000 * statistics.mean(tpot) if tpot else float("nan"),
        "valid": sum(_valid(s.text) for s in samples) / max(len(samples) + failed, 1) if extra and "response_format" in extra else None,
    }


def _steady_tok_s(samples: list[Sample], start: float, drained: float) -> float:
    """Output tokens/s while every client had a request in flight (from the level's start until
    the last request was sent), each request's tokens spread evenly from its first to its last:
    the server's pace at this concurrency, without the tail where answers of unequal length leave
    clients idle (all free answers end together; json_schema answers end when the JSON does)."""
    if drained <= start:
        return float("nan")
    tokens = 0.0
    for s in samples:
        if s.tokens <= 0:
            continue
        span = s.end_at - s.first_at
        if span <= 0:
            tokens += s.tokens if start <= s.first_at <= drained else 0
        else:
            tokens += s.tokens * max(0.0, min(s.end_at, drained) - max(s.first_at, start)) / span
    return tokens / (drained - start)


def _ratio(a: float, b: float) -> float:
    """a / b; nan where b is 0 or nan (a level too short to have a steady part)."""
    return a / b if b and b == b else float("nan")


def _valid(text: str) -> bool:
    """The answer is one JSON value satisfying the json_schema workload's schema."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # without the validator: parses as an object with the required key
        return isinstance(value, dict) and "people" in value
    return jsonschema.Draft202012Validator(PEOPLE).is_valid(value)


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
    parser.add_argument("--peer", default=None, metavar="URL",
                        help="another OpenAI-compatible server: every level and workload runs against it too, in turn")
    parser.add_argument("--peer-model", default=None, help="the peer's model id (default: its first model)")
    parser.add_argument("--smoke", action="store_true", help="concurrency 1 and 2, 2 requests per level, 8 tokens: checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes are defaults: flags given still win (see benchmarks/smoke.py)
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    return args


def measure_levels(args: argparse.Namespace, model: str, peer_model: str | None = None) -> list[tuple[str, dict]]:
    """(workload name, :func:`run_level` result) for every concurrency level and workload; with a
    peer, each workload runs against the server and then the peer (rows named ``… @ peer``)."""
    rows = []
    for level in args.concurrency:
        requests = args.requests_per_level or max(4, 2 * level)
        workloads = [(f"free, speculation {mode}", {"speculation": mode}) for mode in ("off", "auto")] \
            if args.speculation_ab else [("free", None)]
        if args.json_schema:
            workloads.append(("json_schema", JSON_FORMAT))
        for name, extra in workloads:
            rows.append((name, asyncio.run(run_level(args.base_url, model, level, requests, args.max_tokens, extra))))
            if args.peer:
                rows.append((f"{name} @ peer", asyncio.run(run_level(args.peer, peer_model, level, requests,
                                                                     args.max_tokens, extra))))
    return rows


def first_model(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models").json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> list[dict]:
    """Load the server level by level; returns one row per (level, workload) as printed."""
    args = parse_args(argv)
    model = args.model or first_model(args.base_url)
    peer_model = (args.peer_model or first_model(args.peer)) if args.peer else None
    rows = measure_levels(args, model, peer_model)
    base = rows[0][1]["tok_s"]
    free: dict[tuple[int, bool], float] = {}  # (level, peer) -> its first free row's tok/s
    steady_free: dict[tuple[int, bool], float] = {}  # the same row's steady tok/s
    ours: dict[tuple[int, str], float] = {}  # (level, workload) -> the server's tok/s
    for name, r in rows:
        peer = name.endswith(" @ peer")
        if name.startswith("free"):
            free.setdefault((r["concurrency"], peer), r["tok_s"])
            steady_free.setdefault((r["concurrency"], peer), r["steady_tok_s"])
        if not peer:
            ours[(r["concurrency"], name)] = r["tok_s"]
    print(f"model={model} max_tokens={args.max_tokens}" + (f" peer={args.peer} ({peer_model})" if args.peer else ""))
    print("| concurrency | workload | requests | req/s | output tok/s | vs c=1 | vs free | vs peer | valid | "
          "TTFT p50 s | TTFT p95 s | TPOT ms | failed | steady tok/s | steady vs free |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name, r in rows:
        peer = name.endswith(" @ peer")
        vs_peer = ours[(r["concurrency"], name.removesuffix(" @ peer"))] / r["tok_s"] if peer and r["tok_s"] else None
        steady_vs_free = _ratio(r["steady_tok_s"], steady_free[(r["concurrency"], peer)])
        results.append({"workload": name, **r, "vs_c1": r["tok_s"] / base,
                        "vs_free": r["tok_s"] / free[(r["concurrency"], peer)], "ours_vs_peer": vs_peer,
                        "steady_vs_free": steady_vs_free})
        valid = "" if r["valid"] is None else f"{r['valid']:.0%}"
        print(
            f"| {r['concurrency']} | {name} | {r['requests']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / base:.2f}x | {r['tok_s'] / free[(r['concurrency'], peer)]:.2f}x | "
            f"{'' if vs_peer is None else f'{vs_peer:.2f}x'} | {valid} | {r['ttft_p50']:.2f} | "
            f"{r['ttft_p95']:.2f} | {r['tpot_ms']:.1f} | {r['failed']} | {r['steady_tok_s']:.1f} | "
            f"{steady_vs_free:.2f}x |"
        )
    return results


if __name__ == "__main__":
    main()
