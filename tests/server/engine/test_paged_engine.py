"""The engine over the paged KV cache: prefix reuse, preemption under a small cache, limits."""

from __future__ import annotations

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest

BLOCK = 4
SYSTEM = [1, 504, 3300, 28, 1012, 77, 88, 99, 2500, 314, 15, 16, 17, 18]  # a shared "system prompt"


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def make_engine(hf, tokenizer, num_blocks: int, batch: int = 4, **kwargs) -> Engine:
    """The context length is what the whole cache holds (the most the engine accepts)."""
    runner = ModelRunner(hf, num_blocks=num_blocks, block_size=BLOCK)
    return Engine(runner, tokenizer, max_batch_size=batch, max_model_len=(num_blocks - 1) * BLOCK, **kwargs)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> list[dict]:
    """Submit all at once, step until all finish; per request: tokens and the last delta."""
    results = [{"tokens": [], "last": None} for _ in prompts]

    def sink_for(i):
        def sink(delta):
            results[i]["tokens"] += delta.token_ids
            results[i]["last"] = delta
        return sink

    for i, prompt in enumerate(prompts):
        engine.submit(GenerationRequest(request_id=f"r{i}", sink=sink_for(i), prompt_token_ids=prompt,
                                        params=SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                        ignore_eos=True))
    for _ in range(3000):
        if all(r["last"] is not None and r["last"].finish_reason for r in results):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


def test_second_request_reuses_the_prefix_and_generates_the_same(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, num_blocks=64)
    prompt = SYSTEM + [40, 41, 42]
    first = run(engine, [prompt])[0]
    second = run(engine, [prompt])[0]
    assert first["last"].cached_tokens == 0
    assert second["last"].cached_tokens == 16  # 17 tokens: 4 full blocks reused, the last token recomputed
    assert second["tokens"] == first["tokens"]
    other = run(engine, [SYSTEM + [50, 51]])[0]  # same system prompt, another question
    assert other["last"].cached_tokens == 12
    alone = run(make_engine(tiny_hf, default_tokenizer, num_blocks=64, enable_prefix_caching=False),
                [SYSTEM + [50, 51]])[0]
    assert alone["last"].cached_tokens == 0 and alone["tokens"] == other["tokens"]


def test_a_full_cache_preempts_and_every_output_is_unchanged(tiny_hf, default_tokenizer):
    prompts = [[1, 100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(4)]
    alone = [run(make_engine(tiny_hf, default_tokenizer, num_blocks=64), [p], max_tokens=20)[0]["tokens"]
             for p in prompts]
    # Each sequence needs 26 tokens = 7 blocks; 13 usable blocks hold fewer than two at full length.
    engine = make_engine(tiny_hf, default_tokenizer, num_blocks=14, enable_prefix_caching=False)
    together = run(engine, prompts, max_tokens=20)
    assert [r["tokens"] for r in together] == alone
    assert all(r["last"].finish_reason == "length" for r in together)
    assert engine.scheduler.preemptions > 0
    assert engine.blocks.num_free == 13  # every block came back


def test_preempted_sequence_recovers_its_prefix_from_the_cache(tiny_hf, default_tokenizer):
    prompts = [SYSTEM + [60 + i] for i in range(3)]
    alone = [run(make_engine(tiny_hf, default_tokenizer, num_blocks=64), [p])[0]["tokens"] for p in prompts]
    engine = make_engine(tiny_hf, default_tokenizer, num_blocks=16)
    together = run(engine, prompts)
    assert [r["tokens"] for r in together] == alone
    assert engine.blocks.hits > 0


def test_a_context_longer_than_the_cache_is_refused_at_start(tiny_hf, default_tokenizer):
    runner = ModelRunner(tiny_hf, num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="holds 12 tokens"):
        Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=13)


def test_a_sequence_larger_than_the_cache_fails_alone(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, num_blocks=4)  # 12 tokens of cache
    small, large = run(engine, [[1, 2, 3], list(range(1, 30))], max_tokens=4)
    assert small["last"].finish_reason == "length"
    assert large["last"].finish_reason == "error"
    assert "more than the whole cache holds" in large["last"].error
