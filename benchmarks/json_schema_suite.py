"""JSON-Schema-Test-Suite at compile level: each test group's schema compiled, each instance walked.

Every group of the suite's draft 2020-12 tests (the optional ones included: formats, bignums,
ECMA-262 regexes) is one schema: it is compiled with the default model's tokenizer, and each of
its instances is written out and walked token by token through the compiled constraint's mask,
then EOS, as :mod:`maskbench` does (its workers, timeouts and tables are reused). A group passes
when it compiles and every instance is classified as the suite says; otherwise it counts as
refused (compile error), valid rejected or invalid accepted.

An instance is written as ``json.dumps`` writes it (``", "`` and ``": "``, non-ASCII characters
as themselves, the layout Trellis generates), numbers exactly as the suite spells them (a
number beyond a double is not rounded). The schema reaches the compiler as a request body
would: parsed by Python's ``json`` (integers exact at any size, other numbers as doubles).

The suite is not vendored: check it out and point ``--suite`` at its ``tests/draft2020-12``::

    git clone https://github.com/json-schema-org/JSON-Schema-Test-Suite /tmp/jsts
    python benchmarks/json_schema_suite.py --suite /tmp/jsts/tests/draft2020-12 --backend all
    python benchmarks/json_schema_suite.py --suite ... --only optional/format --failures
    python benchmarks/json_schema_suite.py --smoke  # three inline groups, no checkout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import maskbench  # the benchmark machinery: workers, scoring, tables
from smoke import parse_with_smoke

ENGINES = ("trellis", "llguidance", "xgrammar")  # and "trellis-any" by name (json_numbers "any")


class _Number(str):
    """A JSON number's text as the suite spells it."""


def _as_parsed(value: Any) -> Any:
    """``value`` as Python's ``json`` parses it: each number text a double."""
    if isinstance(value, _Number):
        return float(value)
    if isinstance(value, dict):
        return {k: _as_parsed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_parsed(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """``value`` as ``json.dumps(value, ensure_ascii=False)`` writes it, number texts as spelled."""
    if isinstance(value, _Number):
        return str.__str__(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{dumps(k)}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def load_rows(suite: Path, only: list[str] | None = None) -> list[tuple[str, dict]]:
    """(file, row) per test group of every ``*.json`` under ``suite`` (its path without
    ``.json`` as the subset), in maskbench's row form: ``id``, ``schema`` and ``tests`` (each
    with ``data``, the exact ``text`` and ``valid``). ``only``: path prefixes to keep."""
    rows = []
    for path in sorted(suite.rglob("*.json")):
        subset = path.relative_to(suite).with_suffix("").as_posix()
        if only and not any(subset.startswith(prefix) for prefix in only):
            continue
        groups = json.loads(path.read_text(encoding="utf-8"), parse_float=_Number)
        for i, group in enumerate(groups):
            tests = [{"data": _as_parsed(t["data"]), "text": dumps(t["data"]), "valid": t["valid"]}
                     for t in group["tests"]]
            row = {"id": str(i), "description": group["description"],
                   "schema": _as_parsed(group["schema"]), "tests": tests}
            rows.append((subset, row))
    return rows


def section(subset: str) -> str:
    """The part of the suite a file belongs to: ``core``, ``optional`` or ``optional/format``."""
    if subset.startswith("optional/format/"):
        return "optional/format"
    return "optional" if subset.startswith("optional/") else "core"


def by_section(rows: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The rows with each file replaced by its :func:`section` (for a short per-part table)."""
    return [(section(subset), row) for subset, row in rows]


# three groups in the suite's form: a format, a reference to an $id under an "if", and a bound
# with an instance spelled beyond a double's precision (1.5 as a double)
SMOKE_SUITE = """[
 {"description": "date format", "schema": {"format": "date"}, "tests": [
   {"data": "2020-02-29", "valid": true}, {"data": "2021-02-29", "valid": false}, {"data": 3, "valid": true}]},
 {"description": "ref to an $id under if",
  "schema": {"$ref": "http://example.com/if", "if": {"$id": "http://example.com/if", "type": "integer"}},
  "tests": [{"data": 1, "valid": true}, {"data": "a", "valid": false}]},
 {"description": "bound", "schema": {"type": "number", "maximum": 1.5}, "tests": [
   {"data": 1.50000000000000000001, "valid": false}, {"data": 1.5, "valid": true}]}
]"""


def render(engines: list[str], rows: list[tuple[str, dict]], results: dict[str, list[dict]]) -> str:
    """maskbench's tables, in the suite's words (groups, and parts or files of the suite)."""
    text = maskbench.render(engines, rows, results, title="JSON-Schema-Test-Suite draft 2020-12")
    return text.replace(" schemas, ", " groups, ").replace("| subset | schemas |", "| part | groups |") \
        .replace("Per subset (", "Per part (")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", type=Path, default=None,
                    help="the suite's tests/draft2020-12 directory (or a checkout's root)")
    ap.add_argument("--backend", default="trellis", help="trellis|llguidance|xgrammar|all, or a comma-separated list")
    ap.add_argument("--only", default=None, help="only files under these paths (comma-separated: ref,optional/format)")
    ap.add_argument("--timeout", type=float, default=30.0, help="per-group limit in seconds")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--memory-mb", type=int, default=4096)
    ap.add_argument("--per-file", action="store_true", help="one table row per file instead of per section")
    ap.add_argument("--failures", action="store_true", help="one line per failing (engine, group)")
    ap.add_argument("--json", type=Path, default=None, help="also write raw per-group results")
    ap.add_argument("--quiet", action="store_true")
    args = parse_with_smoke(ap, argv, {"timeout": 60.0}, help="three groups of the suite's form written to a"
                            " temporary directory (no checkout needed), Trellis alone")
    if args.suite is None and not args.smoke:
        ap.error("--suite is required (a checkout's tests/draft2020-12)")
    if args.suite is None:
        with tempfile.TemporaryDirectory(prefix="jsts-smoke-") as folder:
            (Path(folder) / "smoke.json").write_text(SMOKE_SUITE)
            rows = load_rows(Path(folder))
    else:
        suite = args.suite / "tests" / "draft2020-12" if (args.suite / "tests").is_dir() else args.suite
        rows = load_rows(suite, args.only.split(",") if args.only else None)
    if not rows:
        ap.error(f"no test groups under {args.suite}")
    engines = list(ENGINES) if args.backend == "all" else args.backend.split(",")
    unknown = [e for e in engines if e not in maskbench.ENGINES]
    if unknown:
        ap.error(f"unknown backend(s): {', '.join(unknown)}")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), str(maskbench.ROOT), os.environ.get("PYTHONPATH", "")])
    results = {}
    for engine in engines:
        start = time.monotonic()
        results[engine] = maskbench.run_engine(engine, rows, args.timeout, args.jobs, not args.quiet, args.memory_mb)
        if not args.quiet:
            print(f"{engine}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(maskbench.results_json(rows, results)))
    print(render(engines, rows if args.per_file else by_section(rows), results))
    if args.failures:
        print("\n" + maskbench.render_failures(engines, rows, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
