"""FP8 weights (:mod:`server.engine.fp8_weights`, :mod:`kernels.fp8`): checkpoints in each format
transformers and vLLM read, written here from a tiny random Llama, load through Trellis's loader
and generate the tokens of the same model with the checkpoint's weights dequantized; the FP8
matmul path (``torch._scaled_mm``, the W8A16 kernel) against its float32 references; and
``--quantization fp8``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Choice,
    GemvConfig,
    fp8_gemv,
    fp8_gemv_reference,
    gemv_configs,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
    row_bucket,
    scaled_linear,
    scaled_linear_reference,
)
from server.engine import fp8_weights
from server.engine.model import ModelRunner, load_hf_model
from server.engine.step_batch import StepBatch
from server.model_loader import ModelLoadError, check_quantization
from tests.server.lora_util import make_adapter

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [5, 17, 42, 99, 3, 64, 128, 7, 250, 11]
NEW_TOKENS = 12


def _scaled_mm_runs_on_the_cpu() -> bool:
    try:
        one = torch.ones((), dtype=torch.float32)
        torch._scaled_mm(torch.zeros(16, 16, dtype=FP8), torch.zeros(16, 16, dtype=FP8).t(), scale_a=one,
                         scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _scaled_mm_runs_on_the_cpu(),
                                         reason="torch._scaled_mm does not run on the CPU in this torch")


# ---------------------------------------------------------------- checkpoints in each format


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama in float32 (dims multiples of 16, untied output layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("fp8-base")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init's: peaked logits, so greedy tokens mean something
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                param.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    return directory


def _input_amax(base: Path) -> dict[str, float]:
    """Each projection's largest input magnitude over the prompt (the calibration of static scales)."""
    model = load_hf_model(base, torch.float32, CPU)
    seen: dict[str, float] = {}
    hooks = [module.register_forward_hook(
        lambda mod, args, out, name=name: seen.__setitem__(name, max(seen.get(name, 0.0), float(args[0].abs().max())))
    ) for name, module in model.named_modules() if name.endswith(PROJECTIONS)]
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    for hook in hooks:
        hook.remove()
    return seen


def _fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().max() / FP8_MAX
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


def _fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    tiles = weight.reshape(rows // block, block, cols // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(rows, cols)
    return q, scale.float()


FORMATS = {
    # vLLM / AutoFP8 "fp8": one scale per tensor, static activation scales
    "fp8-static": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    "fp8-dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
    # transformers' FineGrainedFP8 (DeepSeek, Qwen3 FP8): block scales as weight_scale_inv
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    # fbgemm (Meta's FP8 releases): per-channel weight scales [N, 1], per-token activations
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    # llm-compressor FP8_DYNAMIC: per-channel weights, dynamic per-token activations
    "compressed-tensors-channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True},
        }},
    },
    # llm-compressor FP8 (static): per-tensor weights and activations
    "compressed-tensors-tensor": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                  "symmetric": True},
        }},
    },
}


def _quantized_tensors(name: str, weight: torch.Tensor, fmt: str, amax: float) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``fmt`` stores for one projection, as its library writes them."""
    prefix = name.removesuffix(".weight")
    if fmt == "fp8-block":
        q, scale = _fp8_blocks(weight, 32)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale}
    if fmt in ("fbgemm_fp8", "compressed-tensors-channel"):
        q, scale = quantize_weight(weight)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale.reshape(-1, 1)}
    q, scale = _fp8_per_tensor(weight)
    tensors = {f"{prefix}.weight": q}
    static = fmt in ("fp8-static", "compressed-tensors-tensor")
    shape = (1,) if fmt.startswith("compressed") else ()  # llm-compressor writes [1], AutoFP8 scalars
    tensors[f"{prefix}.weight_scale"] = scale.reshape(shape)
    if static:
        tensors[f"{prefix}.input_scale"] = torch.tensor(amax / FP8_MAX, dtype=torch.float32).reshape(shape)
    return tensors


def write_checkpoint(base: Path, target: Path, fmt: str) -> Path:
    """``base`` quantized to FP8 in format ``fmt`` (tensors, names and config as the format's
    library writes them; the output layer left unquantized, as they all do by default)."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True)
    state = load_file(base / "model.safetensors")
    amax = _input_amax(base)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if module.endswith(PROJECTIONS) and name.endswith(".weight"):
            tensors.update(_quantized_tensors(name, tensor, fmt, amax[module]))
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, target / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = FORMATS[fmt]
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def checkpoints(base_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-checkpoints")
    return {fmt: write_checkpoint(base_dir, root / fmt, fmt) for fmt in FORMATS}


def dequantized_reference(base: Path, checkpoint: Path) -> nn.Module:
    """The base model with every FP8 projection replaced by its weight times its scales, computed
    here independently of the loader (and the other tensors rounded to bf16, as stored)."""
    from safetensors.torch import load_file

    model = load_hf_model(base, torch.float32, CPU)
    tensors = load_file(checkpoint / "model.safetensors")
    with torch.no_grad():
        for name, param in model.named_parameters():
            stored = tensors[name]
            if stored.dtype != FP8:
                param.copy_(stored.float())
                continue
            prefix = name.removesuffix(".weight")
            if f"{prefix}.weight_scale_inv" in tensors:
                grid = tensors[f"{prefix}.weight_scale_inv"].repeat_interleave(32, 0).repeat_interleave(32, 1)
                param.copy_(stored.float() * grid)
            else:
                scale = tensors[f"{prefix}.weight_scale"].float()
                param.copy_(stored.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())))
    return model


