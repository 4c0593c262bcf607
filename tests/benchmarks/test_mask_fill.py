"""``benchmarks/mask_fill.py --smoke``: on both backends, the four ways of filling masks give
identical masks (checked every step inside the benchmark) and each is timed."""

from __future__ import annotations

from benchmarks import mask_fill


def test_smoke_run_fills_identical_masks_on_both_backends(tiny_model_dir):
    rows = mask_fill.main(["--smoke", "--tokenizer", str(tiny_model_dir)])

    assert [(r["backend"], r["rows"]) for r in rows] == [
        ("xgrammar", 1), ("xgrammar", 4), ("llguidance", 1), ("llguidance", 4)]
    for row in rows:
        assert row["schemas"] == 2 and row["threads"] >= 1
        assert set(row["ms"]) == {"before", "row by row", "batch API 1t", "batched"}
        assert all(ms > 0 for ms in row["ms"].values()), row
