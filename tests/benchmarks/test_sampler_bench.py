"""``benchmarks/sampler_bench.py --smoke``: every sampler and bitmask column is timed at each batch
size (Triton's column is nan where Triton does not run)."""

from __future__ import annotations

import math

import torch

from benchmarks import sampler_bench


def test_smoke_run_times_every_column_at_each_batch():
    rows = sampler_bench.main(["--smoke", "--device", "cpu"])

    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        assert all(row[c] > 0 for c in sampler_bench.COLUMNS if c != "mask triton"), row
        assert math.isnan(row["mask triton"]) or torch.cuda.is_available()
