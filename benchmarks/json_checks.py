"""What the run-time checks (``constraints/backends/json_checks.py``) add to a mask fill.

For each schema (built-in ones whose ``uniqueItems`` / ``minProperties`` / ``maxProperties`` are
checked at run time, or MaskBench's with ``--data``, those that get checks), the compiled
matcher walks each valid instance token by token; at every step the mask is filled twice, by
the matcher with its checks and by the backend's matcher under it (same state), alternating
which goes first, and the time of each is kept. Prints µs per fill (p50 / p99) for both and
their ratio, per schema and over all.

    python benchmarks/json_checks.py [--data ../shared/data/maskbench --schemas 40]
    python benchmarks/json_checks.py --smoke        # the built-in schemas, one instance each
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.smoke import parse_with_smoke  # noqa: E402
from constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from constraints.backends.json_checks import JsonChecks  # noqa: E402
from constraints.schema.runtime_checks import split_runtime_checks  # noqa: E402

TAGS = {"type": "object", "required": ["title", "tags"], "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string", "minLength": 1}}}}
LANGUAGES = {"type": "array", "uniqueItems": True, "items": {"enum": [
    "English", "French", "German", "Spanish", "Italian", "Dutch", "Polish", "Czech", "Greek", "Turkish"]}}
SETTINGS = {"type": "object", "minProperties": 2, "maxProperties": 4, "properties": {"name": {"type": "string"}}}
BUILT_IN = [
    ("tags", TAGS, [{"title": "Quarterly report", "tags": ["finance", "q3", "finance-q3", "report", "internal"]}]),
    ("languages", LANGUAGES, [["English", "Dutch", "Greek", "Turkish", "French", "Czech"]]),
    ("settings", SETTINGS, [{"name": "proxy", "host": "10.0.0.1", "port": 8080, "retries": {"count": 3}}]),
]


def _checked(matcher) -> JsonChecks | None:
    while matcher is not None and not isinstance(matcher, JsonChecks):
        matcher = getattr(matcher, "inner", None)
    return matcher


def time_walk(compiled, tok, instance, vocab: int) -> tuple[list[float], list[float]]:
    """µs per fill with the checks and without (the backend's matcher alone), step by step."""
    matcher = compiled.new_matcher()
    checked = _checked(matcher)
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    with_checks, backend = [], []
    for step, token in enumerate(tok.encode(json.dumps(instance), add_special_tokens=False)):
        order = [(checked, with_checks), (checked.inner, backend)]
        for which, times in order if step % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            which.fill_bitmask(mask, 0)
            times.append((time.perf_counter() - start) * 1e6)
        if not checked.accept_token(token):
            raise AssertionError(f"the valid instance was refused at step {step}: {instance}")
    return with_checks, backend


def _maskbench(directory: Path, limit: int) -> list[tuple[str, dict, list]]:
    out = []
    for path in sorted(directory.glob("*.jsonl.gz")):
        for line in gzip.open(path):
            entry = json.loads(line)
            schema = json.loads(entry["schema"]) if isinstance(entry["schema"], str) else entry["schema"]
            if not split_runtime_checks(schema)[1]:
                continue
            valid = [t["data"] for t in entry.get("tests", []) if t.get("valid", True)]
            if valid:
                out.append((f"{path.name.split('.')[0]}:{entry['id']}", schema, valid[:2]))
            if len(out) >= limit:
                return out
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="MaskBench directory (default: built-in schemas)")
    ap.add_argument("--schemas", type=int, default=40)
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the default model's)")
    args = parse_with_smoke(ap, argv, {"schemas": 3}, "the built-in schemas, one instance each")
    from server.model_loader import default_model_dir, load_tokenizer

    tok = load_tokenizer(args.tokenizer or default_model_dir())
    vocab = 49152
    cases = _maskbench(args.data, args.schemas) if args.data else BUILT_IN[: args.schemas]
    compiler = ConstraintCompiler(tok, vocab, compile_timeout_s=20.0)
    rows, all_checked, all_backend = [], [], []
    try:
        compiler.wait_ready(120)
        print("| schema | steps | µs with checks p50 / p99 | µs backend alone p50 / p99 | ratio of p50 |")
        print("|---|---|---|---|---|")
        for name, schema, instances in cases:
            try:
                compiled = compiler.compile(ConstraintSpec("json_schema", schema))
            except Exception as exc:  # a schema that compiles nowhere is not this benchmark's business
                print(f"| {name} | refused: {type(exc).__name__} | | | |")
                continue
            if _checked(compiled.new_matcher()) is None:
                continue
            checked, backend = [], []
            try:  # untimed: a process's first checked fill pays one-time set-up (about 20 ms here)
                time_walk(compiled, tok, instances[0], vocab)
            except AssertionError:
                pass
            for instance in instances:
                try:
                    a, b = time_walk(compiled, tok, instance, vocab)
                except AssertionError:
                    continue  # an instance the backend spells otherwise (property order, ...)
                checked += a
                backend += b
            if not checked:
                continue
            row = {"schema": name, "steps": len(checked), "checks_us": (statistics.median(checked), _pct(checked, 0.99)),
                   "backend_us": (statistics.median(backend), _pct(backend, 0.99))}
            rows.append(row)
            all_checked += checked
            all_backend += backend
            print(f"| {name} | {row['steps']} | {row['checks_us'][0]:.1f} / {row['checks_us'][1]:.0f} | "
                  f"{row['backend_us'][0]:.1f} / {row['backend_us'][1]:.0f} | "
                  f"{row['checks_us'][0] / max(row['backend_us'][0], 1e-9):.2f}x |")
        if all_checked:
            print(f"| **all** ({len(rows)} schemas) | {len(all_checked)} | "
                  f"{statistics.median(all_checked):.1f} / {_pct(all_checked, 0.99):.0f} | "
                  f"{statistics.median(all_backend):.1f} / {_pct(all_backend, 0.99):.0f} | "
                  f"{statistics.median(all_checked) / max(statistics.median(all_backend), 1e-9):.2f}x |")
    finally:
        compiler.close()
    return rows


if __name__ == "__main__":
    main()
