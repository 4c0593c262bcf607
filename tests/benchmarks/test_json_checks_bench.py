"""``benchmarks/json_checks.py --smoke``: the built-in schemas get run-time checks, their valid
instances walk through the checked matchers, and both fills are timed."""

from __future__ import annotations

from benchmarks import json_checks


def test_smoke_run_times_checked_and_backend_fills(default_tokenizer):
    rows = json_checks.main(["--smoke"])
    assert [r["schema"] for r in rows] == ["tags", "languages", "settings"]
    for row in rows:
        assert row["steps"] > 10 and row["checks_us"][0] > 0 and row["backend_us"][0] > 0
