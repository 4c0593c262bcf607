"""Soak test: many concurrent streaming chat clients against a running Trellis server (loopback).

    python benchmarks/load.py --base-url http://127.0.0.1:8000 --clients 200 --duration 60 \\
        --disconnect-fraction 0.1 --structured-fraction 0.5 [--max-tokens 64] [--warmup 20] [--pid PID]
    python benchmarks/load.py --smoke --base-url http://127.0.0.1:8000   # 4 clients for 3 s: checks it runs

Each client sends streamed chat requests back to back until ``--duration`` is over, then finishes
the one in flight. Per request it decides (seeded) whether to ask for a small JSON object through
``response_format: json_schema`` and whether to hang up after a few chunks. A 429 is honoured:
the client waits for ``Retry-After`` (capped by ``--retry-cap``) before its next request, and
the report says how often a request sent after the whole ``Retry-After`` was admitted.

Reported as a markdown table: requests completed / errors / 429s / disconnected, time to first
token p50 and p99 of admitted requests (against 1.5 x ``--max-queue-wait``), 429s whose
``Retry-After`` honoured got in, whether every structured output that finished validates against its schema,
whether running sequences are back to 0 afterwards, and the server's resident memory before and
after the measured run, "before" read after ``--warmup`` seconds of the same load (pages the KV cache
and allocators touch once are not a leak; ``/metrics`` ``process_resident_memory_bytes``, or ``/proc/<pid>/status`` with ``--pid``)
with a "back within 10%" line. Parts that need ``/metrics`` are skipped when the server has none.

Exit status 1 when a finished structured output is invalid or sequences are still running after
the settle time; 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

PROMPTS = [
    "Describe a person you admire.",
    "Tell me about a city you would like to visit.",
    "Write two sentences about the sea.",
    "What makes a good breakfast?",
    "Introduce a fictional character.",
    "Explain why people keep pets.",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURED_PROMPT = "Reply with a JSON object describing a person: a short name, an age and up to three tags."

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    rate_limited: int = 0
    returned: int = 0  # requests sent after waiting a whole Retry-After
    returned_admitted: int = 0  # of those, not refused again
    errors: Counter = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    output_tokens: int = 0
    structured_finished: int = 0
    structured_valid: int = 0
    structured_cut: int = 0
    invalid_examples: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- server probes


def _parse_metrics(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels ignored); enough for gauges and totals."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        if "{" in name_part and "}" not in name_part:  # a label value with a space in it
            rest = line[line.index("}") + 1 :].strip()
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


async def read_metrics(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        response = await client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return _parse_metrics(response.text)


async def read_load(client: httpx.AsyncClient) -> tuple[float | None, float | None, str]:
    """(running, waiting, source) from /metrics, else from /health."""
    metrics = await read_metrics(client)
    if metrics and "trellis_running_sequences" in metrics:
        return metrics["trellis_running_sequences"], metrics.get("trellis_waiting_sequences"), "/metrics"
    try:
        health = (await client.get("/health", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        return None, None, "unavailable"
    return health.get("running"), health.get("waiting"), "/health"


async def read_rss(client: httpx.AsyncClient, pid: int | None) -> tuple[float | None, str]:
    """Resident memory in bytes and where it came from."""
    if pid is not None:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024.0, f"/proc/{pid}/status"
        except OSError as exc:
            return None, f"/proc/{pid}/status unreadable ({exc.strerror})"
    metrics = await read_metrics(client)
    if metrics and "process_resident_memory_bytes" in metrics:
        return metrics["process_resident_memory_bytes"], "/metrics"
    return None, "unavailable (no /metrics and no --pid)"


# --------------------------------------------------------------------------- one client


def _validator():
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.Draft202012Validator(SCHEMA)


async def one_request(client, args, model, rng, tally: Tally, validator, stop_at: float,
                      returning: bool = False) -> tuple[float, bool]:
    """Run one streamed request (``returning``: after a whole Retry-After); returns how long to
    wait before the next one and whether that is the whole Retry-After (0, False: no 429)."""
    structured = rng.random() < args.structured_fraction
    disconnect_after = rng.randint(1, 5) if rng.random() < args.disconnect_fraction else None
    body = {
        "model": model,
        "messages": [{"role": "user", "content": STRUCTURED_PROMPT if structured else rng.choice(PROMPTS)}],
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "seed": rng.randrange(2**31),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if structured:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    else:
        body["ignore_eos"] = True
    tally.started += 1
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    finish = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, timeout=args.request_timeout) as response:
            tally.returned += returning
            tally.returned_admitted += returning and response.status_code != 429
            if response.status_code == 429:
                return await _refused(response, args, tally, stop_at)
            if response.status_code != 200:
                await response.aread()
                tally.errors[f"HTTP {response.status_code}"] += 1
                return 0.0, False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    tally.errors[f"stream error {chunk['error'].get('code')}"] += 1
                    return 0.0, False
                if chunk.get("usage"):
                    tally.output_tokens += chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        if first is None:
                            first = time.perf_counter()
                            tally.ttft.append(first - started)
                        text.append(delta["content"])
                        chunks += 1
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                if disconnect_after is not None and chunks >= disconnect_after:
                    tally.disconnected += 1
                    return 0.0, False  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException:
        tally.errors["timeout"] += 1
        return 0.0, False
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
        return 0.0, False
    except json.JSONDecodeError:
        tally.errors["bad SSE payload"] += 1
        return 0.0, False
    if finish is None:
        tally.errors["stream ended without finish_reason"] += 1
        return 0.0, False
    tally.completed += 1
    if structured:
        if finish == "stop":
            tally.structured_finished += 1
            output = "".join(text)
            try:
                value = json.loads(output)
                ok = validator.is_valid(value) if validator is not None else isinstance(value, dict)
            except json.JSONDecodeError:
                ok = False
            if ok:
                tally.structured_valid += 1
            elif len(tally.invalid_examples) < 3:
                tally.invalid_examples.append(output[:200])
        else:
            tally.structured_cut += 1
    return 0.0, False


async def _refused(response, args, tally: Tally, stop_at: float) -> tuple[float, bool]:
    """A 429: how long to wait before the next request, and whether that is its whole Retry-After."""
    tally.rate_limited += 1
    await response.aread()
    header = response.headers.get("retry-after")
    if header is None:
        tally.errors["429 without Retry-After"] += 1
    try:
        wanted = float(header or "1")
    except ValueError:
        tally.errors["429 with a bad Retry-After"] += 1
        wanted = 1.0
    wait = max(0.0, min(wanted, args.retry_cap, stop_at - time.monotonic()))
    return wait, wait >= wanted


async def client_loop(index: int, client, args, model, tally: Tally, validator, stop_at: float) -> None:
    rng = random.Random(args.seed * 100_003 + index)
    await asyncio.sleep(rng.random() * min(2.0, args.duration / 10))  # spread the start
    returning = False
    while time.monotonic() < stop_at:
        wait, returning = await one_request(client, args, model, rng, tally, validator, stop_at, returning)
        if wait > 0:
            await asyncio.sleep(wait)


# --------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _within_wait(p99: float | None, limit: float) -> str:
    if p99 is None or limit <= 0:
        return "n/a"
    bound = 1.5 * limit
    return f"{'yes' if p99 <= bound else 'NO'} ({p99:.1f} s vs {bound:g} s)"


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / whole * 100:.0f}%)" if whole else "n/a (none returned)"


async def _run_clients(client, args, model, tally: Tally, validator, duration: float) -> None:
    """``args.clients`` client loops starting requests for ``duration`` seconds."""
    stop_at = time.monotonic() + duration
    tasks = [asyncio.create_task(client_loop(i, client, args, model, tally, validator, stop_at))
             for i in range(args.clients)]
    done, pending = await asyncio.wait(tasks, timeout=duration + args.request_timeout + 30)
    for task in pending:  # a request stuck past every timeout: give up on it
        task.cancel()
        tally.errors["abandoned at the end"] += 1
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            tally.errors[f"client crash {type(task.exception()).__name__}"] += 1


async def _settle(client, args):
    """Wait (up to ``args.settle``) for running sequences to reach 0; returns the last reading."""
    settle_deadline = time.monotonic() + args.settle
    running, waiting, load_source = await read_load(client)
    while running not in (None, 0) and time.monotonic() < settle_deadline:
        await asyncio.sleep(0.5)
        running, waiting, load_source = await read_load(client)
    await asyncio.sleep(min(2.0, args.settle))  # let freed memory be returned
    return running, waiting, load_source


async def main_async(args) -> int:
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=args.request_timeout) as client:
        model = args.model
        if model is None:
            models = (await client.get("/v1/models", timeout=30)).json()
            model = models["data"][0]["id"]
        validator = _validator()
        if args.warmup > 0:  # first-touch pages (KV cache, allocator pools) are not a leak: warm them first
            await _run_clients(client, args, model, Tally(), validator, args.warmup)
            await _settle(client, args)
        rss_before, rss_source = await read_rss(client, args.pid)

        tally = Tally()
        began = time.monotonic()
        await _run_clients(client, args, model, tally, validator, args.duration)
        elapsed = time.monotonic() - began
        running, waiting, load_source = await _settle(client, args)
        rss_after, _ = await read_rss(client, args.pid)

    rows = [
        ("server", args.base_url),
        ("model", model),
        ("clients / duration", f"{args.clients} / {args.duration:g} s (ran {elapsed:.1f} s)"),
        ("max_tokens / structured / disconnect", f"{args.max_tokens} / {args.structured_fraction:g} / "
                                                 f"{args.disconnect_fraction:g}"),
        ("requests started", tally.started),
        ("completed", tally.completed),
        ("errors", sum(tally.errors.values())
         if not tally.errors else f"{sum(tally.errors.values())} ({', '.join(f'{k}: {v}' for k, v in tally.errors.most_common())})"),
        ("429 rate limited", tally.rate_limited),
        ("disconnected by client", tally.disconnected),
        ("output tokens/s", f"{tally.output_tokens / elapsed:.1f}" if elapsed > 0 else "n/a"),
        ("TTFT p50 (ms)", _ms(percentile(tally.ttft, 50))),
        ("TTFT p99 (ms)", _ms(percentile(tally.ttft, 99))),
        ("TTFT p99 within 1.5 x max-queue-wait", _within_wait(percentile(tally.ttft, 99), args.max_queue_wait)),
        ("429s honoured, then admitted", _share(tally.returned_admitted, tally.returned)),
    ]
    structured_ok = tally.structured_valid == tally.structured_finished
    structured_line = (f"{'yes' if structured_ok else 'NO'} ({tally.structured_valid}/{tally.structured_finished} "
                       f"finished valid; {tally.structured_cut} cut by max_tokens)")
    if validator is None:
        structured_line += " [jsonschema missing: checked as JSON objects only]"
    rows.append(("structured outputs validate", structured_line))
    settled = running == 0
    rows.append(("running sequences back to 0",
                 "n/a (no /metrics or /health counts)" if running is None
                 else f"{'yes' if settled else 'NO'} (running {running:g}, waiting {waiting if waiting is not None else 'n/a'}; "
                      f"from {load_source})"))
    rows.append(("resident memory before / after (MiB)", f"{_mib(rss_before)} / {_mib(rss_after)} (from {rss_source})"))
    if rss_before and rss_after:
        within = rss_after <= rss_before * 1.10
        rows.append(("memory back within 10%", f"{'yes' if within else 'no'} ({(rss_after / rss_before - 1) * 100:+.1f}%)"))
    else:
        rows.append(("memory back within 10%", "n/a"))

    print("| metric | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {str(value).replace('|', '/')} |")
    for example in tally.invalid_examples:
        print(f"\ninvalid structured output: {example!r}")
    failed = (not structured_ok) or (running is not None and not settled)
    return 1 if failed else 0


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
# (32 tokens: the tiny model's structured outputs finish, so their validation is exercised)
SMOKE = {"clients": 4, "duration": 3.0, "max_tokens": 32, "warmup": 0.0, "settle": 10.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--base-url`` must be loopback); ``--smoke`` shrinks the soak to seconds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server on loopback")
    parser.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    parser.add_argument("--clients", type=int, default=200, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to keep starting requests")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1,
                        help="share of requests that hang up after a few chunks")
    parser.add_argument("--structured-fraction", type=float, default=0.5,
                        help="share of requests that ask for a JSON object via response_format json_schema")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--retry-cap", type=float, default=600.0,
                        help="most seconds to honour a Retry-After (the server gives at most 300)")
    parser.add_argument("--max-queue-wait", type=float, default=20.0,
                        help="the server's --max-queue-wait, to judge TTFT p99 against (0 = not judged)")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds to wait afterwards for running sequences to drain")
    parser.add_argument("--warmup", type=float, default=20.0,
                        help="seconds of the same load before memory is first read (0 = none)")
    parser.add_argument("--pid", type=int, default=None, help="server process id, to read its memory from /proc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="4 clients for 3 s, 32 tokens, no warm-up, 10 s to settle: checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes are defaults: flags given still win (see benchmarks/smoke.py)
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    host = urlsplit(args.base_url).hostname
    if host not in LOOPBACK:
        parser.error(f"--base-url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {host!r}")
    for name in ("disconnect_fraction", "structured_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        parser.error("--clients, --duration and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its table; returns the exit status (1: invalid output or not settled)."""
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
