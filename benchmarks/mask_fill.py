"""Mask fill per decode step: row by row on one thread vs ``constraints.backends.batch_fill``
(batched, parallel per backend), side by side on the same matcher states.

Each row is a real JSON-schema matcher (xgrammar or llguidance, through Trellis's backends and
the default model's tokenizer) walking a valid instance of its schema, rows spread over the
instance so that they sit at different points. Every step fills all rows four ways (the
order alternates per step) and checks the masks are identical, then advances every row by one
token (a row at the end starts over). The four: the engine's fill before batch_fill (row by row,
empty-mask check in torch), batch_fill on one thread (row by row), the library's batched call
on one thread, and batch_fill on N threads (``--threads``, default min(rows, cores)).
Schemas: a few realistic built-in ones, or valid instances from MaskBench with ``--data``.

    python benchmarks/mask_fill.py [--data ../shared/data/maskbench] [--rows 1,8,64] [--steps 40]
    python benchmarks/mask_fill.py --smoke             # two built-in schemas, 1 and 4 rows, 3 steps
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from constraints.backends.batch_fill import (  # noqa: E402
    default_threads,
    fail_empty_rows,
    fill_bitmasks,
    fill_threads,
)
from constraints.backends.registry import make_backend  # noqa: E402
from constraints.backends.vocabulary import TokenizerContext  # noqa: E402
from constraints.spec import ConstraintSpec  # noqa: E402
from benchmarks.smoke import parse_with_smoke  # noqa: E402

VOCAB = 49152
BUILT_IN: list[tuple[dict, Any]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                },
            },
            "required": ["name", "age", "email", "tags", "address"],
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
         "address": {"street": "12 St James's Square", "city": "London", "zip": "01815"}},
    ),
    (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string"},
                "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "quantity", "price"],
                    },
                },
                "total": {"type": "number"},
                "notes": {"type": ["string", "null"]},
            },
            "required": ["order_id", "status", "items", "total", "notes"],
        },
        {"order_id": "A-2041", "status": "shipped", "items": [
            {"sku": "KB-01", "quantity": 2, "price": 49.5}, {"sku": "MS-77", "quantity": 1, "price": 19.99}],
         "total": 118.99, "notes": None},
    ),
    (
        {
            "type": "object",
            "properties": {
                "function": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                        "include_hourly": {"type": "boolean"},
                    },
                    "required": ["location", "unit", "days", "include_hourly"],
                    "additionalProperties": False,
                },
            },
            "required": ["function", "arguments"],
        },
        {"function": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius",
                                                  "days": 5, "include_hourly": False}},
    ),
    (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 120},
                "start": {"type": "string", "format": "date-time"},
                "attendees": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "optional": {"type": "boolean"}}, "required": ["name"]}},
                "location": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {
                    "lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]}]},
            },
            "required": ["title", "start", "attendees", "location"],
        },
        {"title": "Quarterly planning", "start": "2026-11-23T09:30:00Z",
         "attendees": [{"name": "Grace", "optional": False}, {"name": "Linus"}],
         "location": {"lat": 52.52, "lon": 13.405}},
    ),
]


def maskbench_cases(data: Path, limit: int) -> list[tuple[dict, Any]]:
    """(schema, one valid instance) from MaskBench's small and medium subsets (the large ones
    take minutes to compile in this process), ``limit`` of them."""
    cases = []
    for name in ("Github_medium", "Glaiveai2K", "Github_easy"):
        path = data / f"{name}.jsonl.gz"
        if not path.exists():
            continue
        taken = 0
        with gzip.open(path, "rt") as f:
            for line in f:
                row = json.loads(line)
                valid = [t["data"] for t in row.get("tests", []) if t.get("valid")]
                if valid and len(json.dumps(valid[0])) >= 40:  # long enough to walk for a while
                    cases.append((row["schema"], valid[0]))
                    taken += 1
                if taken >= limit:
                    break
    step = max(1, len(cases) // limit)
    return cases[::step][:limit]


class Walk:
    """One row: a matcher walking the tokens of a valid instance, starting over at the end."""

    def __init__(self, constraint: Any, ids: list[int], start: int) -> None:
        self.constraint, self.ids = constraint, ids
        self.matcher = constraint.new_matcher()
        self.position = 0
        for _ in range(start % len(ids)):
            self.advance()

    def advance(self) -> None:
        if self.position == len(self.ids):
            self.matcher, self.position = self.constraint.new_matcher(), 0
            return
        if not self.matcher.accept_token(self.ids[self.position]):
            raise RuntimeError("the valid instance was refused")
        self.position += 1


def compile_cases(ctx: TokenizerContext, backend: str, cases: list[tuple[dict, Any]]) -> list[tuple[Any, list[int]]]:
    """(compiled constraint, instance tokens) for the cases this backend compiles and walks."""
    be = make_backend(backend, ctx)
    out = []
    for schema, instance in cases:
        spec = ConstraintSpec("json_schema", schema)
        try:
            compiled = be.load(spec, be.compile(spec, schema))
            ids = ctx.encode(json.dumps(instance))
            walk = Walk(compiled, ids, 0)
            for _ in ids:  # the whole instance must be accepted
                walk.advance()
        except Exception:
            continue
        out.append((compiled, ids))
    return out


def engine_before(matchers: list[Any], bitmask: torch.Tensor, valid_bits: torch.Tensor) -> None:
    """The engine's fill before batch_fill: one row after another, then the empty-mask check
    in torch."""
    for i, m in enumerate(matchers):
        try:
            m.fill_bitmask(bitmask, i)
        except Exception:
            bitmask[i] = -1
    empty = (bitmask & valid_bits).eq(0).all(dim=1)
    if bool(empty.any()):
        bitmask[empty] = -1


def batch_api_one_thread(matchers: list[Any], bitmask: torch.Tensor, valid_bits: torch.Tensor) -> None:
    """The library's batched call on one thread for the whole batch (one backend per run), which
    batch_fill skips for one-thread groups: it shows what the call costs besides the fill."""
    type(matchers[0]).fill_bitmask_batch(matchers, bitmask, list(range(len(matchers))), 1)
    fail_empty_rows(bitmask, valid_bits, {})


def measure(compiled: list[tuple[Any, list[int]]], rows: int, steps: int, threads: int) -> dict[str, float]:
    """Mean ms per step: the engine's fill before batch_fill, batch_fill on one thread (row by
    row), the library's batched call on one thread, and batch_fill with ``threads``."""
    walks = []
    for r in range(rows):
        constraint, ids = compiled[r % len(compiled)]
        walks.append(Walk(constraint, ids, (r * 7919) % len(ids)))
    words = (VOCAB + 31) // 32
    valid_bits = torch.full((words,), -1, dtype=torch.int32)
    ways = {
        "before": lambda m, b: engine_before(m, b, valid_bits),
        "row by row": lambda m, b: fill_bitmasks(m, b, max_threads=1, valid_bits=valid_bits),
        "batch API 1t": lambda m, b: batch_api_one_thread(m, b, valid_bits),
        "batched": lambda m, b: fill_bitmasks(m, b, max_threads=threads, valid_bits=valid_bits),
    }
    totals = dict.fromkeys(ways, 0.0)
    masks = {name: torch.zeros((rows, words), dtype=torch.int32) for name in ways}
    for step in range(steps):
        matchers = [w.matcher for w in walks]
        order = list(ways) if step % 2 == 0 else list(reversed(ways))
        for name in order:
            start = time.perf_counter()
            ways[name](matchers, masks[name])
            totals[name] += time.perf_counter() - start
        reference = masks["row by row"]
        for name, mask in masks.items():
            if not torch.equal(mask, reference):
                raise AssertionError(f"{name} differs from the row-by-row fill at step {step}")
        for w in walks:
            w.advance()
    return {name: 1e3 * total / steps for name, total in totals.items()}


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"schemas": 2, "rows": "1,4", "steps": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes two built-in schemas, 1 and 4 rows and 3 steps."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="MaskBench directory (default: built-in schemas)")
    ap.add_argument("--schemas", type=int, default=16, help="schemas taken from --data (or the built-in ones)")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="--mask-fill-threads for batch_fill (0: min(rows, cores))")
    ap.add_argument("--backends", default="xgrammar,llguidance")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="folder with the tokenizer files (default: the default model's)")
    args = parse_with_smoke(ap, argv, SMOKE, "2 built-in schemas, 1 and 4 rows, 3 steps: checks it runs")
    return args


