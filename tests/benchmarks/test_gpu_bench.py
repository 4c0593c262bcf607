"""``benchmarks/gpu.py --smoke``: the GPU benchmark's every part runs end to end on the CPU (tiny
shapes), so the one command meant for a CUDA machine is known to work before device time is spent."""

from __future__ import annotations

import json

from benchmarks import gpu


def test_smoke_run_measures_every_part_and_writes_json(tmp_path, default_dir):
    out = tmp_path / "gpu.json"
    result = gpu.main(["--smoke", "--tokenizer", str(default_dir), "--out", str(out)])

    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["bandwidth_bytes_per_s"] > 0
    report = result["shapes"]["tiny"]
    assert report["weight_bytes"] > 0 and report["floor_ms"] > 0
    rows = report["rows"]
    decode = [r for r in rows if r["what"] == "decode"]
    expected = [("free", "-"), ("json_schema", "off"), ("json_schema", "on")]
    assert [(r["workload"], r["jump"]) for r in decode] == expected
    assert all(r["tok_s"] > 0 and r["ms"] > 0 and r["x_floor"] > 0 for r in decode)
    assert decode[0]["vs_free"] == 1.0 and all(r["vs_free"] > 0 for r in decode)
    ttft = [r for r in rows if r["what"] == "ttft"]
    assert len(ttft) == 2 and all(r["ms"] > 0 for r in ttft)
    http = [r for r in rows if r["what"] == "http"]
    assert [r["workload"] for r in http] == ["free", "json_schema"]
    assert all(r["tok_s"] > 0 and r["vs_free"] > 0 for r in http)
    generate = [r for r in rows if r["what"] == "hf generate"]
    assert [r["rows"] for r in generate] == [2] and generate[0]["ms"] > 0
    assert "Trellis" in generate[0]["note"]  # the speed-up over transformers at the same batch


def test_profile_writes_one_table_per_decode_row(tmp_path, default_dir):
    gpu.main(["--smoke", "--tokenizer", str(default_dir), "--parts", "decode", "--profile", str(tmp_path)])
    files = sorted(path.name for path in tmp_path.glob("*.txt"))
    assert files == ["tiny-b2-decode-free.txt", "tiny-b2-decode-json_schema-jf.txt", "tiny-b2-decode-json_schema.txt"]
    text = (tmp_path / "tiny-b2-decode-json_schema.txt").read_text()
    assert text.startswith("===== tiny-b2-decode-json_schema: wall ") and "top ops by host (self CPU) time:" in text
    assert "Self CPU" in text  # torch.profiler's table
