"""The engine's own speculation (prompt lookup, cut by the grammar, adaptive, priced by the
measured step cost): drafts are fed and kept, and never change an output."""

from __future__ import annotations

import copy

import pytest
import torch

from constraints import ConstraintSpec
from kernels.quantized_linear import supports
from sampler import SamplingParams
from server.engine.drafts import Draft
from server.engine.engine import DEFAULT_MAX_DRAFT_TOKENS, Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.prompt_lookup import PromptLookup
from server.engine.sequence import GenerationRequest, ReasoningPhase
from server.engine.speculation import INITIAL_LENGTH, Speculator
from server.engine.speculation_policy import SpeculationPolicy

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------- the parts


def test_lookup_proposes_what_followed_the_longest_suffix_latest() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2])
    assert lookup.proposal(3) == []  # 2 never occurred before
    lookup.observe(6)
    assert lookup.proposal(3) == [7, 9, 2]  # the latest 6 was followed by 7 9 2
    lookup.observe(7)
    lookup.observe(9)
    assert lookup.proposal(2) == [2, 6]  # "6 7 9" occurred once: what followed it
    lookup.observe(4)
    assert lookup.proposal(5) == []


def test_lookup_proposes_after_a_draft_it_has_not_observed() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2, 3])
    assert lookup.proposal_after([6, 7], 3) == [9, 2, 3]  # as if 6 7 were output: the latest 6 7
    assert lookup.proposal_after([4], 3) == []  # 4 never occurred
    assert lookup.proposal_after([], 2) == lookup.proposal(2)
    assert lookup.context == [5, 6, 7, 8, 1, 6, 7, 9, 2, 3]  # nothing was observed


def _accept_text(matcher, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token), text


def test_a_composed_draft_copies_a_value_closes_it_and_bridges_to_the_next(default_compiler, default_tokenizer):
    """Inside a string value copied from the prompt: the rest of the value, the quote that ends
    it where the prompt's line ends, and the text the grammar forces up to the next value."""
    from server.engine.grammar_draft import compose_draft

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"], "additionalProperties": False}
    matcher = default_compiler.compile(ConstraintSpec("json_schema", schema)).new_matcher()
    encode = lambda text: default_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    lookup = PromptLookup(encode("Name: Ada Lovelace\nCity: London\n"))
    _accept_text(matcher, default_tokenizer, '{"name":')
    bridge = compose_draft(matcher, lookup, 16, 4).tokens
    assert default_tokenizer.decode(bridge).startswith(' "')  # the forced text, its last token included
    value = encode('{"name": "Ada')[len(encode('{"name":')):]
    for token in value:
        assert matcher.accept_token(token)
        lookup.observe(token)
    composed = compose_draft(matcher, lookup, 16, 4)
    draft = composed.tokens
    # the value so far is Ġ" Ad a where the prompt has ĠAda: the copy is found by its text
    assert [default_tokenizer.decode([t]) for t in value] == [' "', "Ad", "a"]
    assert default_tokenizer.decode(draft) == ' Lovelace", "city": "'
    pieces = [(default_tokenizer.decode([t]), kind) for t, kind in zip(draft, composed.kinds, strict=True)]
    closing = next(i for i, (_, kind) in enumerate(pieces) if kind != "copy")
    assert "".join(text for text, _ in pieces[:closing]) == " Lovelace"  # the copy, then its closing quote
    assert pieces[closing][1] == "close" and {kind for _, kind in pieces[closing + 1 :]} == {"forced"}
    assert all(matcher.accept_token(t) for t in draft)  # composing left the matcher's state as it was


