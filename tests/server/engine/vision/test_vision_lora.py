"""LoRA on a vision-language model's language model: an adapter (peft) over the tiny Qwen2-VL's
attention and MLP projections gives, through the engine with an image prompt, the greedy tokens
of transformers' own generation with the adapter merged in; an adapter on the vision tower is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from server.engine.lora import LoraError
from server.engine.vision.runner import VisionRunner, load_vision_model
from server.model_loader import load_lora_adapters
from tests.server.engine.vision.test_vision_engine import NEW_TOKENS, _generate, _picture, _prompt, _reference
from tests.server.engine.vision.tiny_vlm import write_qwen2_vl

LANGUAGE_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _adapter(base_dir, adapter_dir, merged_dir, targets: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(adapter_dir)
    if merged_dir is not None:
        model.merge_and_unload().save_pretrained(merged_dir)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(merged_dir)
        for name in ("preprocessor_config.json",):
            (merged_dir / name).write_bytes((base_dir / name).read_bytes())
    return adapter_dir


def test_a_language_model_adapter_gives_the_merged_models_tokens(tmp_path, default_tokenizer):
    from transformers import AutoTokenizer

    from sampler import SamplingParams
    from server.engine.engine import Engine
    from server.engine.sequence import GenerationRequest

    base_dir = write_qwen2_vl(tmp_path / "base", default_tokenizer)
    adapter = _adapter(base_dir, tmp_path / "adapter", tmp_path / "merged", LANGUAGE_TARGETS)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    hf = load_vision_model(base_dir, torch.float32, torch.device("cpu"))
    bank = load_lora_adapters(f"style={adapter}", hf)
    runner = VisionRunner(hf, num_blocks=160, block_size=4, lora=bank)
    engine = Engine(runner, tokenizer, max_batch_size=4, max_model_len=512, speculation=False)
    ids, media = _prompt(runner, tokenizer, base_dir, [_picture(100, 80, 1)])
    [(base_tokens, _)] = _generate(engine, [(ids, media)])
    out: list = []
    engine.submit(GenerationRequest(request_id="lora", prompt_token_ids=ids, media=media, adapter=1, ignore_eos=True,
                                    params=SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS, sink=out.append))
    while not (out and out[-1].finish_reason):
        engine.step()
    adapted = [t for d in out for t in d.token_ids]
    assert adapted == _reference(tmp_path / "merged", ids, media)
    assert adapted != base_tokens


def test_an_adapter_on_the_vision_tower_is_refused(tmp_path, default_tokenizer):
    base_dir = write_qwen2_vl(tmp_path / "base", default_tokenizer)
    adapter = _adapter(base_dir, tmp_path / "adapter", None, r".*visual.*\.qkv")
    hf = load_vision_model(base_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(LoraError, match="vision tower"):
        load_lora_adapters(f"eye={adapter}", hf)
