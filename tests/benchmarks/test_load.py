"""``benchmarks/load.py --smoke``: a short soak against a real server on the tiny model completes
requests without errors, every finished structured output validates, and the server settles."""

from __future__ import annotations

from benchmarks import load


def _table(out: str) -> dict[str, str]:
    """The printed ``| metric | value |`` rows."""
    rows = [line.strip("|").split(" | ", 1) for line in out.splitlines() if line.startswith("| ")]
    return {name.strip(): value.strip() for name, value in rows}


def test_smoke_soak_completes_and_settles(tiny_server, capsys):
    status = load.main(["--smoke", "--base-url", tiny_server.base_url])

    table = _table(capsys.readouterr().out)
    assert status == 0, table
    assert int(table["requests started"]) > 0 and int(table["completed"]) > 0, table
    assert table["errors"] == "0", table
    structured = table["structured outputs validate"]  # "yes (V/F finished valid; ...)"
    valid, finished = map(int, structured.split("(")[1].split(" ")[0].split("/"))
    assert structured.startswith("yes") and finished > 0 and valid == finished, table
    assert table["running sequences back to 0"].startswith("yes"), table
    assert float(table["output tokens/s"]) > 0


def test_percentile_and_metrics_parsing():
    assert load.percentile([3.0, 1.0, 2.0], 50) == 2.0 and load.percentile([], 50) is None
    metrics = load._parse_metrics('# HELP x\nx{a="1"} 2\nx{a="2"} 3\ny 1.5\n')
    assert metrics == {"x": 5.0, "y": 1.5}
