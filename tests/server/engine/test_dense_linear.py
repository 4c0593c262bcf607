"""``DenseLinears``: which kernels a runner's unquantized weights take, chosen once at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_fused import cpu_fused_ops
from server.engine.dense_linear import DenseLinears

CPU = torch.device("cpu")
_OPS = cpu_fused_ops()


@pytest.mark.skipif(_OPS is None or not _OPS.panel_kernel_vectorised(), reason="no AVX-512 fused CPU ops here")
def test_float32_cpu_weights_packed_at_load_take_the_panel_kernel() -> None:
    dense = DenseLinears(CPU, torch.float32, None)
    assert dense.cpu_packed and dense.gemv is None and not dense.batch_invariant and dense.num_kv_splits is None
    x, weight, other = torch.randn(70, 40), torch.randn(24, 40), torch.randn(24, 40)
    dense.pack([weight])
    assert dense.packed_bytes == 48 * 40 * 4  # one panel of 48 weight rows
    got = dense.linear(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(dense.linear(x[:1], weight, None), got[:1])  # a row as it would be alone
    assert torch.equal(dense.linear(x, other, None), F.linear(x, other))  # a weight never packed
    assert torch.equal(dense.linear(x, weight.clone(), None), F.linear(x, weight))  # same values, another tensor


def test_other_dtypes_and_the_interpreter_keep_linear() -> None:
    for dense in (DenseLinears(CPU, torch.bfloat16, None), DenseLinears(CPU, torch.float32, True)):
        assert not dense.cpu_packed  # bf16; the CUDA path in Triton's interpreter
        weight = torch.randn(4, 8)
        dense.pack([weight])
        assert dense.packed_bytes == 0
    x, weight, bias = torch.randn(2, 8).double(), torch.randn(4, 8).double(), torch.randn(4).double()
    assert torch.equal(DenseLinears(CPU, torch.float64, None).linear(x, weight, bias), F.linear(x, weight, bias))


def test_batch_invariance_applies_with_triton_and_refuses_fp8_and_lora() -> None:
    assert not DenseLinears(CPU, torch.float32, None, batch_invariant=True).batch_invariant  # CPU paths as they are
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, lora=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        DenseLinears(CPU, torch.float32, True, batch_invariant=True, fp8=True)


def _onto_gguf_grids(model: torch.nn.Module) -> int:
    """Round every linear weight (and the embedding) of ``model`` onto a Q4_1 grid (the embedding a
    Q8_0 one), as a GGUF file's weights dequantized are; returns how many were moved."""
    moved = 0
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() != 2 or weight.shape[1] % 32:
                continue
            groups = weight.double().reshape(weight.shape[0], -1, 32)
            if "embed" in name:
                d = (groups.abs().amax(-1, keepdim=True) / 127).half().double()
                snapped = torch.round(groups / d.clamp_min(1e-30)).clamp(-127, 127) * d  # a padding row stays 0
            else:
                low = groups.amin(-1, keepdim=True).half().double()
                d = ((groups.amax(-1, keepdim=True) - low) / 15).half().double()
                snapped = torch.round((groups - low) / d.clamp_min(1e-30)).clamp(0, 15) * d + low
            weight.copy_(snapped.reshape(weight.shape).float())
            moved += 1
    return moved


@pytest.mark.skipif(_OPS is None or not _OPS.panel_kernel_vectorised(), reason="no AVX-512 fused CPU ops here")
def test_a_model_on_gguf_grids_generates_the_same_tokens_from_its_grids(tiny_model_dir, default_tokenizer,
                                                                       monkeypatch) -> None:
    """float32 weights dequantized from Q4_1 / Q8_0, packed as their grids or as float32 panels:
    bitwise the same tokens and logprobs, greedy and seeded, two requests at once."""
    import copy

    from sampler import SamplingParams
    from server.engine.engine import Engine
    from server.engine.model import ModelRunner, load_hf_model
    from server.engine.sequence import GenerationRequest

    hf = load_hf_model(tiny_model_dir, torch.float32, CPU)
    assert _onto_gguf_grids(hf) >= 8
    outputs = {}
    for grids in ("1", "0"):
        monkeypatch.setenv("TRELLIS_WEIGHT_GRIDS", grids)
        runner = ModelRunner.for_sequences(copy.deepcopy(hf), 2, 64)
        kinds = {getattr(packed, "kind", "float32") for _, packed in runner.dense._packed.values()}
        assert kinds == ({"q4", "q8"} if grids == "1" else {"float32"})
        engine = Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=64)
        sinks = {name: [] for name in ("greedy", "seeded")}
        for name, params in (("greedy", SamplingParams(temperature=0.0, logprobs=True)),
                             ("seeded", SamplingParams(temperature=0.9, seed=7, logprobs=True))):
            engine.submit(GenerationRequest(request_id=name, sink=sinks[name].append, prompt_token_ids=list(range(30, 52)),
                                            max_tokens=12, params=params, ignore_eos=True))
        while not all(deltas and deltas[-1].finish_reason for deltas in sinks.values()):
            engine.step()
        engine.shutdown()
        outputs[grids] = {name: [(t, lp.logprob) for d in deltas for t, lp in zip(d.token_ids, d.logprobs or [])]
                          for name, deltas in sinks.items()}
    assert outputs["1"] == outputs["0"] and all(len(out) == 12 for out in outputs["1"].values())
