"""transformers' own modelling code over Trellis's paged attention: for a tiny random-weight model
of each supported architecture, greedy tokens driven through :class:`TransformersRunner` (paged,
batched, prefill mixed with decode, a shared cached prefix, sliding windows shorter than the
context) equal ``generate(do_sample=False)``; per-position logits and final hidden states equal
the plain forward's."""

from __future__ import annotations

import json

import pytest
import torch

from server.engine.hf_runner import (
    SUPPORTED_MODEL_TYPES,
    TransformersRunner,
    UnsupportedModelError,
    load_model,
)
from server.engine.step_batch import StepBatch

VOCAB = 320
BLOCK = 4
WINDOW = 5  # sliding window of the sliding layers: shorter than every context below
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=None)  # no EOS: generate runs to max_new_tokens, as the paged side does


def _configs():
    from transformers import (
        Gemma3TextConfig,
        Glm4Config,
        Glm4MoeConfig,
        GlmConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    sliding = ["sliding_attention", "full_attention"]
    return {
        "llama": lambda: LlamaConfig(**COMMON),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
        "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
        "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                     layer_types=["full_attention", "sliding_attention"]),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
        "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=1),
        "gemma3_text": lambda: Gemma3TextConfig(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                                layer_types=sliding, final_logit_softcapping=3.0),
        "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=WINDOW, layer_types=sliding),
        "glm": lambda: GlmConfig(**COMMON, head_dim=16),
        "glm4": lambda: Glm4Config(**COMMON, head_dim=16),
        "glm4_moe": lambda: Glm4MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
                                          num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True),
    }


def _save_tiny(model_type: str, directory) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_configs()[model_type]())
    with torch.no_grad():  # gpt-oss leaves its sinks uninitialised; random sinks exercise them
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(directory)


@pytest.fixture(scope="module", params=list(SUPPORTED_MODEL_TYPES))
def arch(request, tmp_path_factory):
    """(model type, paged runner's model, reference model) for one architecture."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp(request.param)
    _save_tiny(request.param, directory)
    paged = load_model(directory, torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, paged, reference


class Blocks:
    """The test's block allocator: a free list, blocks handed out as sequences grow."""

    def __init__(self, count: int) -> None:
        self.free = list(range(count - 1, -1, -1))

    def grow(self, table: list[int], tokens: int) -> list[int]:
        while len(table) * BLOCK < tokens:
            table.append(self.free.pop())
        return table


class Seq:
    def __init__(self, prompt: list[int], table: list[int] | None = None, cached: int = 0) -> None:
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.table = list(table or [])
        self.cached = cached  # tokens whose keys/values the cache holds

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def step(runner: TransformersRunner, blocks: Blocks, seqs: list[Seq]) -> None:
    """One engine step: every sequence feeds what the cache lacks; greedy-append the next token."""
    rows = []
    for seq in seqs:
        blocks.grow(seq.table, len(seq.tokens))
        rows.append((seq.table, seq.tokens[seq.cached :], seq.cached))
    logits = runner.forward(StepBatch.build(rows, BLOCK, runner.device))
    for seq, row in zip(seqs, logits):
        seq.cached = len(seq.tokens)
        seq.tokens.append(int(row.argmax()))


