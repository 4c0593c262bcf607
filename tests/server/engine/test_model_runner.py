"""The slot-based runner must reproduce transformers' own forward exactly (up to float noise)."""

import torch

from server.engine.model import ModelRunner, load_hf_model


def _reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_extend_and_decode_match_transformers(tiny_model_dir):
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner(hf, max_slots=3, max_len=64)
    a = [5, 17, 300, 42, 7, 9]
    b = [11, 12, 13]
    ref_a, ref_b = _reference_logits(hf, a), _reference_logits(hf, b)
    # Prefill a in two chunks into slot 0, b into slot 1.
    runner.extend(0, torch.tensor(a[:4]), 0)
    last_a = runner.extend(0, torch.tensor(a[4:5]), 4)
    last_b = runner.extend(1, torch.tensor(b), 0)
    torch.testing.assert_close(last_a, ref_a[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last_b, ref_b[-1], atol=1e-4, rtol=1e-4)
    # One batched decode step: a's 6th token and a new token for b, at different positions.
    logits = runner.decode(torch.tensor([a[5], 99]), torch.tensor([5, 3]))
    torch.testing.assert_close(logits[0], ref_a[5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], _reference_logits(hf, b + [99])[-1], atol=1e-4, rtol=1e-4)


def test_move_slot_keeps_sequence(tiny_model_dir):
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner(hf, max_slots=2, max_len=32)
    ids = [3, 4, 5, 6]
    runner.extend(1, torch.tensor(ids[:3]), 0)
    runner.move_slot(1, 0, 3)
    logits = runner.decode(torch.tensor([ids[3]]), torch.tensor([3]))
    torch.testing.assert_close(logits[0], _reference_logits(hf, ids)[-1], atol=1e-4, rtol=1e-4)


def test_mixed_step_matches_transformers(tiny_model_dir):
    """Decode rows, a prefill and a jump-forward continuation in one forward."""
    from server.engine.model import StepBatch

    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    runner = ModelRunner(hf, max_slots=4, max_len=64)
    seqs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22]]
    runner.extend(0, torch.tensor(seqs[0][:3]), 0)
    runner.extend(1, torch.tensor(seqs[1][:2]), 0)
    runner.extend(3, torch.tensor(seqs[3][:2]), 0)
    rows = [
        (0, seqs[0][3:], 3),  # decode
        (1, seqs[1][2:], 2),  # decode
        (2, seqs[2], 0),  # prefill of a new sequence
        (3, seqs[3][2:], 2),  # three forced tokens at once
    ]
    logits = runner.forward(StepBatch.build(rows, 4, torch.device("cpu")))
    for row, ids in enumerate(seqs):
        torch.testing.assert_close(logits[row], _reference_logits(hf, ids)[-1], atol=1e-4, rtol=1e-4)
