"""``benchmarks/quantization.py --smoke`` on the default model: every row printed, the
unquantized row agrees with itself, and int4 still mostly agrees with it."""

from __future__ import annotations

from benchmarks import quantization


def test_smoke_run_prints_agreement_and_speed(default_dir, tmp_path):
    # int4 alone still measures against none, first (the reference was the first kind asked for)
    result = quantization.main(["--smoke", "--kinds", "int4", "--json", str(tmp_path / "q.json")])
    none, int4 = result["rows"]
    assert none["kind"] == "none" and int4["kind"] == "int4"
    assert none["identical"] == 1.0 and none["prefix"] == 1.0 and none["agreement"] == 1.0
    # what a decode step reads: the default model's float32 weights lie on their GGUF grids (Q4_1,
    # the embedding Q8_0), so none reads them as grids, as many bytes as int4's 4-bit weights
    assert 0.8 * int4["weights_mb"] < none["weights_mb"] < 1.2 * int4["weights_mb"]
    assert int4["agreement"] > 0.6  # a quantized model, not a broken one
    assert int4["decode_tok_s"] > 0 and int4["prefill_tok_s"] > 0
    assert (tmp_path / "q.json").exists()