def hf_greedy(reference, prompt: list[int], count: int) -> list[int]:
    """transformers' own greedy decoding (no EOS stop: the paged side never stops either)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    assert out.shape[1] == len(prompt) + count
    return out[0, len(prompt) :].tolist()


PROMPT_A = [1, 17, 93, 250, 41, 7, 166, 18, 301, 77, 12, 64, 9]  # 13 tokens: 3 full blocks + 1
PROMPT_B = PROMPT_A[:8] + [33, 210, 5]  # shares A's first two blocks
PROMPT_C = [1, 140, 29, 88, 3]
NEW = 6


def test_greedy_tokens_equal_transformers_generate(arch):
    """Prefill, token-by-token decode, a second batch whose first row reuses the first sequence's
    cached prefix blocks (start > 0) and whose second row prefills while the first decodes."""
    _, paged, reference = arch
    runner = TransformersRunner(paged, num_blocks=64, block_size=BLOCK)
    blocks = Blocks(64)
    a = Seq(PROMPT_A)
    for _ in range(NEW):
        step(runner, blocks, [a])
    assert a.generated == hf_greedy(reference, PROMPT_A, NEW)

    b = Seq(PROMPT_B, table=a.table[:2], cached=8)
    c = Seq(PROMPT_C)
    step(runner, blocks, [b])  # b: only its 3 uncached tokens, attending over a's blocks
    for _ in range(NEW - 1):
        step(runner, blocks, [b, c])  # first round: c prefills while b decodes
    step(runner, blocks, [c])
    assert b.generated == hf_greedy(reference, PROMPT_B, NEW)
    assert c.generated == hf_greedy(reference, PROMPT_C, NEW)


def test_forked_block_copy_continues_like_the_original(arch):
    """copy_blocks: a fork gets a copy of the shared, partly filled last block and decodes on."""
    _, paged, reference = arch
    runner = TransformersRunner(paged, num_blocks=32, block_size=BLOCK)
    blocks = Blocks(32)
    a = Seq(PROMPT_C + [9, 10])  # 7 tokens: last block half full
    step(runner, blocks, [a])
    copy = blocks.free.pop()
    runner.copy_blocks([(a.table[-1], copy)])
    fork = Seq(a.tokens, table=a.table[:-1] + [copy], cached=a.cached)
    fork.prompt_len = a.prompt_len
    for _ in range(NEW - 1):
        step(runner, blocks, [a, fork])
    assert fork.generated == a.generated == hf_greedy(reference, a.tokens[: a.prompt_len], NEW)


def test_per_position_logits_and_hidden_states_equal_the_plain_forward(arch):
    model_type, paged, reference = arch
    runner = TransformersRunner(paged, num_blocks=32, block_size=BLOCK)
    blocks = Blocks(32)
    rows = [(blocks.grow([], len(PROMPT_A)), PROMPT_A, 0), (blocks.grow([], len(PROMPT_C)), PROMPT_C, 0)]
    logits = runner.forward(StepBatch.build(rows, BLOCK, runner.device, logit_counts=[len(PROMPT_A), 2]))
    assert logits.shape == (len(PROMPT_A) + 2, VOCAB) and logits.dtype == torch.float32
    with torch.no_grad():
        want_a = reference(torch.tensor([PROMPT_A]), output_hidden_states=True)
        want_c = reference(torch.tensor([PROMPT_C]), output_hidden_states=True)
    torch.testing.assert_close(logits[: len(PROMPT_A)], want_a.logits[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits[len(PROMPT_A) :], want_c.logits[0, -2:], atol=2e-5, rtol=1e-4)
    hidden = torch.cat([want_a.hidden_states[-1][0], want_c.hidden_states[-1][0, -2:]])
    torch.testing.assert_close(runner.last_hidden, hidden, atol=2e-5, rtol=1e-4)


def _write_config(directory, **fields) -> None:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(fields))


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "latent attention"),
        ({"model_type": "gemma3"}, "multimodal"),
        ({"model_type": "qwen3_next"}, "recurrent state"),
        ({"model_type": "mamba"}, "supported: llama"),
    ],
)
def test_unsupported_architectures_are_refused_in_one_line(tmp_path, config, named):
    directory = tmp_path / "model"
    _write_config(directory, **config)
    with pytest.raises(UnsupportedModelError, match=named) as info:
        load_model(directory, torch.float32, torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_lora_rows_equal_their_merged_models_in_one_step(tiny_model_dir, tmp_path_factory):
    """Per-row adapters (two adapters and the base model in one step) equal peft's merged weights."""
    from server.engine.lora import LoraBank, load_adapter
    from tests.server.lora_util import make_adapter

    root = tmp_path_factory.mktemp("hf-lora")
    a = make_adapter(tiny_model_dir, root / "a", seed=1, merged_dir=root / "a-merged")
    b = make_adapter(tiny_model_dir, root / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], rank=8, alpha=4.0,
                     use_rslora=True, merged_dir=root / "b-merged")
    cpu = torch.device("cpu")
    hf = load_model(tiny_model_dir, torch.float32, cpu)
    bank = LoraBank([load_adapter("a", a, hf), load_adapter("b", b, hf)])
    runner = TransformersRunner(hf, num_blocks=32, block_size=BLOCK, lora=bank)
    prompts = [PROMPT_A, PROMPT_C, PROMPT_B]

    def logits_of(model_runner, chosen, adapters=None):
        allocator = Blocks(32)
        rows = [(allocator.grow([], len(prompts[i])), prompts[i], 0) for i in chosen]
        return model_runner.forward(StepBatch.build(rows, BLOCK, cpu, row_adapters=adapters))

    mixed = logits_of(runner, [0, 1, 2], adapters=[1, 0, 2])
    base = TransformersRunner(load_model(tiny_model_dir, torch.float32, cpu), num_blocks=32, block_size=BLOCK)
    merged = {n: TransformersRunner(load_model(root / f"{n}-merged", torch.float32, cpu), 32, BLOCK) for n in "ab"}
    torch.testing.assert_close(mixed[0], logits_of(merged["a"], [0])[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], logits_of(base, [1])[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[2], logits_of(merged["b"], [2])[0], atol=1e-4, rtol=1e-4)
    assert (mixed[0] - logits_of(base, [0])[0]).abs().max() > 1e-2  # the adapter changes the output
    assert runner.step_lora is None  # the step's groups do not leak into the next forward
    torch.testing.assert_close(logits_of(runner, [0])[0], logits_of(base, [0])[0], atol=1e-5, rtol=1e-5)


def test_no_dense_mask_reaches_the_attention(arch, monkeypatch):
    """transformers builds no mask for the paged implementation: every attention call gets None."""
    from transformers import AttentionInterface

    from server.engine import hf_runner

    _, paged, _ = arch
    masks = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return hf_runner.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)

    runner = TransformersRunner(paged, num_blocks=16, block_size=BLOCK)  # registers the real function
    monkeypatch.setitem(AttentionInterface._global_mapping, hf_runner.ATTN_IMPLEMENTATION, recording)
    blocks = Blocks(16)
    step(runner, blocks, [Seq(PROMPT_A), Seq(PROMPT_C)])
    assert len(masks) == paged.config.num_hidden_layers and all(mask is None for mask in masks)


