"""``benchmarks/cpu_linear.py --smoke``: every shape and row count is checked against F.linear,
timed for both kernels, and the packed kernel keeps each row's bits."""

from __future__ import annotations

import pytest

from benchmarks import cpu_linear
from kernels.cpu_fused import cpu_fused_ops

_OPS = cpu_fused_ops()


@pytest.mark.skipif(_OPS is None or not _OPS.panel_kernel_vectorised(), reason="no AVX-512 fused CPU ops here")
def test_smoke_run_prints_every_shape_and_row_count(capsys):
    assert cpu_linear.main(["--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = lines[2:]
    assert len(rows) == len(cpu_linear.SMOKE_SHAPES) * 3
    assert all(line.endswith("/ yes") for line in rows), rows
    assert {line.split()[0] for line in rows} == set(cpu_linear.SMOKE_SHAPES)
