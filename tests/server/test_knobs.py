"""Generation knobs of the TensorRT-LLM-style hosted API, SGLang and the hosted platform, end to end:
a real server with the tiny random model, the OpenAI SDK (``extra_body``) or httpx as the client,
and an observable effect asserted for each knob (or a 400 naming it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
import regex

from server.config import Settings
from server.model_loader import ModelSource
from server.render import VERBOSITY_INSTRUCTIONS, documents_prompt
from tests.conftest import RunningServer, start_server

MODEL = "tiny"
CONTEXT = 256
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[RunningServer]:
    settings = Settings(model=str(tiny_model_dir), served_model_name=MODEL, max_batch_size=8, max_model_len=CONTEXT)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name=MODEL))
    yield running
    stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def post(server, path: str, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    return httpx.post(server.base_url + path, json=body, timeout=60)


def complete(server, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body}
    return post(server, "/v1/completions", **body)


def chat(server, path: str = "/v1/chat/completions", **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0, **body}
    return post(server, path, **body)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def greedy_tokens(server, n: int = 12) -> tuple[str, list[int]]:
    """The greedy continuation of PROMPT (text, token ids) on the tiny model."""
    body = ok(complete(server, max_tokens=n, logprobs=0))
    text = body["choices"][0]["text"]
    tok = server.state.tokenizer
    ids = tok(PROMPT + text, add_special_tokens=False).input_ids[len(tok(PROMPT, add_special_tokens=False).input_ids):]
    return text, ids


# --------------------------------------------------------------------------- bad words / bad token ids


def _bannable_phrase(server, text: str) -> str:
    """Two generated tokens whose text the tokenizer encodes back into those tokens (alone or
    after a space), so that banning the phrase must change the greedy output."""
    tok = server.state.tokenizer
    gen_ids = tok(PROMPT + text, add_special_tokens=False).input_ids
    start = len(tok(PROMPT, add_special_tokens=False).input_ids)
    for i in range(start + 1, len(gen_ids) - 1):
        pair = gen_ids[i:i + 2]
        phrase = tok.decode(pair)
        variants = {tuple(tok(v, add_special_tokens=False).input_ids) for v in (phrase, phrase.lstrip(), " " + phrase.lstrip())}
        if tuple(pair) in variants and phrase.strip() and phrase in text:
            return phrase
    pytest.skip("no re-encodable two-token phrase in the greedy output")


@pytest.mark.parametrize("field", ["bad", "bad_words"])
def test_bad_phrase_is_never_generated(server, client, field):
    text, _ = greedy_tokens(server)
    phrase = _bannable_phrase(server, text)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={field: [phrase], "ignore_eos": True})
    banned_text = reply.choices[0].text
    assert phrase in text and phrase not in banned_text
    assert banned_text != text


def test_bad_token_ids_ban_the_greedy_first_token(server, client):
    _, ids = greedy_tokens(server, 4)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                      extra_body={"bad_token_ids": [ids[0]], "ignore_eos": True})
    first = reply.choices[0].logprobs.tokens[0]
    assert first != server.state.tokenizer.decode([ids[0]])


def test_bad_words_validation(server):
    refused(complete(server, bad_token_ids=[10**9]), "bad_token_ids")
    refused(complete(server, bad_words=[""]), "bad_words")
    refused(complete(server, bad=["x" * 300]), "bad")


# --------------------------------------------------------------------------- decaying top-p


def test_top_p_decay_narrows_to_one_token(server, client):
    """After two decays (x0.001 each: top-p 1e-6) only the most likely token is left: its logprob in
    the sampled distribution is 0. The first token is drawn at top-p 1; without the decay, none is 0."""
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, logprobs=0)
    decayed = client.completions.create(**common, extra_body={"top_p_decay": 0.001, "top_p_min": 1e-9,
                                                              "ignore_eos": True})
    plain = client.completions.create(**common, extra_body={"ignore_eos": True})
    assert decayed.choices[0].logprobs.token_logprobs[2:] == [0.0] * 6
    assert decayed.choices[0].logprobs.token_logprobs[0] < 0
    assert all(lp < 0 for lp in plain.choices[0].logprobs.token_logprobs)


def test_top_p_reset_id_restores_the_initial_top_p(server, client):
    """With every token a reset id the top-p never decays: the output equals the undecayed one."""
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
    plain = client.completions.create(**common, extra_body={"ignore_eos": True})
    ids = server.state.tokenizer(PROMPT + plain.choices[0].text, add_special_tokens=False).input_ids
    reset = client.completions.create(**common, extra_body={"ignore_eos": True, "top_p_decay": 0.001,
                                                            "top_p_reset_ids": ids[-8:]})
    decayed = client.completions.create(**common, extra_body={"ignore_eos": True, "top_p_decay": 0.001})
    assert reset.choices[0].text == plain.choices[0].text
    assert decayed.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize(("field", "value"), [("top_p_decay", 0), ("top_p_decay", 1.5), ("top_p_min", 0),
                                              ("top_p_min", 2), ("top_p_reset_ids", [-1])])
def test_top_p_decay_validation(server, field, value):
    refused(complete(server, **{field: value}), field)


# --------------------------------------------------------------------------- prompt handling


def test_truncate_prompt_tokens_keeps_the_end_and_reports_it(server):
    tok = server.state.tokenizer
    n_prompt = len(tok(PROMPT, add_special_tokens=False).input_ids)
    response = complete(server, truncate_prompt_tokens=4, echo=True, max_tokens=2)
    body = ok(response)
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["prompt_tokens_details"]["truncated_tokens"] == n_prompt - 4
    assert response.headers["x-trellis-truncated-prompt-tokens"] == str(n_prompt - 4)
    kept = tok.decode(tok(PROMPT, add_special_tokens=False).input_ids[-4:])
    assert body["choices"][0]["text"].startswith(kept) and kept.strip() in PROMPT


def test_truncate_prompt_tokens_on_chat(server, client):
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 10})
    cut = raw.parse()
    assert cut.usage.prompt_tokens == 10
    assert int(raw.headers["x-trellis-truncated-prompt-tokens"]) == full.usage.prompt_tokens - 10
    untouched = ok(chat(server, truncate_prompt_tokens=CONTEXT))
    assert "truncated_tokens" not in untouched["usage"].get("prompt_tokens_details", {})
    refused(chat(server, truncate_prompt_tokens=0), "truncate_prompt_tokens")
    refused(chat(server, truncate_prompt_tokens=CONTEXT + 1), "truncate_prompt_tokens")


def test_cached_tokens_reported_from_the_prefix_cache(server, client):
    messages = [{"role": "user", "content": "a prompt seen once before " + "and long enough to fill blocks " * 8}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"return_cached_tokens_details": True})
    before = first.usage.prompt_tokens_details.cached_tokens  # asked for: reported (the template's
    assert before < first.usage.prompt_tokens - 16  # shared opening may already be cached)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens  # reported whenever a prefix was reused
    assert before < cached < again.usage.prompt_tokens
    assert cached % 16 == 0  # whole blocks


def _prompt_tokens(server, **body) -> int:
    return ok(chat(server, max_tokens=1, **body))["usage"]["prompt_tokens"]


def test_message_name_reaches_the_template(server):
    """The default template ignores names: the name is written before the content. A template
    that shows names gets them as they are."""
    named = [{"role": "user", "name": "alice", "content": "hi"}]
    assert _prompt_tokens(server, messages=named) == _prompt_tokens(
        server, messages=[{"role": "user", "content": "alice: hi"}])
    assert _prompt_tokens(server, messages=named) != _prompt_tokens(server, messages=[{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}{{ m.name }}|{{ m.content }}\n{% endfor %}"
    tok = server.state.tokenizer
    assert _prompt_tokens(server, messages=named, chat_template=template) == len(
        tok("alice|hi\n", add_special_tokens=False).input_ids)


def test_documents_reach_the_template_or_the_system_prompt(server):
    docs = [{"title": "Trellis", "text": "Trellis serves language models."}, {"text": "Second doc."}]
    user = {"role": "user", "content": "What does Trellis do?"}
    with_docs = _prompt_tokens(server, messages=[user], documents=docs)
    spelled_out = _prompt_tokens(server, messages=[{"role": "system", "content": documents_prompt(docs)}, user])
    assert with_docs == spelled_out
    template = "{% for d in documents %}<{{ d.title }}>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = server.state.tokenizer
    expected = len(tok("<Trellis><>What does Trellis do?", add_special_tokens=False).input_ids)
    assert _prompt_tokens(server, messages=[user], documents=docs, chat_template=template) == expected


def test_verbosity_reaches_the_template_or_the_system_prompt(server):
    user = {"role": "user", "content": "Explain rain."}
    for level in ("low", "high"):
        assert _prompt_tokens(server, messages=[user], verbosity=level) == _prompt_tokens(
            server, messages=[{"role": "system", "content": VERBOSITY_INSTRUCTIONS[level]}, user])
    template = "[{{ verbosity }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = server.state.tokenizer
    expected = len(tok("[medium]Explain rain.", add_special_tokens=False).input_ids)
    assert _prompt_tokens(server, messages=[user], verbosity="medium", chat_template=template) == expected
    refused(chat(server, verbosity="extreme"), "verbosity")


def test_add_special_tokens_on_chat_adds_the_tokenizers_bos(default_tokenizer):
    """The default tokenizer adds no BOS, so this is checked on a copy whose post-processor does."""
    import copy

    from tokenizers import processors

    from server.render import RenderJob, render_and_tokenize

    tok = copy.deepcopy(default_tokenizer)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                  special_tokens=[("<|endoftext|>", 0)])
    job = dict(messages=[{"role": "user", "content": "hi"}], chat_template=None, add_generation_prompt=True,
               continue_final_message=False, kwargs={})
    plain = render_and_tokenize(tok, RenderJob(**job))
    special = render_and_tokenize(tok, RenderJob(**job, add_special_tokens=True))
    assert special == [0, *plain]


def test_add_special_tokens_is_accepted_on_chat(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           extra_body={"add_special_tokens": True})
    assert reply.usage.prompt_tokens > 0


def test_echo_on_chat_returns_the_continued_message(server, client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, then"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"echo": True, "continue_final_message": True,
                                                       "add_generation_prompt": False})
    assert reply.choices[0].message.content.startswith("Well, then")


# --------------------------------------------------------------------------- stops


def _regex_inside(text: str) -> str:
    """A regex (an escaped piece of ``text`` and one any-character) matching inside ``text``."""
    return re.escape(text[3:6]) + "(?s:.)"


def test_stop_regex_stops_and_trims_and_matched_stop_names_it(server, client):
    text, _ = greedy_tokens(server)
    pattern = _regex_inside(text)
    match = regex.search(pattern, text)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_regex": pattern, "ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == text[:match.start()]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == match.group(0)
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_regex": [pattern], "no_stop_trim": True, "ignore_eos": True})
    assert kept.choices[0].text == text[:match.end()]


def test_stop_regex_streamed_never_leaks_the_stop(server, client):
    text, _ = greedy_tokens(server)
    pattern = _regex_inside(text)
    match = regex.search(pattern, text)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"stop_regex": pattern, "ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:match.start()]
    assert chunks[-1].choices[0].model_extra["matched_stop"] == match.group(0)


def test_stop_regex_validation(server):
    refused(complete(server, stop_regex="("), "stop_regex")
    refused(complete(server, stop_regex="a*"), "stop_regex")
    refused(complete(server, stop_regex=["x"] * 33), "stop_regex")


def test_matched_stop_for_strings_token_ids_eos_and_length(server):
    text, ids = greedy_tokens(server)
    stop = text[4:7]
    by_string = ok(complete(server, stop=[stop]))["choices"][0]
    assert by_string["matched_stop"] == stop and by_string["stop_reason"] == stop
    by_token = ok(complete(server, stop_token_ids=[ids[2]]))["choices"][0]
    assert by_token["matched_stop"] == ids[2]
    eos = server.state.tokenizer.eos_token_id
    by_eos = ok(complete(server, ignore_eos=False, logit_bias={str(eos): 100}))["choices"][0]
    assert by_eos["finish_reason"] == "stop" and by_eos["matched_stop"] == eos and by_eos["stop_reason"] is None
    by_length = ok(complete(server, max_tokens=2))["choices"][0]
    assert by_length["finish_reason"] == "length" and by_length["matched_stop"] is None
    streamed = ok_stream(chat(server, stream=True, stop_token_ids=[ids[0]], messages=[{"role": "user", "content": "x"}]))
    assert "matched_stop" in streamed[-1]["choices"][0]


def ok_stream(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1] if json.loads(line)["choices"]]


def test_up_to_32_stop_sequences(server):
    ok(complete(server, stop=[f"zz{i}" for i in range(32)]))
    refused(complete(server, stop=[f"zz{i}" for i in range(33)]), "stop")


# --------------------------------------------------------------------------- detokenizer


def test_spaces_between_special_tokens(server):
    start = server.state.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = dict(max_tokens=3, logit_bias={str(start): 100}, skip_special_tokens=False)
    spaced = ok(complete(server, spaces_between_special_tokens=True, **forced))["choices"][0]["text"]
    joined = ok(complete(server, spaces_between_special_tokens=False, **forced))["choices"][0]["text"]
    assert spaced == "<|im_start|> <|im_start|> <|im_start|>"
    assert joined == "<|im_start|><|im_start|><|im_start|>"


# --------------------------------------------------------------------------- limits


def test_temperature_up_to_4(server):
    ok(complete(server, temperature=4, max_tokens=2))
    refused(complete(server, temperature=4.5), "temperature")


def test_max_tokens_overflow_error_on_v1_clamp_on_v0_and_with_the_flag(server):
    long_prompt = " ".join(["word"] * (CONTEXT - 20))
    n_prompt = len(server.state.tokenizer(long_prompt).input_ids)
    room = CONTEXT - n_prompt
    body = dict(prompt=long_prompt, max_tokens=500, temperature=0, ignore_eos=True)
    error = post(server, "/v1/completions", **body)
    assert error.status_code == 400 and error.json()["error"]["code"] == "context_length_exceeded"
    response = post(server, "/v0/completions", **body)
    clamped = ok(response)
    assert clamped["usage"]["completion_tokens"] == room and clamped["choices"][0]["finish_reason"] == "length"
    assert response.headers["x-trellis-clamped-max-tokens"] == f"500->{room}"  # never silently
    settings = server.state.settings
    settings.max_tokens_overflow = "clamp"
    try:
        response = post(server, "/v1/completions", **body)
        assert ok(response)["usage"]["completion_tokens"] == room
        assert response.headers["x-trellis-clamped-max-tokens"] == f"500->{room}"
        fitting = post(server, "/v1/completions", **{**body, "max_tokens": 2})
        assert ok(fitting) and "x-trellis-clamped-max-tokens" not in fitting.headers
    finally:
        settings.max_tokens_overflow = "error"


# --------------------------------------------------------------------------- refused on this model


def test_custom_logit_processor_needs_the_flag(server):
    error = refused(complete(server, custom_logit_processor="{}"), "custom_logit_processor")
    assert "--enable-custom-logit-processor" in error["message"]
    server.state.settings.enable_custom_logit_processor = True
    try:  # enabled, it is loaded (tests/server/test_custom_logit_processor.py runs real ones)
        error = refused(complete(server, custom_logit_processor="{}"), "custom_logit_processor")
        assert "cannot be loaded" in error["message"]
    finally:
        server.state.settings.enable_custom_logit_processor = False


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
])
def test_media_parts_are_refused_on_a_text_only_model(server, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    error = refused(chat(server, messages=messages), "messages[0].content")
    assert "text-only" in error["message"] and part["type"] in error["message"]


@pytest.mark.parametrize(("field", "value", "says"), [("max_dynamic_patch", 12, "text-only"),
                                                      ("min_dynamic_patch", 1, "text-only"),
                                                      ("deep_research", True, "reasoning")])
def test_refused_on_this_model_with_the_reason(server, field, value, says):
    error = refused(chat(server, **{field: value}), field)
    assert says in error["message"]


def test_v0_drops_the_refused_knobs_and_names_them(server):
    response = chat(server, "/v0/chat/completions", deep_research=True, max_dynamic_patch=4)
    ok(response)
    assert set(response.headers["x-trellis-dropped-params"].split(",")) == {"deep_research", "max_dynamic_patch"}


# --------------------------------------------------------------------------- the real default model


@pytest.mark.real_model
def test_real_model_never_says_a_banned_word(real_server):
    """SmolLM2 answers "Paris" greedily; with the word banned (as TensorRT-LLM's bad words) it
    cannot, and it still answers."""
    client = real_server.client()
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    free = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=12,
                                          temperature=0)
    assert "Paris" in free.choices[0].message.content
    banned = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=12,
                                            temperature=0, extra_body={"bad": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content
    assert banned.choices[0].message.content.strip()