def test_a_client_prediction_is_verified_through_the_tokens_the_grammar_forces(tiny_hf, default_tokenizer,
                                                                            default_compiler):
    """Jump-forward appends forced tokens after a kept draft token; where they are the draft's
    next tokens (a correct prediction) they are kept in the same step, not fed again."""
    compiled = default_compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    prompt = [1, *default_tokenizer.encode(" a person", add_special_tokens=False)]
    request = {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.0), "max_tokens": 40}
    (plain, _), = [(out, stats) for out, stats, _ in [run(tiny_hf, default_tokenizer, [
        dict(request, matcher=compiled.new_matcher())], speculation=False)]]
    tokens = plain[0][0]
    predicted, stats, _ = run(tiny_hf, default_tokenizer, [
        dict(request, matcher=compiled.new_matcher(), prediction_token_ids=tokens)], speculation=False)
    assert predicted == plain
    assert stats.forced_tokens > 0 and stats.accepted_draft_tokens > 0
    assert stats.steps <= 1 + -(-len(tokens) // DEFAULT_MAX_DRAFT_TOKENS) + 1  # prefill, then whole drafts


def test_speculator_grows_on_acceptance_and_backs_off_on_misses() -> None:
    spec = Speculator(None, PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1]), max_length=16)
    assert spec.proposal(32) == [2, 3, 4, 5][:INITIAL_LENGTH] and spec.source == "prompt"
    spec.settle(4, 4)
    assert spec.length == 8 and spec.lookup_accepted == 4
    spec.settle(8, 0)  # a first miss: shorter drafts, no wait
    assert spec.length == 4 and spec.ready and spec.proposal(32)
    spec.settle(4, 0)  # a second miss in a row: wait one proposal
    assert spec.length == 2 and not spec.ready
    assert spec.proposal(32) == []
    assert spec.ready and spec.proposal(32)
    assert spec.lookup_rejected == 12 and spec.accepted == spec.rejected == 0  # usage's prediction counts


def test_prediction_leads_and_lookup_follows_when_it_is_off_track() -> None:
    spec = Speculator(Draft([10, 11, 12]), PromptLookup([7, 8, 9]), max_length=8)
    assert spec.proposal(8) == [10, 11, 12] and spec.source == "prediction"
    spec.observe(99)  # off the prediction
    spec.observe(7)
    assert spec.proposal(8) == [8, 9, 99, 7] and spec.source == "prompt"  # INITIAL_LENGTH tokens


def test_policy_prices_draft_tokens_from_the_fitted_step_cost() -> None:
    policy = SpeculationPolicy()
    assert policy.threshold(16) == 0.0  # nothing measured: drafts go through (and get measured)
    assert policy.worth(0.5, 16) and not policy.worth(0.1, 1)  # rarely kept drafts never pay
    for tokens in [1, 4, 16, 1, 8, 32] * 4:
        policy.record(tokens, 0.040 + 0.002 * tokens)
    fixed, slope = policy.cost()
    assert fixed == pytest.approx(0.040) and slope == pytest.approx(0.002)
    assert policy.threshold(1) == pytest.approx(0.002 / 0.042)
    assert policy.worth(0.3, 1) and not policy.worth(0.3, 64)  # 64 tokens: 0.128 / 0.168 needed


def test_policy_prices_a_launch_that_outlasts_the_device() -> None:
    """The H100's mixed steps: a one-token step replays its full graph at once (device-bound),
    a draft step launches piecewise graphs a layer at a time (host-bound, the device idles)."""
    policy = SpeculationPolicy()
    for tokens in [1, 3, 1, 5] * 4:
        launch = 0.0001 if tokens == 1 else 0.004 * tokens
        policy.record_launched(tokens, device_s=0.006, launch_s=launch)
    fixed, slope = policy.cost()
    assert slope > 0.003  # the device's 6 ms alone would make drafts free
    assert not policy.worth(0.5, 1)  # a draft token must be kept more often than not to pay


def test_a_refused_value_start_does_not_shorten_the_copies() -> None:
    """A copy's length follows its copied tokens: a guessed value start refused (the model picked
    another field) neither halves it nor makes the sequence wait; a copied token refused does."""
    spec = Speculator(None, PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), max_length=16)
    spec.proposal(8)
    spec.kinds = ["forced", "guess", "copy", "copy"]
    spec.settle(4, 1)  # the forced token kept, the guess refused
    assert spec.length == INITIAL_LENGTH and spec.ready
    spec.kinds = ["copy", "copy", "copy", "copy"]
    spec.settle(4, 4)
    assert spec.length == 2 * INITIAL_LENGTH
    spec.kinds = ["forced", "copy", "copy", "close"]
    spec.settle(4, 2)  # one copied token kept, the next refused
    assert spec.length == 2


def test_grammar_cuts_a_draft_at_the_first_refused_token(default_compiler, default_tokenizer) -> None:
    from server.engine.draft_verifier import DraftVerifier

    matcher = default_compiler.compile(ConstraintSpec("regex", "[0-9]{3}-[a-z]+")).new_matcher()
    ids = default_tokenizer.encode("123-abc", add_special_tokens=False)
    bad = default_tokenizer.encode("X", add_special_tokens=False)
    draft = ids[:2] + bad + ids[2:]
    seq = type("Row", (), {"matcher": matcher})()
    assert DraftVerifier._grammar_cut(seq, draft) == ids[:2]
    assert matcher.accept_token(ids[0])  # the probe left the state where it was


