"""``benchmarks/lora_bench.py --smoke``: random peft adapters load into the runner's bank and a
decode step runs on the base model, one adapter, and a mix of adapters and base."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from benchmarks import lora_bench


def test_smoke_run_times_every_adapter_mix(tiny_model_dir):
    results = lora_bench.main(["--smoke", "--model", str(tiny_model_dir)])

    assert list(results) == ["base only", "one adapter", "2 adapters + base"]
    assert all(ms > 0 for ms in results.values())
