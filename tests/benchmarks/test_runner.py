"""``benchmarks/runner.py --smoke``: the hand-written runner and the transformers one both decode
over the current paged StepBatch API side by side on the tiny model."""

from __future__ import annotations

from benchmarks import runner


def test_smoke_run_decodes_on_both_runners(tiny_model_dir):
    rows = runner.main(["--smoke", "--model", str(tiny_model_dir), "--device", "cpu"])

    assert [(r["batch"], r["runner"]) for r in rows] == [(2, runner.HAND_WRITTEN), (2, runner.TRANSFORMERS)]
    assert all(r["tok_s"] > 0 and r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["vs_hand_written"] == 1.0 and rows[0]["attention_ms"] is None
    assert rows[1]["attention_ms"] > 0  # the transformers runner's write_kv + paged_attention, timed on the CPU
