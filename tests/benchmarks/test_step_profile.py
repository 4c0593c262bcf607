"""``benchmarks/step_profile.py`` (a helper of ``gpu.py --profile``, no command line of its own):
profiling a few steps of a busy engine on the tiny model writes the profiler's table."""

from __future__ import annotations

import torch

from benchmarks import decode, step_profile
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.model_loader import load_tokenizer


def test_profile_steps_writes_host_table(tiny_model_dir, tmp_path):
    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(tiny_model_dir)
    hf = load_hf_model(tiny_model_dir, torch.float32, cpu)
    engine = Engine(ModelRunner.for_sequences(hf, 2, 256), tokenizer, max_batch_size=2, max_model_len=256)
    workload = decode.Workload(engine, tokenizer("Hello there").input_ids, None, max_tokens=64, seed=0)
    for _ in range(2):
        workload.submit()
    engine.step()  # the prefill

    wall_ms, kernel_ms = step_profile.profile_steps(engine, 3, cpu, tmp_path / "out" / "p.txt", "tiny-b2")

    assert wall_ms > 0 and kernel_ms == 0  # no device kernels off CUDA
    text = (tmp_path / "out" / "p.txt").read_text()
    assert text.startswith("===== tiny-b2: wall ") and "top ops by host (self CPU) time:" in text
    assert "Self CPU" in text and "top ops by device time:" not in text
    workload.stopped = True