def test_engine_generates_like_transformers_with_a_cached_prefix(arch, default_tokenizer):
    """Through the engine: block manager, scheduler, prefix cache, mixed prefill/decode steps."""
    from sampler import SamplingParams
    from server.engine.engine import Engine
    from server.engine.sequence import GenerationRequest

    _, paged, reference = arch
    engine = Engine(TransformersRunner(paged, num_blocks=48, block_size=BLOCK), default_tokenizer,
                    max_batch_size=4, max_model_len=64)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def submit(name: str, prompt: list[int]) -> None:
        outputs[name] = []

        def sink(delta) -> None:
            outputs[name] += delta.token_ids
            cached[name] = delta.cached_tokens

        engine.submit(GenerationRequest(request_id=name, sink=sink, prompt_token_ids=prompt, max_tokens=NEW,
                                        params=SamplingParams(temperature=0.0), ignore_eos=True))

    def run_until(names) -> None:
        for _ in range(200):
            if all(len(outputs[n]) == NEW for n in names) and not engine.num_running:
                return
            engine.step()
        raise AssertionError("engine did not finish")

    submit("a", PROMPT_A)
    run_until(["a"])
    submit("b", PROMPT_B)  # reuses A's first two blocks, batched with C's prefill
    submit("c", PROMPT_C)
    run_until(["b", "c"])
    assert cached["b"] == 8 and cached["c"] == 0
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        assert outputs[name] == hf_greedy(reference, prompt, NEW), name
