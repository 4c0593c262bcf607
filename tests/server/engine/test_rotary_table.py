"""The rotary table gives transformers' per-step cos/sin for every rope scaling."""

from __future__ import annotations

import pytest
import torch

from server.engine.rotary_table import RotaryTable

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_table_rows_equal_the_modules_own_values(scaling) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                         rope_scaling=SCALINGS[scaling])
    rotary = LlamaRotaryEmbedding(config)
    table = RotaryTable(rotary, 300, torch.float32, torch.device("cpu"))
    assert (table.table is None) == (scaling == "dynamic")  # rescales with the length: computed per step
    positions = torch.tensor([0, 7, 63, 64, 200, 299])
    cos, sin = table.lookup(positions)
    expected_cos, expected_sin = rotary(torch.zeros(1, dtype=torch.float32), positions.view(1, -1))
    assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