# ---------------------------------------------------------------------- same output, drafts fed


def run(hf, tokenizer, requests, *, speculation: bool, slots: int = 4, overlap: bool = False,
        quantization: str = "none"):
    if quantization != "none":  # quantizing re-points the model's modules: keep the shared one intact
        hf = copy.deepcopy(hf)
    runner = ModelRunner.for_sequences(hf, slots, 256, block_size=4, quantization=quantization)
    engine = Engine(runner, tokenizer, max_batch_size=slots,
                    max_model_len=256, speculation=speculation, overlap=overlap)
    # The tiny model's forward costs less than verifying, so the cost policy would price most
    # drafts out (correctly); these tests are about what drafts do to outputs, so every one goes in.
    engine.drafts.policy.worth = lambda acceptance, tokens: True
    deltas: dict[int, list] = {i: [] for i in range(len(requests))}
    for i, fields in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"s{i}", sink=deltas[i].append, eos_token_ids=frozenset({2}),
                                        **fields))
    for _ in range(400):
        if all(d and d[-1].finish_reason for d in deltas.values()):
            break
        engine.step()
    engine.flush()
    outputs = {i: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds), ds[-1].finish_reason)
               for i, ds in deltas.items()}
    return outputs, engine.stats, deltas


def extraction_requests(compiler, tokenizer) -> list[dict]:
    """Prompts that repeat themselves (the tiny random model copies its context), free (no
    drafts of its own) and constrained, greedy and seeded, one with a stop string inside the
    copied text, one with a prediction."""
    text = tokenizer.encode(" alpha beta gamma delta alpha beta gamma delta alpha beta", add_special_tokens=False)
    prompt = [1, *text, *text]
    compiled = compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    words = compiler.compile(ConstraintSpec("regex", "( (alpha|beta|gamma|delta))+"))
    return [
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.0), "max_tokens": 40},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.8, seed=7), "max_tokens": 40},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.0), "max_tokens": 60,
         "matcher": compiled.new_matcher()},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.9, seed=3), "max_tokens": 60,
         "matcher": compiled.new_matcher()},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.0), "max_tokens": 40,
         "stop": (" gamma",), "matcher": words.new_matcher()},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.7, seed=9), "max_tokens": 40,
         "matcher": words.new_matcher()},
        {"prompt_token_ids": prompt, "params": SamplingParams(temperature=0.0), "max_tokens": 30,
         "prediction_token_ids": text[:6]},
    ]


@pytest.mark.parametrize(("overlap", "quantization"), [(False, "none"), (True, "none"), (False, "int4")]
                         + ([(False, "bf16")] if supports("bf16", torch.empty(1, 1)) else []))
def test_drafts_never_change_an_output(tiny_hf, default_tokenizer, default_compiler, overlap, quantization) -> None:
    results = {}
    for speculation in (False, True):
        requests = extraction_requests(default_compiler, default_tokenizer)
        results[speculation] = run(tiny_hf, default_tokenizer, requests, speculation=speculation, overlap=overlap,
                                   quantization=quantization)
    (off, off_stats, _), (on, on_stats, deltas) = results[False], results[True]
    assert on == off
    assert off_stats.lookup_draft_tokens == 0
    assert on_stats.accepted_lookup_draft_tokens > 0 and on_stats.steps < off_stats.steps
    assert sum(d[-1].accepted_draft_tokens for d in deltas.values()) == on_stats.accepted_lookup_draft_tokens
    last = deltas[6][-1]  # the client's prediction is still verified alongside, and counted apart
    assert last.accepted_prediction_tokens + last.rejected_prediction_tokens > 0


def test_constrained_outputs_hold_only_tokens_the_grammar_allows(tiny_hf, default_tokenizer, default_compiler):
    outputs, stats, _ = run(tiny_hf, default_tokenizer, extraction_requests(default_compiler, default_tokenizer),
                            speculation=True)
    compiled = default_compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    for i in (2, 3):
        matcher = compiled.new_matcher()
        tokens = outputs[i][0]
        assert all(matcher.accept_token(t) for t in tokens), outputs[i]
    assert stats.lookup_draft_tokens > 0


