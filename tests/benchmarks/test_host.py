"""``benchmarks/host.py --smoke``: the real engine runs over the null runner and its emulated
device clock, overlapped and synchronous, and every row's host, wall and per-token times are filled."""

from __future__ import annotations

from benchmarks import host


def test_smoke_run_measures_every_workload(default_dir, capsys):
    rows = host.main(["--smoke"])

    assert [(r.batch, r.workload, r.jump) for r in rows] == [
        (batch, name, jump) for batch in (1, 4) for name, jump in host.WORKLOADS]
    for r in rows:
        assert r.device_ms == 1.0 and 0 < r.host_ms <= r.wall_ms and r.ms_per_token > 0, r
        assert r.overlap_ratio > 0
    out = capsys.readouterr().out
    assert "engine of this tree (overlap on)" in out and "engine of this tree (overlap off)" in out
