"""The runner's quantized linear layers (``--quantization int4|int8``): the quantized model is
the dequantized one, prompt and output tokens take their routes, the float32 weights are gone,
and drafts still never change an output."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.quantized_linear import supports
from server.engine.model import ModelRunner, load_hf_model
from server.engine.quantized_weights import TokenRoutes, dense_prompt_counts
from server.engine.step_batch import StepBatch
from server.model_loader import ModelLoadError
from server.state import resolve_quantization


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def _logits(runner: ModelRunner, prompt: list[int], decode: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the prompt's last token (a prefill), then of each decode token fed one by one."""
    block = runner.block_size
    table = list(range(1, 1 + -(-(len(prompt) + len(decode)) // block)))
    first = runner.forward(StepBatch.build([(table, prompt, 0)], block, runner.device, prompt_counts=[len(prompt)]))
    steps = [runner.forward(StepBatch.build([(table, [token], len(prompt) + i)], block, runner.device,
                                            prompt_counts=[0]))
             for i, token in enumerate(decode)]
    return first, torch.cat(steps)


@pytest.mark.parametrize("kind", ["int4", "int8"] + (["bf16"] if supports("bf16", torch.empty(1, 1)) else []))
def test_a_quantized_runner_computes_the_dequantized_model(tiny_hf, kind) -> None:
    quantized = ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 1, 64, quantization=kind)
    # the same model in float32: every linear layer's weight replaced by what the kernel multiplies by
    reference_hf = copy.deepcopy(tiny_hf)
    reference = ModelRunner.for_sequences(reference_hf, 1, 64)
    for layer, ours in zip(reference.layers, quantized.layers, strict=True):
        for name in ("qkv_weight", "gate_up_weight"):
            getattr(layer, name).copy_(getattr(ours, name).float())
        for module in ("o_proj", "down_proj"):
            getattr(layer, module).weight.data.copy_(getattr(ours, module).weight.float())
    prompt, decode = list(range(10, 30)), [5, 6, 7]
    (got_prefill, got_decode), (want_prefill, want_decode) = _logits(quantized, prompt, decode), \
        _logits(reference, prompt, decode)
    # the lm_head is tied to the embedding here: the reference keeps it unquantized, so compare
    # what precedes it exactly enough and the logits loosely
    assert torch.allclose(got_prefill, want_prefill, atol=0.1, rtol=0.05)
    assert torch.allclose(got_decode, want_decode, atol=0.1, rtol=0.05)
    assert (got_decode.argmax(-1) == want_decode.argmax(-1)).float().mean() >= 2 / 3


def test_the_loaded_weights_are_replaced_by_the_dequantized_ones(tiny_hf) -> None:
    hf = copy.deepcopy(tiny_hf)
    runner = ModelRunner.for_sequences(hf, 1, 64, quantization="int4")
    layer, weights = hf.model.layers[0], runner.layers[0]
    quantized, dense = runner.quantized.layer(weights.qkv_weight)
    assert torch.equal(dense, quantized.dequantized()) and dense.dtype == torch.float32
    q_rows = layer.self_attn.q_proj.out_features
    assert torch.equal(layer.self_attn.q_proj.weight, dense[:q_rows])
    assert layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()
    o_quantized, o_dense = runner.quantized.layer(layer.self_attn.o_proj.weight)  # the module holds the copy
    assert o_dense.data_ptr() == layer.self_attn.o_proj.weight.data_ptr() and o_quantized.kind == "int4"
    padded, columns = -(-dense.shape[0] // 48) * 48, dense.shape[1]  # the panels' rows: 48 each
    assert quantized.nbytes == padded * columns // 2 + padded * columns // 32 * 4  # 4 bits; bf16 scale, zero per 32
    head, table = runner.quantized.layer(hf.lm_head.weight)
    assert head.kind == "int8" and table is hf.model.embed_tokens.weight  # tied: the table is not copied


def test_prompt_and_output_tokens_take_their_own_routes(tiny_hf) -> None:
    """A prefill's tokens go through the dense bf16 copy, decode tokens through the kernel: the
    route is the token's kind, so a token fed alone or among others gets the same logits."""
    runner = ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 2, 64, quantization="int4")
    block = runner.block_size
    prompt = list(range(40, 52))
    alone = runner.forward(StepBatch.build([([1], prompt, 0)], block, runner.device, prompt_counts=[12]))
    # the same prompt (other blocks) prefilled next to a decode row of the first sequence
    mixed = runner.forward(StepBatch.build([([1], [9], 12), ([2], prompt, 0)], block, runner.device,
                                           prompt_counts=[0, 12]))
    assert torch.equal(mixed[1], alone[0])


@pytest.mark.skipif(not supports("bf16", torch.empty(1, 1)), reason="no oneDNN bf16 here")
def test_prompt_rows_multiply_by_a_packed_bf16_copy(tiny_hf) -> None:
    """int4/int8 prompt rows go through the dequantized weight packed as bf16 (oneDNN, AMX),
    output rows through the 4-bit kernel; the output layer keeps no copy (its prompt rows are
    prompt logprobs only, through the dense weight)."""
    runner = ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 1, 64, quantization="int4")
    linears = runner.quantized._by_weight
    qkv = linears[id(runner.layers[0].qkv_weight)]
    assert qkv.prompt is not None and qkv.prompt.kind == "bf16"
    assert torch.equal(qkv.prompt.dequantized(), qkv.dense.to(torch.bfloat16).float())
    head = next(entry for entry in linears.values() if entry.quantized.kind == "int8")
    assert head.prompt is None
    x = torch.randn(5, qkv.dense.shape[1])
    all_prompt = TokenRoutes.of(torch.ones(5, dtype=torch.bool))
    prompt_rows = runner.quantized.linear(x, runner.layers[0].qkv_weight, None, all_prompt)
    want = (x.to(torch.bfloat16).float() @ qkv.dense.to(torch.bfloat16).float().t())
    torch.testing.assert_close(prompt_rows, want, rtol=2e-2, atol=2e-2)
    assert runner.quantized.prompt_bytes == sum(e.prompt.nbytes for e in linears.values() if e.prompt is not None)


def test_unknown_and_misplaced_quantizations_are_refused(tiny_hf) -> None:
    with pytest.raises(ValueError, match="unknown quantization"):
        ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 1, 64, quantization="int3")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("int4", cpu, True) == "int4"
    assert resolve_quantization("none", cpu, False) == resolve_quantization("none", cuda, True) == "none"
    with pytest.raises(ModelLoadError, match="unknown"):
        resolve_quantization("auto", cpu, True)
    with pytest.raises(ModelLoadError, match="runs on the CPU"):
        resolve_quantization("int8", cuda, True)
    if supports("bf16", torch.empty(1, 1)):
        assert resolve_quantization("bf16", cpu, True) == "bf16"
    with pytest.raises(ModelLoadError, match="hand-written"):
        resolve_quantization("int4", cpu, False)


