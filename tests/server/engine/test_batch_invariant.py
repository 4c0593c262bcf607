"""``ModelRunner(batch_invariant=True)``: one sequence's logits are the same bits alone, among other
rows, inside a multi-token verification and with a prompt chunk in the step. On CUDA in bfloat16
(the case cuBLAS and split attention break); in Triton's interpreter the same plumbing on the CPU.
And the CPU's float32 runner as it is by default: its projections from packed weights
(:mod:`kernels.cpu_linear`) keep each row's bits, and with each prompt block attended on its own
a prompt's bits do not depend on its chunks (a prefix-cache hit) either."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.cpu_fused import cpu_fused_ops
from server.engine.model import ModelRunner
from tests.server.engine.paged_util import extend, step

PROMPT = [5, 17, 300, 42, 7, 9, 11, 3, 250, 8, 64, 99, 12, 5, 200, 31, 77, 18, 2]
NEXT = [40, 41, 42, 43]  # the tokens that follow the prompt, fed one by one or as one draft


def _model(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


@pytest.fixture(params=["interpret", "cuda"])
def runner(request) -> ModelRunner:
    if request.param == "cuda":
        if not torch.cuda.is_available() or kernels.triton_kernels() is None or kernels.interpreter_enabled():
            pytest.skip("no compiled Triton on CUDA here")
        model, use_triton = _model(torch.device("cuda"), torch.bfloat16), None
    else:
        if not kernels.interpreter_enabled() or kernels.triton_kernels() is None:
            pytest.skip("the Triton interpreter is not enabled in this process")
        model, use_triton = _model(torch.device("cpu"), torch.float32), True
    made = ModelRunner.for_sequences(model, 8, 128, block_size=16, use_triton=use_triton, batch_invariant=True)
    assert made.dense.batch_invariant and made.gemv is None
    return made


def _among_others(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of PROMPT + NEXT[0] fed as a one-row step, and as one decode row among five
    with a prompt chunk in the same step (sequences 0 and 1 both hold PROMPT)."""
    extend(runner, 0, PROMPT, 0, max_len=128)
    alone = extend(runner, 0, NEXT[:1], len(PROMPT), max_len=128)
    extend(runner, 1, PROMPT, 0, max_len=128)
    for other in (2, 3, 4, 5):  # other sequences with other histories
        extend(runner, other, [other * 10 + i for i in range(7 + other)], 0, max_len=128)
    rows = [(2, [1], 9), (1, NEXT[:1], len(PROMPT)), (3, [2], 10), (6, list(range(30, 60)), 0), (4, [3], 11)]
    return alone, step(runner, rows, max_len=128)[1]


def _one_by_one(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    """The logits after the prompt and after each of NEXT fed alone, in a one-row step."""
    logits = [extend(runner, slot, PROMPT, 0, max_len=128)]
    for i, token in enumerate(NEXT):
        logits.append(extend(runner, slot, [token], len(PROMPT) + i, max_len=128))
    return logits


@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_its_step(runner) -> None:
    alone = _one_by_one(runner, 0)
    extend(runner, 1, PROMPT, 0, max_len=128)
    for other in (2, 3, 4, 5):  # other sequences with other histories
        extend(runner, other, [other * 10 + i for i in range(7 + other)], 0, max_len=128)
    # the first next token as one decode row among five (and a prompt chunk in the same step)
    rows = [(2, [1], 9), (1, NEXT[:1], len(PROMPT)), (3, [2], 10), (6, list(range(30, 60)), 0), (4, [3], 11)]
    among = step(runner, rows, max_len=128)
    assert torch.equal(among[1], alone[1])
    # the rest as one draft verified in a step with others: a logit per position
    rows = [(5, [4], 12), (1, NEXT[1:], len(PROMPT) + 1), (2, [5], 10)]
    verified = step(runner, rows, max_len=128, logit_counts=[1, len(NEXT) - 1, 1])
    for j in range(len(NEXT) - 1):
        assert torch.equal(verified[1 + j], alone[2 + j]), j


def test_fp8_layers_are_refused_with_batch_invariant_kernels(monkeypatch) -> None:
    """FP8 matmuls (cuBLASLt's scaled GEMM) are not invariant: the combination is refused."""
    from server.engine import model as model_module

    monkeypatch.setattr(model_module.fp8_weights, "attach", lambda *args: object())  # a runner with FP8 layers
    with pytest.raises(ValueError, match="batch-invariant"):
        ModelRunner.for_sequences(_model(torch.device("cpu"), torch.float32), 1, 32, use_triton=True,
                                  batch_invariant=True)


def _float32_cpu_runner() -> ModelRunner:
    ops = cpu_fused_ops()
    if ops is None or not ops.panel_kernel_vectorised():
        pytest.skip("no AVX-512 fused CPU ops here")
    packed = ModelRunner.for_sequences(_model(torch.device("cpu"), torch.float32), 8, 128, block_size=16)
    assert packed.dense.cpu_packed and packed.dense.packed_bytes > 0 and not packed.dense.batch_invariant
    assert packed.attends_outputs_alone  # the engine then cuts prompts at blocks, attends them a block a call
    return packed


@torch.inference_mode()
def test_a_float32_cpu_decode_row_keeps_its_bits_among_others() -> None:
    alone, among = _among_others(_float32_cpu_runner())
    assert torch.equal(among, alone)


@torch.inference_mode()
def test_a_float32_cpu_prompt_keeps_its_bits_however_it_is_chunked() -> None:
    """As the engine runs a float32 CPU runner on steps with prompt tokens (each row's prompt
    tokens counted, prompts cut at blocks): a prompt fed in block-aligned chunks, as after a
    prefix-cache hit, ends with the bits of one chunk, also beside other rows."""
    runner = _float32_cpu_runner()

    def run(slot_rows, prompts):
        return step(runner, slot_rows, max_len=128, prompt_counts=prompts)

    whole = run([(0, PROMPT, 0)], [len(PROMPT)])[0]
    run([(1, PROMPT[:16], 0)], [16])  # the first block, as a cached prefix would be
    assert torch.equal(run([(1, PROMPT[16:], 16)], [len(PROMPT) - 16])[0], whole)
    run([(2, PROMPT[:16], 0)], [16])
    beside = run([(3, [7] * 9, 0), (2, PROMPT[16:], 16)], [9, len(PROMPT) - 16])
    assert torch.equal(beside[1], whole)


def test_the_cpu_path_is_left_as_it_is() -> None:
    runner = ModelRunner.for_sequences(_model(torch.device("cpu"), torch.float32), 1, 32, batch_invariant=True)
    assert not runner.dense.batch_invariant  # the CPU's own kernels: no Triton requested