def greedy(runner: ModelRunner, prompt: list[int] = PROMPT, count: int = NEW_TOKENS, adapter: int = 0,
           forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``prompt`` (prefill, then one token a step) and each step's logits;
    ``forced``: feed these tokens instead (teacher forcing, to compare two models step by step)."""
    count = len(forced) if forced is not None else count
    table = list(range(1, 1 + -(-(len(prompt) + count) // runner.block_size)))
    adapters = [adapter] if adapter else None
    logits = [runner.forward(StepBatch.build([(table, prompt, 0)], runner.block_size, runner.device,
                                             row_adapters=adapters))[-1]]
    tokens: list[int] = []
    for i in range(count):
        tokens.append(forced[i] if forced is not None else int(logits[-1].argmax()))
        batch = StepBatch.build([(table, [tokens[-1]], len(prompt) + i)], runner.block_size, runner.device,
                                row_adapters=adapters)
        logits.append(runner.forward(batch)[-1])
    return tokens, torch.stack(logits).float().cpu()


def _runner(model: nn.Module, **options) -> ModelRunner:
    return ModelRunner.for_sequences(model, 1, 64, **options)


def _close(got: torch.Tensor, want: torch.Tensor, fraction: float) -> None:
    """``got`` within ``fraction`` of ``want`` in relative RMS error (FP8's 3 mantissa bits: a few
    percent per matmul, compounded through the tiny model's layers)."""
    error = float((got.float() - want.float()).norm() / want.float().norm())
    assert error <= fraction, f"relative error {error:.4f}"


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.argmax(-1) == want.argmax(-1)).float().mean())


# ---------------------------------------------------------------- loading on the CPU (dequantized)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_loads_dequantized_and_generates_the_dequantized_models_tokens(base_dir, checkpoints, fmt):
    checkpoint = checkpoints[fmt]
    line = check_quantization(checkpoint, CPU, torch.float32)
    assert "dequantized at load on cpu" in line and "\n" not in line
    model = load_hf_model(checkpoint, torch.float32, CPU)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    runner = _runner(model)
    assert runner.fp8 is None  # the forward never sees FP8 on the CPU
    tokens, logits = greedy(runner)
    want_tokens, want_logits = greedy(_runner(dequantized_reference(base_dir, checkpoint)))
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    # and within FP8's tolerance of the unquantized model, fed the same tokens
    _, base_logits = greedy(_runner(load_hf_model(base_dir, torch.float32, CPU)), forced=tokens)
    _close(logits, base_logits, 0.3)
    assert _agreement(logits, base_logits) >= 0.6


def test_the_loader_reads_the_scales_of_each_layout(checkpoints):
    for fmt in ("fp8-static", "compressed-tensors-tensor", "fbgemm_fp8", "fp8-block"):
        model = fp8_weights_loaded(checkpoints[fmt])
        q_proj = model.model.layers[0].self_attn.q_proj
        assert q_proj.weight.dtype == FP8 and q_proj.weight_scale.shape == (64,)
        static = fmt in ("fp8-static", "compressed-tensors-tensor")
        assert (q_proj.input_scale is not None) == static
        assert model.lm_head.weight.dtype == torch.float32  # left unquantized, as written
    assert fp8_weights_loaded(checkpoints["fbgemm_fp8"]).model.layers[0].mlp.down_proj.activation_scale_ub == 1200.0


