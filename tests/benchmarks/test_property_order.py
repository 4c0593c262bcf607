"""``benchmarks/property_order.py --smoke``: MaskBench schemas are rewritten to accept any property
order, both forms compile and are timed, and the any-order form accepts every valid instance."""

from __future__ import annotations

import pytest

from benchmarks import property_order

DATA = property_order.ROOT.parent / "shared" / "data" / "maskbench"


@pytest.mark.skipif(not DATA.is_dir(), reason=f"MaskBench data not found at {DATA}")
def test_smoke_run_compares_declared_and_any_order(tiny_model_dir):
    result = property_order.main(["--smoke", "--data", str(DATA), "--tokenizer", str(tiny_model_dir)])

    assert result["schemas"] == 30 and 0 < result["changed"] <= 30
    assert result["walked"] > 0 and result["accepted"]["any"] == result["walked"]
    for form in ("declared", "any"):
        assert len(result["compile_s"][form]) == result["changed"]  # --repeat 1
        assert result["mask_s"][form] and all(s > 0 for s in result["compile_s"][form])
