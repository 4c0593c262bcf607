"""The fused forward of the Llama family (concatenated projections, fused norms, rotary + KV
write, SiLU·mul) for each supported architecture: greedy tokens equal transformers' own
``generate``, and the CUDA path's Triton kernels (run in the interpreter on the CPU) give the
torch path's logits."""

from __future__ import annotations

import pytest
import torch

import kernels
from server.engine.model import SUPPORTED_MODEL_TYPES, ModelRunner, runs_hand_written
from tests.server.engine.paged_util import extend, step

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _config(model_type: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": lambda: LlamaConfig(**COMMON),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24),  # per-head qk-norm, head_dim != hidden / heads
    }[model_type]()


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def model(request):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(request.param)).eval()
    with torch.no_grad():  # transformers initialises biases to zero: random ones exercise them
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    assert runs_hand_written(hf.config)
    return hf


def _greedy(runner: ModelRunner, prompt: list[int], new_tokens: int) -> list[int]:
    tokens = list(prompt)
    logits = extend(runner, 0, tokens, 0)
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        logits = extend(runner, 0, tokens[-1:], len(tokens) - 1)
    return tokens[len(prompt):]


def test_greedy_tokens_equal_transformers_generate(model) -> None:
    prompt = [5, 17, 300, 42, 7, 9, 11]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    runner = ModelRunner.for_sequences(model, 1, 64, block_size=4)
    assert _greedy(runner, prompt, 12) == expected


def test_projections_share_the_fused_weights(model) -> None:
    runner = ModelRunner.for_sequences(model, 1, 16, block_size=4)
    layer, weights = model.model.layers[0], runner.layers[0]
    q = layer.self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == weights.qkv_weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == weights.gate_up_weight.untyped_storage().data_ptr()
    assert weights.qkv_weight.shape[0] == weights.q_size + 2 * weights.kv_size


def _interpreter_runs() -> bool:
    return kernels.interpreter_enabled() and kernels.triton_kernels() is not None


@pytest.mark.skipif(not _interpreter_runs(), reason="the Triton interpreter is not enabled in this process")
def test_interpreted_cuda_path_gives_the_torch_logits(model) -> None:
    """Decode rows, a prefill and a multi-token continuation in one step, both paths."""
    runners = [ModelRunner.for_sequences(model, 3, 64, block_size=4, use_triton=flag) for flag in (False, True)]
    results = []
    for runner in runners:
        extend(runner, 0, [5, 6, 7, 8, 9], 0)
        extend(runner, 2, [20, 21], 0)
        rows = [(0, [10], 5), (1, [12, 13, 14, 15], 0), (2, [22, 23, 24], 2)]
        results.append((step(runner, rows), runner.kv.k.clone(), runner.last_hidden))
    (logits, cache, hidden), (logits_t, cache_t, hidden_t) = results
    torch.testing.assert_close(logits_t, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache_t, cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden_t, hidden, atol=1e-5, rtol=1e-5)
