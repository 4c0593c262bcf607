"""torch.profiler over a few engine steps: where a step's time goes, host and device.

:func:`profile_steps` runs ``steps`` engine steps under the profiler and writes one text file:
wall ms per step, device-kernel ms per step (CUDA), the forward paths taken, then the top ops by
host (self CPU) time and, on CUDA, by device time. ``benchmarks/gpu.py --profile DIR`` calls it
for every measured decode row.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

TOP_OPS = 22


def profile_steps(engine, steps: int, device: torch.device, path: Path, label: str) -> tuple[float, float]:
    """Profile ``steps`` steps of ``engine`` (kept busy by the caller) into ``path``; returns
    (wall ms per step, device-kernel ms per step; 0 off CUDA)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    paths_before = dict(getattr(engine.runner, "path_counts", {}))
    _synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _synchronize(device)
        wall_ms = 1000 * (time.perf_counter() - started) / steps
    averages = prof.key_averages()
    kernel_ms = sum(_device_us(e) for e in averages if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1000 / steps
    paths = {k: v - paths_before.get(k, 0) for k, v in getattr(engine.runner, "path_counts", {}).items()}
    lines = [f"===== {label}: wall {wall_ms:.2f} ms/step (under the profiler), device kernels {kernel_ms:.2f} ms/step, "
             f"forward paths {paths}", "", "top ops by host (self CPU) time:",
             averages.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS, max_name_column_width=60)]
    if cuda:
        lines += ["", "top ops by device time:", _device_table(averages)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return wall_ms, kernel_ms


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0


def _device_table(averages) -> str:
    for key in ("self_device_time_total", "self_cuda_time_total"):  # the name differs across torch versions
        try:
            return averages.table(sort_by=key, row_limit=TOP_OPS, max_name_column_width=60)
        except Exception:
            continue
    return "(no device-time column in this torch version)"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
