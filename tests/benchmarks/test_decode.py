"""``benchmarks/decode.py --smoke``: the decode loop benchmark drives the current engine API end to
end on the tiny model (free, and json_schema with jump-forward off and on) and reports every column."""

from __future__ import annotations

from benchmarks import decode


def test_smoke_run_measures_free_and_structured_rows(tiny_model_dir, capsys):
    rows = decode.main(["--smoke", "--model", str(tiny_model_dir), "--device", "cpu"])

    assert [(r["batch"], r["workload"], r["jump"]) for r in rows] == [
        (2, "free", False), (2, "json_schema", False), (2, "json_schema", True)]
    assert all(r["tok_s"] > 0 and r["step_ms"] > 0 and r["forward_ms"] > 0 and r["steps"] >= 3 for r in rows)
    assert rows[0]["vs_free"] == 1.0 and all(r["vs_free"] > 0 for r in rows)
    assert all(r["fill_us"] > 0 for r in rows[1:])  # the structured rows fill masks, the free one does not
    assert rows[0]["fill_us"] == 0
    table = capsys.readouterr().out
    assert "| batch | workload | jump-forward |" in table and table.count("| 2 | json_schema |") == 2
