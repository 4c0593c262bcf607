"""``benchmarks/kernels_per_step.py --baseline none``: the kernel count of one decode step runs
end to end on the CPU (the CUDA path through Triton's interpreter) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_per_step.py"


def test_counts_kernels_per_layer_of_this_tree(tmp_path):
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--baseline", "none", "--json", str(out)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| batch | kernels | this tree |" in done.stdout and "total kernels per layer" in done.stdout

    result = json.loads(out.read_text())
    assert result["baseline"] is None and result["baseline_error"] is None
    tree = result["this_tree"]
    assert sorted(tree["batches"]) == ["1", "8"]
    for batch in tree["batches"].values():
        per_layer = batch["per_layer"]
        assert per_layer["total"] > 0 and per_layer["total"] == per_layer["aten"] + per_layer["triton"]
        assert sum(per_layer["aten_ops"].values()) == per_layer["aten"]
        if tree["triton"] == "interpreted":  # the CUDA path was taken: paged attention is a Triton launch
            assert per_layer["triton"] >= 1, per_layer
