"""``benchmarks/serve.py --smoke``: the streaming load client runs every level against a real
server on the tiny model, free and json_schema, and with the speculation A/B."""

from __future__ import annotations

from benchmarks import serve


def test_smoke_run_measures_free_and_json_schema_levels(tiny_server):
    rows = serve.main(["--smoke", "--json-schema", "--base-url", tiny_server.base_url])

    assert [(r["concurrency"], r["workload"]) for r in rows] == [
        (1, "free"), (1, "json_schema"), (2, "free"), (2, "json_schema")]
    for r in rows:
        assert r["requests"] == 2 and r["req_s"] > 0 and r["tok_s"] > 0, r
        assert 0 < r["ttft_p50"] <= r["ttft_p95"] and r["tpot_ms"] > 0, r
    assert rows[0]["vs_c1"] == 1.0 and rows[0]["vs_free"] == 1.0


def test_speculation_ab_runs_off_then_auto(tiny_server):
    rows = serve.main(["--smoke", "--speculation-ab", "--base-url", tiny_server.base_url])

    assert [r["workload"] for r in rows] == ["free, speculation off", "free, speculation auto"] * 2
    assert all(r["tok_s"] > 0 for r in rows)