def test_a_draft_crossing_the_end_of_reasoning_changes_nothing(tiny_hf, default_tokenizer, default_compiler):
    """The prompt holds reasoning, the end marker and an answer: lookup drafts run across the
    marker into the constrained answer, where the grammar and the verification take over."""
    marker = default_tokenizer.encode("</think>", add_special_tokens=False)[-1]
    words = default_tokenizer.encode(" think think think", add_special_tokens=False)
    answer = default_tokenizer.encode('{"name": "ab", "age": 3}', add_special_tokens=False)
    prompt = [1, *words, marker, *answer, *words, marker, *answer, *words]
    compiled = default_compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    params = SamplingParams(temperature=0.0, min_tokens=2, banned_until_min_tokens=frozenset({marker}),
                            logit_bias={marker: 4.0})
    outputs = {}
    for speculation in (False, True):
        request = {"prompt_token_ids": prompt, "params": params, "max_tokens": 50,
                   "matcher": compiled.new_matcher(), "reasoning": ReasoningPhase(end_ids=(marker,))}
        outputs[speculation] = run(tiny_hf, default_tokenizer, [request], speculation=speculation)
    assert outputs[True][0] == outputs[False][0]
    tokens = outputs[True][0][0][0]
    assert marker in tokens  # the reasoning ended; the answer after it parses
    matcher = compiled.new_matcher()
    assert all(matcher.accept_token(t) for t in tokens[tokens.index(marker) + 1:])
    assert outputs[True][1].lookup_draft_tokens > 0


def test_a_request_can_turn_its_drafts_off(tiny_hf, default_tokenizer, default_compiler):
    requests = [dict(r, speculation=False) for r in extraction_requests(default_compiler, default_tokenizer)[2:5]]
    _, stats, _ = run(tiny_hf, default_tokenizer, requests, speculation=True)
    assert stats.lookup_draft_tokens == 0


CHECKED = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True, "minItems": 2,
                                                    "items": {"type": "string"}}},
           "required": ["tags"], "minProperties": 2}


def test_run_time_checks_hold_under_drafts(tiny_hf, default_tokenizer, default_compiler):
    """Biased towards the same few tokens (and a prompt that repeats an item, for the lookup
    drafts), the model keeps trying to close an item it wrote already; the run-time check
    refuses each repeat, so the items it writes are distinct, with and without drafts alike."""
    import re

    encode = lambda text: default_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    bias = {t: 100.0 for t in encode('alpha", "')}  # 'alpha', '",', ' "' (a space, then a closing quote)
    repeated = encode('{"tags": ["alpha", "alpha", "alpha", "alpha"]}')
    compiled = default_compiler.compile(ConstraintSpec("json_schema", CHECKED))
    requests = [{"prompt_token_ids": [1, *repeated, *repeated], "params": params, "max_tokens": 24}
                for params in (SamplingParams(temperature=0.0, logit_bias=bias),
                               SamplingParams(temperature=0.9, seed=5, logit_bias=bias))]
    off, _, _ = run(tiny_hf, default_tokenizer, _fresh(requests, compiled), speculation=False)
    on, _, _ = run(tiny_hf, default_tokenizer, _fresh(requests, compiled), speculation=True)
    assert on == off
    for tokens, text, _ in on.values():
        matcher = compiled.new_matcher()
        assert all(matcher.accept_token(t) for t in tokens), text
        items = re.findall(r'"((?:[^"\\]|\\.)*)"(?=\s*[,\]])', text.split("[", 1)[1])
        assert len(items) >= 2 and len(set(items)) == len(items), text


def _fresh(requests: list[dict], compiled) -> list[dict]:
    return [{**r, "matcher": compiled.new_matcher()} for r in requests]


def test_prompt_steps_stay_out_of_the_step_cost_fit(tiny_hf, default_tokenizer):
    """A prompt token can cost far less than an output token (a long GEMM chunk, a quantized
    runner's dense route): only steps that feed output tokens alone price the drafts."""
    runner = ModelRunner.for_sequences(tiny_hf, 2, 256, block_size=4)
    engine = Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=256, overlap=False)
    recorded: list[int] = []
    record = engine.drafts.policy.record
    engine.drafts.policy.record = lambda tokens, seconds: (recorded.append(tokens), record(tokens, seconds))
    engine.submit(GenerationRequest(request_id="p", prompt_token_ids=list(range(5, 45)), sink=lambda d: None,
                                    params=SamplingParams(temperature=0.0), max_tokens=6, eos_token_ids=frozenset()))
    for _ in range(4):
        engine.step()
    assert recorded[0] == 0 and recorded[1:] == [1] * (len(recorded) - 1) and len(recorded) >= 3