def fp8_weights_loaded(checkpoint: Path) -> nn.Module:
    """The checkpoint loaded as on CUDA: FP8 weights kept (on the CPU, for the tests)."""
    original = fp8_weights.keeps_fp8
    fp8_weights.keeps_fp8 = lambda device: True
    try:
        return load_hf_model(checkpoint, torch.float32, CPU)
    finally:
        fp8_weights.keeps_fp8 = original


# ---------------------------------------------------------------- the FP8 matmul path, on the CPU


@needs_cpu_scaled_mm
@pytest.mark.parametrize("fmt", ["fp8-static", "fbgemm_fp8", "compressed-tensors-channel", "fp8-block"])
def test_the_fp8_path_generates_as_the_dequantized_model_within_fp8s_tolerance(base_dir, checkpoints, fmt):
    runner = _runner(fp8_weights_loaded(checkpoints[fmt]))
    assert runner.fp8 is not None and len(runner.fp8) == 4 * 2  # qkv, o, gate_up, down per layer
    assert runner.layers[0].qkv_weight.dtype == FP8
    want_tokens, want_logits = greedy(_runner(dequantized_reference(base_dir, checkpoints[fmt])))
    _, logits = greedy(runner, forced=want_tokens)  # activations quantized to FP8 too: compare step by step
    _close(logits, want_logits, 0.15)
    assert _agreement(logits, want_logits) >= 0.75


@needs_cpu_scaled_mm
def test_lora_on_an_fp8_model_adds_what_it_adds_to_the_dequantized_one(base_dir, checkpoints, tmp_path):
    from server.engine.lora import LoraBank, load_adapter

    adapter = make_adapter(base_dir, tmp_path / "adapter", seed=3)
    deltas = []
    for model in (fp8_weights_loaded(checkpoints["fbgemm_fp8"]), load_hf_model(checkpoints["fbgemm_fp8"],
                                                                                torch.float32, CPU)):
        runner = _runner(model, lora=LoraBank([load_adapter("a", adapter, model)]))
        _, plain = greedy(runner, count=0)
        _, adapted = greedy(runner, count=0, adapter=1)
        deltas.append(adapted - plain)
    assert float(deltas[1].abs().max()) > 0.1  # the adapter changes the output
    _close(deltas[0], deltas[1], 0.15)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("static", [False, True])
def test_scaled_linear_computes_its_reference(static):
    torch.manual_seed(1)
    x, weight = torch.randn(5, 64), torch.randn(48, 64) * 0.1
    q, scale = quantize_weight(weight)
    options = {"input_scale": torch.tensor([0.02])} if static else {"scale_ub": 2.5}
    want = scaled_linear_reference(x, q, scale.reshape(1, -1), **options)
    for tensorwise in (False, True):
        got = scaled_linear(x, q, scale.reshape(1, -1), tensorwise=tensorwise, **options)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and the reference is FP8's approximation of the float32 product
    _close(want, x @ weight.t(), 0.1)


def test_quantize_rows_reference_scales_each_row_by_its_maximum():
    x = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [300.0, 1.0, -1000.0]])
    q, scale = quantize_rows_reference(x)
    assert q.dtype == FP8 and scale.shape == (3, 1)
    assert torch.equal(scale[:, 0], torch.tensor([4.0 / FP8_MAX, scale[1, 0].item(), 1000.0 / FP8_MAX]))
    assert scale[1, 0] > 0 and torch.equal(q[1].float(), torch.zeros(3))
    assert float(q[0, 1]) == -FP8_MAX and float(q[2, 2]) == -FP8_MAX
    capped, capped_scale = quantize_rows_reference(x, scale_ub=100.0)
    assert capped_scale[2, 0] == pytest.approx(100.0 / FP8_MAX) and float(capped[2, 2]) == -FP8_MAX  # saturates


