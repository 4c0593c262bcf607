"""``benchmarks/scaleout.py --smoke``: one replica of the tiny model on a local Ray Serve answers
the shared-prefix, per-group-schema workload, and the constraint compiles are counted."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from benchmarks import scaleout
from tests.conftest import free_port


def test_smoke_run_serves_the_workload_on_one_replica(tiny_model_dir):
    rows = scaleout.main(["--smoke", "--model", str(tiny_model_dir), "--port", str(free_port())])

    (row,) = rows
    assert (row["replicas"], row["routing"], row["requests"]) == (1, "cache", 2)
    assert row["tokens"] > 0 and row["tok_s"] > 0 and row["vs_first"] == 1.0
    assert row["compiles"] >= 1  # the group's schema, compiled on the replica


def test_workload_shares_one_schema_and_prefix_per_group():
    requests = scaleout.workload(row=0, groups=2, per_group=3, seed=0)
    assert len(requests) == 6
    schemas = {r["response_format"]["json_schema"]["name"] for r in requests}
    prefixes = {r["messages"][0]["content"] for r in requests}
    assert schemas == {"item_0_0", "item_0_1"} and len(prefixes) == 2
