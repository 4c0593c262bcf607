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
