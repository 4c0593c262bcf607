"""``benchmarks/prediction.py --smoke``: on the default model, a correct prediction is accepted
(fewer steps) and an edited one partly, and neither changes the greedy output."""

from __future__ import annotations

from benchmarks import prediction


def test_smoke_run_accepts_a_correct_prediction(default_dir):
    rows = prediction.main(["--smoke", "--device", "cpu"])

    by_name = {r["prediction"]: r for r in rows}
    assert list(by_name) == ["none", "correct", "edited"]
    assert by_name["correct"]["same"] and by_name["edited"]["same"]
    assert by_name["correct"]["accepted"] > 0 and by_name["correct"]["steps"] < by_name["none"]["steps"]
    assert by_name["edited"]["rejected"] > 0
    assert all(r["tok_s"] > 0 for r in rows)


def test_edited_prediction_changes_the_middle():
    text = "0123456789" * 6
    out = prediction.edited(text)
    assert out.startswith(text[:30]) and "EDITED SPAN HERE" in out and out.endswith(text[50:])
