"""The paged runner must reproduce transformers' own forward exactly (up to float noise)."""

import torch

from server.engine.model import ModelRunner, load_hf_model
from tests.server.engine.paged_util import extend, step


def _reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_extend_and_decode_match_transformers(tiny_model_dir):
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner.for_sequences(hf, 3, 64, block_size=4)
    a = [5, 17, 300, 42, 7, 9]
    b = [11, 12, 13]
    ref_a, ref_b = _reference_logits(hf, a), _reference_logits(hf, b)
    # Prefill a in two chunks into slot 0, b into slot 1 (a spans two blocks).
    extend(runner, 0, a[:4], 0)
    last_a = extend(runner, 0, a[4:5], 4)
    last_b = extend(runner, 1, b, 0)
    torch.testing.assert_close(last_a, ref_a[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last_b, ref_b[-1], atol=1e-4, rtol=1e-4)
    # One batched decode step: a's 6th token and a new token for b, at different positions.
    logits = step(runner, [(0, [a[5]], 5), (1, [99], 3)])
    torch.testing.assert_close(logits[0], ref_a[5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], _reference_logits(hf, b + [99])[-1], atol=1e-4, rtol=1e-4)


def test_shared_prefix_blocks_and_copied_block(tiny_model_dir):
    """A second sequence reads the first one's full blocks and a copy of its partial block."""
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner.for_sequences(hf, 2, 32, block_size=4)
    ids = [3, 4, 5, 6, 7, 8]
    extend(runner, 0, ids, 0)
    from server.engine.step_batch import StepBatch

    runner.copy_blocks([(2, 9)])  # slot 0's partial second block into a free block
    logits = runner.forward(StepBatch.build([([1, 9], [10], 6)], 4, runner.device))
    torch.testing.assert_close(logits[0], _reference_logits(hf, ids + [10])[-1], atol=1e-4, rtol=1e-4)


def test_mixed_step_matches_transformers(tiny_model_dir):
    """Decode rows, a prefill and a jump-forward continuation in one forward."""
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner.for_sequences(hf, 4, 64, block_size=4)
    seqs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22]]
    extend(runner, 0, seqs[0][:3], 0)
    extend(runner, 1, seqs[1][:2], 0)
    extend(runner, 3, seqs[3][:2], 0)
    rows = [
        (0, seqs[0][3:], 3),  # decode
        (1, seqs[1][2:], 2),  # decode
        (2, seqs[2], 0),  # prefill of a new sequence
        (3, seqs[3][2:], 2),  # three forced tokens at once
    ]
    logits = step(runner, rows)
    for row, ids in enumerate(seqs):
        torch.testing.assert_close(logits[row], _reference_logits(hf, ids)[-1], atol=1e-4, rtol=1e-4)
