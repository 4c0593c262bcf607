"""``benchmarks/vision.py --smoke``: every stage of an image prompt is timed, and a re-sent image
is served (at least partly) from the prefix cache."""

from __future__ import annotations

from benchmarks import vision


def test_smoke_run_times_every_stage(default_tokenizer):
    rows = vision.main(["--smoke"])
    assert [row["size"] for row in rows] == ["56x56", "112x112"]
    for row in rows:
        assert row["image tokens"] > 0 and row["tokens"] > row["image tokens"]
        assert all(row[key] > 0 for key in ("decode", "process", "encode", "prefill", "text prefill", "cached"))
    assert rows[1]["image tokens"] == 4 * rows[0]["image tokens"]  # twice the side, four times the patches
