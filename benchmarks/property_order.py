"""What accepting any property order costs: llguidance compile and mask time per schema, the
declared-order schema and its any-order rewrite (constraints/schema/property_order.py) side by side.

For each MaskBench schema of the slice whose rewrite changes it: build both grammars
(``grammar_from_json_schema``, matcher, first mask) alternately, ``--repeat`` times each, and
walk every valid instance both ways timing each mask. Prints medians / p99 and the ratios.

    python benchmarks/property_order.py --subset Glaiveai2K --limit 300
    python benchmarks/property_order.py --smoke        # 30 Glaiveai2K schemas, built once each way
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from benchmarks.smoke import parse_with_smoke  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"subset": "Glaiveai2K", "limit": 30, "repeat": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes 30 Glaiveai2K schemas, each form built once."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "maskbench")
    ap.add_argument("--subset", default=None, help="comma-separated subsets (default: all)")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="folder with the tokenizer files (default: the default model's)")
    args = parse_with_smoke(ap, argv, SMOKE, "30 Glaiveai2K schemas, built once: checks it runs")
    return args


def print_table(result: dict) -> None:
    """The markdown table of :func:`main`'s result."""
    compile_s, mask_s, passed, walked = result["compile_s"], result["mask_s"], result["accepted"], result["walked"]
    print(f"{result['changed']} of {result['schemas']} schemas rewritten; {walked} valid instances walked")
    print("| form | compile p50 ms | compile p99 ms | mask p50 µs | mask p99 µs | valid instances accepted |")
    print("|---|---|---|---|---|---|")
    for name in ("declared", "any"):
        print(f"| {name} order | {_pct(compile_s[name], .5) * 1e3:.2f} | {_pct(compile_s[name], .99) * 1e3:.1f} | "
              f"{_pct(mask_s[name], .5) * 1e6:.1f} | {_pct(mask_s[name], .99) * 1e6:.0f} | {passed[name]} / {walked} |")
    if compile_s["declared"]:
        print(f"ratio any/declared: compile p50 {statistics.median(compile_s['any']) / statistics.median(compile_s['declared']):.2f}x, "
              f"mask p50 {statistics.median(mask_s['any']) / statistics.median(mask_s['declared']):.2f}x")


def main(argv: list[str] | None = None) -> dict:
    """Measure both forms of every rewritten schema; returns the samples (seconds) and counts as printed."""
    args = parse_args(argv)

    import llguidance
    import llguidance.hf
    import torch
    from maskbench import load_rows

    from constraints.backends.llguidance import json_options, parser_limits
    from constraints.errors import ConstraintError
    from constraints.schema.analysis import normalise_schema, rewrite_schema
    from constraints.schema.property_order import any_order
    from constraints.spec import ConstraintSpec
    from server.model_loader import default_model_dir, load_tokenizer

    tok = load_tokenizer(args.tokenizer or default_model_dir())
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=49152)
    opts = json_options(ConstraintSpec("json_schema", {}))
    mask = torch.zeros((49152 + 31) // 32, dtype=torch.int32)

    def build(schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(matcher, ids: list[int], times: list[float]) -> bool:
        for t in ids:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            times.append(time.perf_counter() - start)
            if matcher.try_consume_tokens([t]) != 1:
                return False
        return True

    subsets = set(args.subset.split(",")) if args.subset else None
    rows = load_rows(args.data, args.limit, subsets)
    compile_s = {"declared": [], "any": []}
    mask_s = {"declared": [], "any": []}
    passed = {"declared": 0, "any": 0}
    walked = changed = 0
    for _, row in rows:
        try:
            declared = rewrite_schema(normalise_schema(row["schema"]))
        except ConstraintError:
            continue
        anyway = any_order(declared)
        if anyway == declared:
            continue
        try:
            build(declared), build(anyway)
        except Exception:
            continue
        changed += 1
        for _ in range(args.repeat):  # alternate, so load drifts hit both alike
            for name, schema in (("declared", declared), ("any", anyway)):
                start = time.perf_counter()
                build(schema)
                compile_s[name].append(time.perf_counter() - start)
        for test in row.get("tests", []):
            if not test["valid"]:
                continue
            walked += 1
            ids = tok.encode(json.dumps(test["data"]), add_special_tokens=False)
            for name, schema in (("declared", declared), ("any", anyway)):
                passed[name] += walk(build(schema), ids, mask_s[name])
    result = {"schemas": len(rows), "changed": changed, "walked": walked, "accepted": passed,
              "compile_s": compile_s, "mask_s": mask_s}
    print_table(result)
    return result


if __name__ == "__main__":
    main()
