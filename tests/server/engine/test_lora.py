"""LoRA adapters inside the batched forward: equal to the adapter merged into the weights, per row."""

from __future__ import annotations

import json

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.lora import LoraBank, LoraError, load_adapter, parse_lora_modules
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest
from tests.server.engine.paged_util import step
from tests.server.lora_util import make_adapter

PROMPTS = [[1, 504, 3458, 314, 260, 3575, 30], [1, 2683, 457, 2114, 28], [1, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    first = make_adapter(tiny_model_dir, root / "a", seed=1, merged_dir=root / "a-merged")
    second = make_adapter(tiny_model_dir, root / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], rank=8,
                          alpha=4.0, use_rslora=True, merged_dir=root / "b-merged")
    return {"a": first, "b": second, "a-merged": root / "a-merged", "b-merged": root / "b-merged"}


def cpu_model(directory):
    return load_hf_model(directory, torch.float32, torch.device("cpu"))


def engine_for(directory, modules=(), slots: int = 8) -> Engine:
    hf = cpu_model(directory)
    bank = LoraBank([load_adapter(name, path, hf) for name, path in modules]) if modules else None
    runner = ModelRunner.for_sequences(hf, slots, 512, lora=bank)
    return Engine(runner, None, max_batch_size=slots, max_model_len=512)


class _Tokenizer:
    """Enough of a tokenizer for the detokenizer: token ids as text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids]


def run(engine: Engine, requests: list[dict]) -> list[list[int]]:
    engine.tokenizer = engine.tokenizer or _Tokenizer()
    results = [{"tokens": [], "finish": None} for _ in requests]

    def sink_for(i):
        def sink(delta):
            results[i]["tokens"] += delta.token_ids
            results[i]["finish"] = delta.finish_reason or results[i]["finish"]
        return sink

    for i, fields in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", sink=sink_for(i), params=SamplingParams(temperature=0.0),
                                        max_tokens=24, ignore_eos=True, **fields))
    for _ in range(2000):
        if all(r["finish"] for r in results):
            assert all(r["finish"] == "length" for r in results)
            return [r["tokens"] for r in results]
        engine.step()
    raise AssertionError("engine did not finish")


def test_adapter_logits_equal_merged_weights(tiny_model_dir, adapters):
    hf = cpu_model(tiny_model_dir)
    bank = LoraBank([load_adapter("a", adapters["a"], hf), load_adapter("b", adapters["b"], hf)])
    runner = ModelRunner.for_sequences(hf, 4, 128, lora=bank)
    merged = {name: ModelRunner.for_sequences(cpu_model(adapters[f"{name}-merged"]), 4, 128) for name in "ab"}
    base = ModelRunner.for_sequences(cpu_model(tiny_model_dir), 4, 128)
    rows = [(i, prompt, 0) for i, prompt in enumerate(PROMPTS)]
    mixed = step(runner, rows, 128, row_adapters=[1, 0, 2])
    expected = [
        step(merged["a"], rows[:1], 128)[0],
        step(base, [(0, PROMPTS[1], 0)], 128)[0],
        step(merged["b"], [(0, PROMPTS[2], 0)], 128)[0],
    ]
    for got, want in zip(mixed, expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = step(base, rows[:1], 128)[0]
    assert (mixed[0] - plain).abs().max() > 1e-2  # the adapter changes the output


def test_adapter_greedy_output_equals_merged_model(tiny_model_dir, adapters):
    with_adapter = run(engine_for(tiny_model_dir, [("a", adapters["a"])]), [{"prompt_token_ids": PROMPTS[0], "adapter": 1}])
    merged = run(engine_for(adapters["a-merged"]), [{"prompt_token_ids": PROMPTS[0]}])
    base = run(engine_for(tiny_model_dir), [{"prompt_token_ids": PROMPTS[0]}])
    assert with_adapter == merged
    assert with_adapter != base


def test_two_adapters_and_base_in_one_batch_equal_their_solo_runs(tiny_model_dir, adapters):
    modules = [("a", adapters["a"]), ("b", adapters["b"])]
    mixed_requests = [{"prompt_token_ids": PROMPTS[i % 3], "adapter": i % 3} for i in range(6)]
    mixed = run(engine_for(tiny_model_dir, modules), mixed_requests)
    for request, tokens in zip(mixed_requests, mixed):
        solo = run(engine_for(tiny_model_dir, modules), [request])[0]
        assert tokens == solo
    assert len({tuple(t) for t in mixed[:3]}) == 3  # base and both adapters differ


def test_parse_lora_modules():
    assert parse_lora_modules("a=/x, b=/y\nc=rel") == [("a", __import__("pathlib").Path("/x")),
                                                      ("b", __import__("pathlib").Path("/y")),
                                                      ("c", __import__("pathlib").Path("rel"))]
    for bad in ("nameonly", "a=/x,a=/y", "a:b=/x"):
        with pytest.raises(LoraError):
            parse_lora_modules(bad)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"bias": "all"}, "biases"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ],
)
def test_unsupported_adapters_are_refused_in_one_line(tiny_model_dir, adapters, tmp_path, change, named):
    import shutil

    directory = tmp_path / "bad"
    shutil.copytree(adapters["a"], directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(change)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraError, match=named) as info:
        load_adapter("bad", directory, cpu_model(tiny_model_dir))
    assert "\n" not in str(info.value) and "'bad'" in str(info.value)


def test_embedding_weights_and_missing_files_are_refused(tiny_model_dir, adapters, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf = cpu_model(tiny_model_dir)
    with pytest.raises(LoraError, match="not a directory"):
        load_adapter("gone", tmp_path / "nowhere", hf)
    directory = tmp_path / "emb"
    shutil.copytree(adapters["a"], directory)
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 10)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="embed_tokens"):
        load_adapter("emb", directory, hf)


def test_unknown_adapter_id_fails_only_its_own_sequence(tiny_model_dir, adapters):
    engine = engine_for(tiny_model_dir, [("a", adapters["a"])])
    engine.tokenizer = _Tokenizer()
    finishes = {}

    def sink_for(name):
        def sink(delta):
            if delta.finish_reason:
                finishes[name] = (delta.finish_reason, delta.error)
        return sink

    for name, adapter in [("bad", 5), ("good", 1)]:
        engine.submit(GenerationRequest(request_id=name, prompt_token_ids=PROMPTS[0], params=SamplingParams(temperature=0.0),
                                        max_tokens=3, ignore_eos=True, sink=sink_for(name), adapter=adapter))
    while len(finishes) < 2:
        engine.step()
    assert finishes["bad"][0] == "error" and "adapter" in finishes["bad"][1]
    assert finishes["good"] == ("length", None)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random-weight Qwen3-MoE checkpoint (every layer a mixture of experts)."""
    from tests.server.engine.test_hf_runner import _save_tiny

    directory = tmp_path_factory.mktemp("qwen3-moe")
    _save_tiny("qwen3_moe", directory)
    return directory


def _write_adapter(directory, tensors: dict, **config) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def _moe_model(directory):
    from server.engine.hf_runner import load_model

    return load_model(directory, torch.float32, torch.device("cpu"))


def test_lora_on_moe_experts_is_refused_in_one_line(tiny_moe_dir, tmp_path):
    """Dense-MLP targets a MoE layer lacks, per-expert weights and peft's target_parameters on
    the fused experts: each a one-line LoraError naming the module (through --lora-modules too)."""
    from peft import LoraConfig, get_peft_model

    from server.model_loader import load_lora_adapters

    model = _moe_model(tiny_moe_dir)
    prefix = "base_model.model.model.layers.0.mlp"
    _write_adapter(tmp_path / "dense", {f"{prefix}.gate_proj.lora_A.weight": torch.zeros(4, 64),
                                        f"{prefix}.gate_proj.lora_B.weight": torch.zeros(96, 4)},
                   target_modules=["gate_proj"])
    _write_adapter(tmp_path / "per-expert", {f"{prefix}.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 64),
                                             f"{prefix}.experts.0.gate_proj.lora_B.weight": torch.zeros(32, 4)},
                   target_modules=["gate_proj"])
    peft_model = get_peft_model(_moe_model(tiny_moe_dir), LoraConfig(r=4, target_modules=[],
                                                                     target_parameters=["experts.gate_up_proj"]))
    peft_model.save_pretrained(tmp_path / "fused")
    cases = {"dense": "layers.0.mlp.gate_proj is a mixture-of-experts layer",
             "per-expert": "layers.0.mlp.experts.0.gate_proj.lora_A.weight targets the experts",
             "fused": "target_parameters"}
    for name, named in cases.items():
        with pytest.raises(LoraError, match=named) as info:
            load_lora_adapters(f"{name}={tmp_path / name}", model)
        assert "\n" not in str(info.value) and f"'{name}'" in str(info.value)


def test_attention_lora_on_a_moe_model_loads(tiny_moe_dir, tmp_path):
    from server.engine.hf_runner import TransformersRunner
    from tests.server.engine.paged_util import step

    adapter = make_adapter(tiny_moe_dir, tmp_path / "attn", seed=3, targets=["q_proj", "v_proj"])
    model = _moe_model(tiny_moe_dir)
    bank = LoraBank([load_adapter("attn", adapter, model)])
    assert bank.adapters[0].target_modules == ["q_proj", "v_proj"]
    runner = TransformersRunner(model, num_blocks=16, block_size=4, lora=bank)
    rows = [(0, [1, 5, 9, 13], 0), (1, [1, 5, 9, 13], 0)]
    logits = step(runner, rows, 16, row_adapters=[1, 0])
    assert not torch.equal(logits[0], logits[1])  # the adapter changes its row only