def measure_backend(ctx: TokenizerContext, backend: str, cases: list, row_counts: list[int],
                    args: argparse.Namespace) -> list[dict]:
    """Compile the cases on one backend, then measure (and print) each row count."""
    started = time.perf_counter()
    compiled = compile_cases(ctx, backend, cases)
    print(f"{backend}: {len(compiled)} of {len(cases)} schemas compiled and walked in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if not compiled:
        print(f"| {backend} | no schema compiled |")
        return []
    out = []
    for rows in row_counts:
        threads = args.threads or default_threads(rows)
        result = measure(compiled, rows, args.steps, threads)
        before, base, one, many = (result[k] for k in ("before", "row by row", "batch API 1t", "batched"))
        out.append({"backend": backend, "rows": rows, "schemas": len(compiled), "ms": result,
                    "threads": fill_threads(rows, threads)})
        print(f"| {backend} | {rows} | {len(compiled)} | {before:.3f} | {base:.3f} | {one:.3f} | {many:.3f} | "
              f"{fill_threads(rows, threads)} | {base / many:.2f}x | {before / many:.2f}x |", flush=True)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every backend at every row count; returns one row each (ms per step per way) as printed."""
    args = parse_args(argv)
    from server.model_loader import default_model_dir, load_tokenizer

    tok = load_tokenizer(args.tokenizer or default_model_dir())
    ctx = TokenizerContext(tok, VOCAB, len(tok), (tok.eos_token_id,), "mask-fill-bench")
    cases = maskbench_cases(args.data, args.schemas) if args.data else BUILT_IN[: args.schemas]
    row_counts = [int(r) for r in args.rows.split(",")]
    print(f"{os.cpu_count()} cores; {len(cases)} schemas ({'MaskBench' if args.data else 'built-in'}); "
          f"{args.steps} steps; ms per step (mean); N = threads the batched fill used\n")
    print("| backend | rows | schemas | engine before | row by row | batch API, 1 thread | batch_fill, N threads | N "
          "| N threads vs row by row | N threads vs before |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    backends = args.backends.split(",")
    return [row for backend in backends for row in measure_backend(ctx, backend, cases, row_counts, args)]


if __name__ == "__main__":
    main()
