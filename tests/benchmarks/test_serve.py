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


def test_a_peer_runs_the_same_workload_in_turn(tiny_server):
    """The peer here is the same server under another URL form: its rows follow each of ours."""
    peer = tiny_server.base_url.replace("127.0.0.1", "localhost")
    rows = serve.main(["--smoke", "--json-schema", "--concurrency", "1", "--base-url", tiny_server.base_url,
                       "--peer", peer])

    assert [r["workload"] for r in rows] == ["free", "free @ peer", "json_schema", "json_schema @ peer"]
    assert rows[0]["ours_vs_peer"] is None and rows[1]["ours_vs_peer"] == rows[0]["tok_s"] / rows[1]["tok_s"]
    assert rows[0]["valid"] is None and 0 <= rows[2]["valid"] <= 1 and rows[3]["valid"] is not None


def test_steady_pace_counts_the_tokens_streamed_while_every_client_was_busy():
    """Tokens are spread over each answer's first-to-last span and cut at the moment the last
    request was sent; the ragged tail after it does not count."""
    samples = [serve.Sample(ttft=0, total=0, tokens=100, first_at=0.0, end_at=10.0),
               serve.Sample(ttft=0, total=0, tokens=50, first_at=2.0, end_at=7.0),
               serve.Sample(ttft=0, total=0, tokens=1, first_at=3.0, end_at=3.0),
               serve.Sample(ttft=0, total=0, tokens=0, failed=True)]
    # window [0, 5]: half the first answer (50), 3/5 of the second (30) and the one-token answer
    assert serve._steady_tok_s(samples, 0.0, 5.0) == (50 + 30 + 1) / 5
    assert serve._steady_tok_s(samples, 0.0, 0.0) != serve._steady_tok_s(samples, 0.0, 0.0)  # nan: no window
