"""The FP8 format the FP8 kernels share: e4m3, its largest value and the smallest scale used."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # a row of zeros still gets a usable (positive) scale