def test_the_row_quantization_kernel_agrees_with_its_reference():
    """Triton's interpreter (3.9) converts float32 to FP8 inexactly near a power of two, so on the
    CPU the scales must agree exactly and the values nearly all; compiled on CUDA: all of them."""
    torch.manual_seed(2)
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    x = (torch.randn(3, 2500) * 3).to(device)
    for input_scale, ub in ((None, None), (torch.tensor([0.01], device=device), None), (None, 2.0)):
        got, got_scale = quantize_rows(x, input_scale, ub, use_triton=True)
        want, want_scale = quantize_rows_reference(x, input_scale, ub)
        torch.testing.assert_close(got_scale, want_scale)
        agree = (got.float() == want.float()).float().mean().item()
        assert agree == 1.0 if device.type == "cuda" else agree > 0.9


@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_the_w8a16_kernel_computes_its_reference(rows):
    torch.manual_seed(3)
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, weight = torch.randn(rows, 256, device=device, dtype=dtype), torch.randn(48, 256, device=device) * 0.1
    q, scale = quantize_weight(weight)
    want = fp8_gemv_reference(x, q, scale).float()
    for config in (None, GemvConfig(16, 64, 1), GemvConfig(16, 64, 4), GemvConfig(32, 128, 2)):
        got = fp8_gemv(x, q, scale.reshape(1, -1), config=config, use_triton=True).float()
        torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)
    assert Fp8Choice().linear(x, q, scale.reshape(1, -1), use_triton=True).shape == (rows, 48)


@pytest.mark.parametrize("rows", [1, 3])
def test_few_rows_quantized_for_the_fp8_dot_compute_the_w8a8_reference(rows):
    """Up to 4 rows the a8 configurations pad the quantized rows to a 16-row dot tile."""
    torch.manual_seed(4)
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    x, weight = torch.randn(rows, 512, device=device), torch.randn(96, 512, device=device) * 0.1
    q, scale = quantize_weight(weight)
    if device.type == "cuda":
        x = x.to(torch.bfloat16)
    for options in ({}, {"input_scale": torch.tensor([0.01], device=device)}, {"scale_ub": 1.5}):
        want = scaled_linear_reference(x, q, scale.reshape(1, -1), **options).float()
        for config in (GemvConfig(32, 128, 1, a8=True), GemvConfig(64, 256, 2, a8=True)):
            got = fp8_gemv(x, q, scale.reshape(1, -1), config=config, use_triton=True, **options).float()
            # the interpreter's FP8 dot is inexact (a few percent); compiled, bf16 output rounding
            _close(got, want, 0.02 if device.type == "cuda" else 0.1)


def test_few_rows_time_the_fp8_dot_where_it_runs():
    names = [config.name for config in gemv_configs(1, fp8_dot=True)]
    assert "gemv_n8_k1024_s1" in names and "a8_n64_k128_s1" in names and len(set(names)) == len(names)
    assert not any(config.a8 for config in gemv_configs(1, fp8_dot=False))


def test_row_counts_share_a_choice_within_their_kernel_tile():
    """The engine's row counts change every step: one timed choice per tile, not per count."""
    assert [row_bucket(rows) for rows in (1, 2, 3, 4, 5, 16, 17, 64, 65, 128, 129)] == \
        [1, 2, 4, 4, 16, 16, 32, 64, 128, 128, 256]


# ---------------------------------------------------------------- --quantization fp8


def test_quantization_fp8_rounds_the_weights_where_fp8_does_not_run(base_dir):
    model = load_hf_model(base_dir, torch.float32, CPU)
    weight = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    runner = _runner(model, quantization="fp8")
    assert runner.fp8 is None and runner.quantized is None
    q, scale = quantize_weight(weight)
    assert torch.equal(runner.layers[1].down_proj.weight, q.float() * scale[:, None])
    tokens, logits = greedy(runner, count=4)
    _, want = greedy(_runner(load_hf_model(base_dir, torch.float32, CPU)), forced=tokens)
    _close(logits, want, 0.15)


