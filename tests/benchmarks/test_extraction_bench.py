"""``benchmarks/extraction.py`` end to end on one short document: speculation off and auto give
the same greedy answer, valid JSON of the schema, and the row carries every number the table prints."""

from __future__ import annotations

from benchmarks import extraction


def test_one_document_same_answer_with_and_without_drafts(default_dir, tmp_path):
    result = extraction.main(["--clients", "1", "--docs", "1", "--workloads", "extraction", "--max-tokens", "120",
                              "--json", str(tmp_path / "x.json")])
    (row,) = result["rows"]
    assert row["identical"] and row["valid"]
    assert row["tok_s_off"] > 0 and row["tok_s_auto"] > 0 and row["tpot_ms_off"] > 0
    assert row["steps_auto"] <= row["steps_off"]
    assert row["prefill_s"] > 0 and row["ceiling"] > 0 and 0 < row["prefill_share_off"]
    assert (tmp_path / "x.json").exists()


def test_documents_hold_the_values_their_schemas_ask_for():
    for workload in ("extraction", "tool_call"):
        docs = extraction.documents(workload, 6, seed=3)
        assert len({doc.kind for doc in docs}) == (3 if workload == "extraction" else 1)
        for doc in docs:
            assert doc.schema["required"] and 300 < len(doc.text) // 4 < 2000  # ~chars per token