@pytest.mark.skipif(not supports("bf16", torch.empty(1, 1)), reason="no oneDNN bf16 here")
def test_bf16_gives_the_same_tokens_however_its_prompt_is_chunked(tiny_hf, default_tokenizer) -> None:
    """One route through the packed kernel, prompts cut at blocks and attended a block at a time:
    a prompt prefilled whole or a few tokens a step gives bitwise the same logits."""
    from sampler import SamplingParams
    from server.engine.engine import Engine
    from server.engine.sequence import GenerationRequest

    prompt = list(range(100, 131))  # 31 tokens: cut at 4-token blocks when the budget is 6
    outputs = []
    for budget in (1024, 6):
        runner = ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 2, 64, block_size=4, quantization="bf16")
        engine = Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=64, prefill_budget=budget)
        deltas = []
        engine.submit(GenerationRequest(request_id="r", sink=deltas.append, prompt_token_ids=prompt, max_tokens=8,
                                        params=SamplingParams(temperature=0.0, logprobs=True), ignore_eos=True))
        while not (deltas and deltas[-1].finish_reason):
            engine.step()
        outputs.append([(t, lp.logprob) for d in deltas for t, lp in zip(d.token_ids, d.logprobs or [])])
        engine.shutdown()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8



def test_a_prompts_last_block_is_taken_as_output_tokens() -> None:
    """Prompt tokens before the block holding the prompt's last token keep the dense route;
    that block's tokens (1 to block_size of them) are counted out of the prompt."""
    # rows: a whole 10-token prompt, its second chunk (from 4), a cached prefix's last block
    # (from 8), a decode row, a 3-token prompt (all of it in its last block), an 8-token one
    starts, counts, lengths = [0, 4, 8, 10, 0, 0], [10, 6, 2, 0, 3, 8], [10, 10, 10, 10, 3, 8]
    assert dense_prompt_counts(starts, counts, lengths, 4) == [8, 4, 0, 0, 0, 4]


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_quantized_prompt_gives_the_same_tokens_however_it_is_cached_or_chunked(
        tiny_hf, default_tokenizer, monkeypatch, kind) -> None:
    """Whole, in chunks of a few blocks, or with all but its last block from the prefix cache:
    the same prompt gives bitwise the same tokens and logprobs, and the cached prompt's step
    (its last block only) never reads the dense bf16 copies."""
    from sampler import SamplingParams
    from server.engine.engine import Engine
    from server.engine.quantized_weights import QuantizedLinears
    from server.engine.sequence import GenerationRequest

    dense_calls = []
    original = QuantizedLinears._prompt_rows
    monkeypatch.setattr(QuantizedLinears, "_prompt_rows",
                        lambda self, x, layer: dense_calls.append(x.shape[0]) or original(self, x, layer))
    prompt = list(range(100, 131))  # 31 tokens: blocks of 4, the last one 3 tokens

    def generate(engine: Engine, name: str):
        deltas = []
        engine.submit(GenerationRequest(request_id=name, sink=deltas.append, prompt_token_ids=prompt, max_tokens=6,
                                        params=SamplingParams(temperature=0.0, logprobs=True), ignore_eos=True))
        while not (deltas and deltas[-1].finish_reason):
            engine.step()
        return [(t, lp.logprob) for d in deltas for t, lp in zip(d.token_ids, d.logprobs or [])]

    outputs = []
    for budget in (1024, 6):
        runner = ModelRunner.for_sequences(copy.deepcopy(tiny_hf), 2, 64, block_size=4, quantization=kind)
        engine = Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=64, prefill_budget=budget)
        outputs.append(generate(engine, "first"))
        assert dense_calls and max(dense_calls) <= 28  # the first 7 blocks, never the last one's 3 tokens
        dense_calls.clear()
        outputs.append(generate(engine, "cached"))  # 28 tokens from the prefix cache
        assert engine.blocks.hits >= 28 and not dense_calls
        engine.shutdown()
    assert all(out == outputs[0] for out in outputs) and len(outputs[0]) == 6
