"""``benchmarks/attention.py --smoke``: every paged-attention implementation is checked against the
row-by-row oracle and timed, for both attention shapes and both steps."""

from __future__ import annotations

from benchmarks import attention


def test_smoke_run_checks_and_times_every_implementation():
    rows = attention.main(["--smoke", "--device", "cpu"])

    steps = {(r["shape"], r["step"]) for r in rows}
    assert steps == {(shape, step) for shape in attention.SHAPES
                     for step in ("16 decode × 48", "prefill 48 + 15 decode")}
    for shape, step in steps:
        impls = {r["implementation"]: r for r in rows if (r["shape"], r["step"]) == (shape, step)}
        assert {"oracle (rows)", "torch batched", "unpaged SDPA"} <= set(impls)
        assert impls["oracle (rows)"]["vs_oracle"] == 1.0
    assert all(r["us"] > 0 and r["vs_oracle"] > 0 for r in rows)