@needs_cpu_scaled_mm
def test_quantization_fp8_keeps_fp8_weights_where_fp8_runs(base_dir, monkeypatch):
    monkeypatch.setattr(fp8_weights, "keeps_fp8", lambda device: True)
    model = load_hf_model(base_dir, torch.float32, CPU)
    runner = _runner(copy.deepcopy(model), quantization="fp8")
    assert runner.fp8 is not None and len(runner.fp8) == 8
    assert all(layer.gate_up_weight.dtype == FP8 for layer in runner.layers)
    assert runner.hf.lm_head.weight.dtype == torch.float32  # the output layer stays
    tokens, logits = greedy(runner, count=4)
    _, want = greedy(_runner(model), forced=tokens)
    _close(logits, want, 0.15)
    # a second runner on the same (now FP8) model finds the FP8 weights as a checkpoint's
    assert len(_runner(runner.hf).fp8) == 8


# ---------------------------------------------------------------- formats refused, in one line


def test_read_scheme_reads_each_format():
    assert fp8_weights.read_scheme(FORMATS["fp8-static"]) == fp8_weights.Fp8Scheme("fp8", True)
    assert fp8_weights.read_scheme(FORMATS["fp8-block"]).block == (32, 32)
    assert fp8_weights.read_scheme(FORMATS["fbgemm_fp8"]).scale_ub == 1200.0
    assert not fp8_weights.read_scheme(FORMATS["compressed-tensors-channel"]).static_activations
    assert fp8_weights.read_scheme(FORMATS["compressed-tensors-tensor"]).static_activations
    assert fp8_weights.read_scheme({"quant_method": "awq"}) is None


def test_compressed_tensors_without_float8_weights_is_refused_in_one_line(checkpoints, tmp_path):
    directory = tmp_path / "w8a8-int"
    directory.mkdir()
    config = json.loads((checkpoints["compressed-tensors-channel"] / "config.json").read_text())
    config["quantization_config"]["format"] = "int-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        check_quantization(directory, CPU, torch.float32)
    assert "compressed-tensors" in str(error.value) and "\n" not in str(error.value)


def test_an_fp8_checkpoint_of_another_architecture_is_refused_in_one_line(tmp_path):
    directory = tmp_path / "gpt2-fp8"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "quantization_config": FORMATS["fp8-dynamic"]}))
    with pytest.raises(ModelLoadError) as error:
        check_quantization(directory, CPU, torch.float32)
    assert "gpt2" in str(error.value) and "FP8" in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------- on CUDA (sm89+), where FP8 runs


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need CUDA sm89+")
@pytest.mark.parametrize("fmt", ["fp8-static", "fbgemm_fp8", "compressed-tensors-channel"])
def test_on_cuda_the_weights_stay_fp8_and_generate_as_the_dequantized_model(base_dir, checkpoints, fmt):
    cuda = torch.device("cuda")
    assert "stay FP8" in check_quantization(checkpoints[fmt], cuda, torch.bfloat16)
    model = load_hf_model(checkpoints[fmt], torch.bfloat16, cuda)
    runner = _runner(model)
    assert runner.fp8 is not None and runner.layers[0].qkv_weight.dtype == FP8
    want_tokens, want_logits = greedy(_runner(dequantized_reference(base_dir, checkpoints[fmt])))
    _, logits = greedy(runner, forced=want_tokens)  # bf16 activations, FP8 on top of it
    _close(logits, want_logits, 0.2)
    assert _agreement(logits, want_logits) >= 0.75


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need CUDA sm89+")
def test_on_cuda_every_row_bucket_is_timed_before_serving(checkpoints):
    """A draft's or a jump-forward's row count never compiles and times kernels inside a step."""
    runner = _runner(load_hf_model(checkpoints["fbgemm_fp8"], torch.bfloat16, torch.device("cuda")))
    runner.prime_linear_choices()
    fp8_buckets = {key[0] for key in runner.fp8.choice.table}
    assert fp8_buckets == {1, 2, 4, 16, 32, 64}
    head = runner.hf.lm_head.weight
    assert {key[0] for key in runner.gemv.table if key[1:3] == tuple(head.shape)} == {1, 2, 4, 8}
    timed = len(runner.fp8.choice.table), len(runner.gemv.table)
    for rows in (3, 5, 7, 33):
        x = torch.randn(rows, head.shape[1], dtype=torch.bfloat16, device="cuda")
        runner._linear(x, runner.layers[0].qkv_weight, runner.layers[0].qkv_bias)
        if rows <= 8:
            runner._linear(x, head, None)
    assert (len(runner.fp8.choice.table), len(runner.gemv.table)) == timed

